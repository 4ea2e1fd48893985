"""Round engine: vmap vs sequential parity, chunking, padding, determinism, no recompiles."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, local_training, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams


def _round(algo, fed, params, config, backend, key=0, r=1):
    state = init_state(algo, params, fed.num_clients)
    step = make_round_step(algo, config, backend)
    return step(state, round_arrays(fed), jax.random.PRNGKey(key), traced_hparams(algo, r))


@pytest.mark.parametrize("name,backend", [("fedavg", "sequential"), ("fola", "sequential"),
                                          ("fedcurv_loo", "sequential"), ("fola", "stepwise")])
def test_vmap_matches_reference_backends(name, backend, small_fed, tiny_model, tiny_params):
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16),
            "fola": lambda: bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16),
            "fedcurv_loo": lambda: bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16,
                                                         variant="leave_one_out")}[name]()
    # 3 of 5 clients per round in chunks of 2: exercises sampling and a zero-weight padding slot.
    config = RoundConfig(num_clients=5, clients_per_round=3, clients_per_chunk=2)
    vm_state, vm_metrics = _round(algo, small_fed, tiny_params, config, "vmap")
    seq_state, seq_metrics = _round(algo, small_fed, tiny_params, config, backend)
    chex.assert_trees_all_close(vm_state, seq_state, rtol=2e-5, atol=2e-6)
    chex.assert_trees_all_close(vm_metrics, seq_metrics, rtol=2e-5, atol=2e-6)


def test_chunking_does_not_change_the_round(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16)
    whole = _round(algo, small_fed, tiny_params, RoundConfig(5, 5), "vmap")
    chunked = _round(algo, small_fed, tiny_params, RoundConfig(5, 5, clients_per_chunk=2), "vmap")
    chex.assert_trees_all_close(whole, chunked, rtol=2e-5, atol=2e-6)


def test_padded_client_trains_exactly_on_its_own_samples(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16, local_epochs=2)
    server = algo.server_init(tiny_params)
    hp = traced_hparams(algo, 1)
    n = int(np.argmin(small_fed.counts))
    x, y = small_fed.client(n)
    assert x.shape[0] < small_fed.max_n
    key = jax.random.PRNGKey(3)
    run = jax.jit(lambda data: local_training(algo, ClientContext(server, (), data, hp), key))
    padded = run(ClientData(jnp.asarray(small_fed.x[n]), jnp.asarray(small_fed.y[n]), jnp.int32(x.shape[0])))
    alone = run(ClientData(jnp.asarray(x), jnp.asarray(y), jnp.int32(x.shape[0])))
    chex.assert_trees_all_close(padded, alone, rtol=1e-6, atol=1e-7)
    # Poison the padding rows: results must not move.
    poisoned_x = np.array(small_fed.x[n]); poisoned_x[x.shape[0]:] = 1e3
    poisoned = run(ClientData(jnp.asarray(poisoned_x), jnp.asarray(small_fed.y[n]), jnp.int32(x.shape[0])))
    chex.assert_trees_all_close(padded, poisoned, rtol=1e-6, atol=1e-7)


def test_empty_client_leaves_state_unchanged(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    ctx = ClientContext(algo.server_init(tiny_params), (),
                        ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(0)),
                        traced_hparams(algo, 1))
    message, _ = local_training(algo, ctx, jax.random.PRNGKey(0))
    chex.assert_trees_all_equal(message["params"], tiny_params)


def test_same_seed_same_result_and_seed_matters(small_fed, tiny_model):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    run = lambda seed: bf.simulate(algo, small_fed, rounds=2, key=jax.random.PRNGKey(seed),
                                   clients_per_round=3, evaluate_local=False)
    a, b, c = run(0), run(0), run(1)
    assert a.metrics["global_accuracy"] == b.metrics["global_accuracy"]
    chex.assert_trees_all_equal(a.state, b.state)
    assert a.metrics["global_accuracy"] != c.metrics["global_accuracy"]


def test_traced_hparams_never_recompile(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16)
    step = make_round_step(algo, RoundConfig(5, 5), "vmap")
    state, arrays = init_state(algo, tiny_params, 5), round_arrays(small_fed)
    for r, lr, lam in [(1, 0.1, 10.0), (2, 0.05, 0.0), (7, 0.3, 1e4)]:
        state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r, {"lr": lr, "lam": lam}))
    assert step._cache_size() == 1


def test_cohort_sampling_uses_requested_size(small_fed, tiny_model, tiny_params):
    """With K < N only the sampled clients' persistent state changes."""
    algo = bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16, variant="leave_one_out")
    state, _ = _round(algo, small_fed, tiny_params, RoundConfig(5, 2), "vmap")
    touched = np.array([bool(np.any(np.asarray(u) != 0)) for u in state.persistent["u"]["Dense_0"]["kernel"]])
    assert touched.sum() == 2


def test_resume_from_checkpoint_gives_the_same_run(small_fed, tiny_model, tmp_path):
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16)
    key = jax.random.PRNGKey(0)
    straight = bf.simulate(algo, small_fed, rounds=3, key=key, evaluate_local=False)
    bf.simulate(algo, small_fed, rounds=2, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))
    resumed = bf.simulate(algo, small_fed, rounds=3, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))
    np.testing.assert_allclose(resumed.metrics["global_accuracy"], straight.metrics["global_accuracy"])
    chex.assert_trees_all_close(resumed.state, straight.state, rtol=1e-6)
    with pytest.raises(ValueError, match="at round 3 > rounds=2"):
        bf.simulate(algo, small_fed, rounds=2, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))


def test_participation_rate_sets_the_cohort_size():
    from bfedjax.core import cohort_size
    assert cohort_size(20, participation=0.1) == 2
    assert cohort_size(20, participation=0.01) == 1
    assert cohort_size(20) == 20 and cohort_size(20, clients_per_round=7) == 7
    with pytest.raises(ValueError, match="participation"):
        cohort_size(20, participation=1.5)


def test_bad_config_errors_are_clear():
    with pytest.raises(ValueError, match="clients_per_round"):
        RoundConfig(num_clients=3, clients_per_round=4)
    with pytest.raises(ValueError, match="backend"):
        make_round_step(None, RoundConfig(3, 3), "threads")


def test_pretrain_gives_a_trained_initial_server(digits, tiny_model, tiny_params):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    server = bf.core.pretrain(algo, digits.x_train[:300], digits.y_train[:300], epochs=5, key=jax.random.PRNGKey(0),
                              num_classes=10, init_params=tiny_params)
    acc = lambda p: float(jnp.mean(jnp.argmax(tiny_model.apply({"params": p}, digits.x_test), -1) == digits.y_test))
    assert acc(server["params"]) > max(0.5, acc(tiny_params) + 0.2)
    fed_one = bf.data.stack_clients(digits.x_train[:100], digits.y_train[:100], [np.arange(100)],
                                    x_test=digits.x_test, y_test=digits.y_test, num_classes=10)
    res = bf.simulate(algo, fed_one, rounds=1, key=jax.random.PRNGKey(0), init_server=server, evaluate_local=False)
    assert res.metrics["global_accuracy"][0] > 0.5


def test_patience_counts_rounds_since_the_best():
    history = [{"global_accuracy": a} for a in (0.2, 0.5, 0.4, 0.45)]
    assert not bf.core.patience_reached(history, 3)
    assert bf.core.patience_reached(history + [{"global_accuracy": 0.5}], 3)  # a tie is no improvement
    assert not bf.core.patience_reached(history + [{"global_accuracy": 0.6}], 1)


def test_early_stopped_pretraining_stops_when_validation_accuracy_stalls(digits, tiny_model, tiny_params, monkeypatch):
    x, y = digits.x_train[:300], digits.y_train[:300]
    frozen = bf.algorithms.fedavg(tiny_model, lr=0.0, batch_size=16)  # accuracy can never improve
    rounds_run = []
    original = bf.core.simulate

    def counting_simulate(*args, **kwargs):
        result = original(*args, **kwargs)
        rounds_run.append(len(result.metrics["round"]))
        return result

    monkeypatch.setitem(original.__globals__, "simulate", counting_simulate)  # pretrain's own module
    bf.core.pretrain(frozen, x, y, epochs=40, key=jax.random.PRNGKey(0), num_classes=10, init_params=tiny_params,
                     validation_fraction=0.2, patience=3)
    learning = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    server = bf.core.pretrain(learning, x, y, epochs=8, key=jax.random.PRNGKey(0), num_classes=10,
                              init_params=tiny_params, validation_fraction=0.2, patience=3)
    assert rounds_run[0] == 4  # the first epoch is the best; three more without improvement
    acc = lambda p: float(jnp.mean(jnp.argmax(tiny_model.apply({"params": p}, digits.x_test), -1) == digits.y_test))
    assert acc(server["params"]) > max(0.5, acc(tiny_params) + 0.2)
    with pytest.raises(ValueError, match="validation_fraction"):
        bf.core.pretrain(learning, x, y, epochs=2, key=jax.random.PRNGKey(0), num_classes=10, validation_fraction=1.0)
