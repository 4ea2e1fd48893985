"""Round engine: backend parity, chunking, padding, the cohort mask, metrics, determinism, no recompiles."""
import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, local_training, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams


def _round(algo, fed, params, config, backend, key=0, r=1):
    state = init_state(algo, params, RoundConfig(fed.num_clients, fed.num_clients))
    step = make_round_step(algo, config, backend)
    return step(state, round_arrays(fed), jax.random.PRNGKey(key), traced_hparams(algo, r))


@pytest.mark.parametrize("name,backend", [("fedavg", "sequential"), ("fola", "sequential"),
                                          ("fedcurv_loo", "sequential"), ("fola", "stepwise"), ("fedavg", "debug")])
def test_vmap_matches_reference_backends(name, backend, small_fed, tiny_model, tiny_params):
    batch_size = 48 if backend == "debug" else 16  # the debug backend runs op by op: fewer, larger steps
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=batch_size),
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


@pytest.mark.parametrize("name", ["fola", "bfl", "fedreg"])
def test_padded_client_trains_exactly_on_its_own_samples(name, small_fed, tiny_model, tiny_params):
    algo = {"fola": lambda: bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16, local_epochs=2),
            "bfl": lambda: bf.algorithms.bfl(tiny_model, small_fed.input_shape, lr=1e-2, batch_size=16,
                                             local_epochs=2, prior_update=True),
            "fedreg": lambda: bf.algorithms.fedreg(tiny_model, lr=0.1, batch_size=16, local_epochs=2)}[name]()
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
    message, _, _ = local_training(algo, ctx, jax.random.PRNGKey(0))
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
    state, arrays = init_state(algo, tiny_params, RoundConfig(5, 5)), round_arrays(small_fed)
    for r, lr, lam in [(1, 0.1, 10.0), (2, 0.05, 0.0), (7, 0.3, 1e4)]:
        state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r, {"lr": lr, "lam": lam}))
    assert step._cache_size() == 1


def test_cohort_sampling_uses_requested_size(small_fed, tiny_model, tiny_params):
    """With K < N only the sampled clients' persistent state changes."""
    algo = bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16, variant="leave_one_out")
    state, _ = _round(algo, small_fed, tiny_params, RoundConfig(5, 2), "vmap")
    touched = np.array([bool(np.any(np.asarray(u) != 0)) for u in state.persistent[0]["u"]["Dense_0"]["kernel"]])
    assert touched.sum() == 2


def test_resume_from_checkpoint_gives_the_same_run(small_fed, tiny_model, tmp_path):
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16)
    key = jax.random.PRNGKey(0)
    straight = bf.simulate(algo, small_fed, rounds=3, key=key, evaluate_local=False)
    bf.simulate(algo, small_fed, rounds=2, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))
    resumed = bf.simulate(algo, small_fed, rounds=3, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))
    for name in straight.metrics.keys() - {"seconds"}:  # bitwise: two runs (rounds 1-2) and a resume (round 3)
        np.testing.assert_array_equal(resumed.metrics[name], straight.metrics[name], err_msg=name)
    chex.assert_trees_all_equal(resumed.state, straight.state)
    with pytest.raises(ValueError, match="at round 3 > rounds=2"):
        bf.simulate(algo, small_fed, rounds=2, key=key, evaluate_local=False, checkpoint_dir=str(tmp_path))


def test_participation_rate_sets_the_cohort_size():
    from bfedjax.core import cohort_size
    assert cohort_size(20, participation=0.1) == 2
    assert cohort_size(20, participation=0.01) == 1
    assert cohort_size(20) == 20 and cohort_size(20, clients_per_round=7) == 7
    with pytest.raises(ValueError, match="participation"):
        cohort_size(20, participation=1.5)


@pytest.fixture(scope="module")
def equal_fed(digits):
    """5 clients of 40 digits each: every client fills its arrays (``with_fixed_local_steps`` applies)."""
    parts = [np.arange(40 * n, 40 * (n + 1)) for n in range(5)]
    return bf.data.stack_clients(digits.x_train[:200], digits.y_train[:200], parts, x_test=digits.x_test,
                                 y_test=digits.y_test, num_classes=10, name="digits")


# (K, chunk, pad_cohort_to): the stored client axis vmapped in place; clients in turn; chunks of 2 with a
# padding slot under the vmap; clients in turn with a padding slot outside any vmap. BFL and FedReg (slow
# compiles) in the padded vmap only.
@pytest.mark.parametrize("name,k,chunk,pad", [(name, *layout) for name in ("fedavg", "fola")
                                              for layout in ((5, None, 1), (3, 1, 1), (3, 2, 1), (3, 1, 4))]
                         + [("bfl", 3, 2, 1), ("fedreg", 3, 2, 1)])
def test_fixed_local_steps_give_the_loops_round(name, k, chunk, pad, equal_fed, tiny_model, tiny_params, monkeypatch):
    """The fixed-step scan (an accelerator's; forced here on the CPU, which keeps the loop) gives the loop's round."""
    monkeypatch.setattr(bf.core.layout, "fixed_steps_scan", lambda **_: True)
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, local_epochs=2),
            "fola": lambda: bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16),
            "bfl": lambda: bf.algorithms.bfl(tiny_model, equal_fed.input_shape, lr=1e-2, batch_size=16),
            "fedreg": lambda: bf.algorithms.fedreg(tiny_model, lr=0.1, batch_size=16)}[name]()
    loop = RoundConfig(5, k, clients_per_chunk=chunk, pad_cohort_to=pad)
    fixed = bf.core.with_fixed_local_steps(loop, round_arrays(equal_fed))
    assert fixed.fixed_local_steps and not loop.fixed_local_steps
    got = _round(algo, equal_fed, tiny_params, fixed, "vmap")
    chex.assert_trees_all_close(got, _round(algo, equal_fed, tiny_params, loop, "vmap"), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["fedavg", "fola"])
def test_unrolled_local_steps_give_the_scans_round(name, equal_fed, tiny_model, tiny_params):
    """RoundConfig.unroll_local_steps (the fixed-step scan's unroll, 3 of the epoch's 3 steps and 2, which
    leaves a remainder) trains the same clients: the same round as one step per iteration."""
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, local_epochs=2),
            "fola": lambda: bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16)}[name]()
    one = bf.core.with_fixed_local_steps(RoundConfig(5, 3, clients_per_chunk=2, unroll_local_steps=1),
                                         round_arrays(equal_fed))
    expected = _round(algo, equal_fed, tiny_params, one, "vmap")
    for unroll in (3, 2):
        config = dataclasses.replace(one, unroll_local_steps=unroll)
        got = _round(algo, equal_fed, tiny_params, config, "vmap")
        chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-7)
        traced = jax.make_jaxpr(make_round_step(algo, config))(init_state(algo, tiny_params, config),
                                                                round_arrays(equal_fed), jax.random.PRNGKey(0),
                                                                traced_hparams(algo, 1))
        assert f"unroll={unroll}" in str(traced)  # the epoch's scan takes the configured unroll


def test_a_cpu_keeps_the_step_loop_unless_steps_are_unrolled(equal_fed, tiny_model, tiny_params):
    """On a CPU a fixed-step round keeps the per-step while loop and has no cond around a client's training
    (which would keep XLA from hoisting a client's server-derived work out of the loop over clients)."""
    scan = bf.core.layout.fixed_steps_scan
    assert not scan(platform="cpu", unroll=None) and not scan(platform="cpu", unroll=1)
    assert scan(platform="cpu", unroll=2) and scan(platform="gpu", unroll=None) and scan(platform="tpu", unroll=1)
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0, batch_size=16).replace(evaluate=None)  # no test-set conds
    for chunk in (1, 2):
        config = bf.core.with_fixed_local_steps(RoundConfig(5, 3, clients_per_chunk=chunk, evaluate_local=False),
                                                round_arrays(equal_fed))
        assert config.fixed_local_steps
        traced = str(jax.make_jaxpr(make_round_step(algo, config))(init_state(algo, tiny_params, config),
                                                                   round_arrays(equal_fed), jax.random.PRNGKey(0),
                                                                   traced_hparams(algo, 1)))
        assert " cond[" not in traced and "while[" in traced


def test_unrolling_is_automatic_only_for_a_short_epoch_of_small_steps_on_an_accelerator():
    auto = bf.core.layout.auto_unroll_local_steps
    assert auto(platform="gpu", steps_per_epoch=10, step_operations=lambda: 186) == 10  # FedAvg, MLP
    assert auto(platform="cpu", steps_per_epoch=10, step_operations=lambda: 186) == 1
    assert auto(platform="gpu", steps_per_epoch=60, step_operations=lambda: 186) == 1  # a long epoch
    assert auto(platform="gpu", steps_per_epoch=10, step_operations=lambda: 887) == 1  # BFL, MLP: compile time
    for wrong in (0, True, 2.0):
        with pytest.raises(ValueError, match="unroll_local_steps"):
            RoundConfig(5, 5, unroll_local_steps=wrong)
    assert RoundConfig(5, 5, unroll_local_steps=np.int64(3)).unroll_local_steps == 3


def test_an_accelerator_unrolls_a_small_models_epoch(equal_fed, tiny_model, tiny_params, monkeypatch):
    """Traced as on a GPU, the fixed-step epoch of a small FedAvg client (3 steps) is one unrolled
    iteration; a variational (BFL) client's step is too large and keeps one step per iteration."""
    config = bf.core.with_fixed_local_steps(RoundConfig(5, 3, clients_per_chunk=2), round_arrays(equal_fed))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for algo, unroll in ((bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16), 3),
                         (bf.algorithms.bfl(tiny_model, equal_fed.input_shape, lr=1e-2, batch_size=16), 1)):
        params = algo.init_params(jax.random.PRNGKey(0), equal_fed.input_shape)
        traced = str(jax.make_jaxpr(make_round_step(algo, config))(init_state(algo, params, config),
                                                                   round_arrays(equal_fed), jax.random.PRNGKey(0),
                                                                   traced_hparams(algo, 1)))
        assert "length=3" in traced and f"unroll={unroll}" in traced
        assert "unroll=3" not in traced or unroll == 3


def test_fixed_local_steps_only_where_every_client_is_full(small_fed, equal_fed):
    ragged = bf.core.with_fixed_local_steps(RoundConfig(5, 5), round_arrays(small_fed))
    stragglers = bf.core.with_fixed_local_steps(RoundConfig(5, 5, straggler_fraction=0.4), round_arrays(equal_fed))
    assert not ragged.fixed_local_steps and not stragglers.fixed_local_steps
    with pytest.raises(ValueError, match="fixed_local_steps"):
        RoundConfig(5, 5, round_fractions=(0.5,), fixed_local_steps=True)


@pytest.mark.parametrize("name", ["fedavg", "fola"])
def test_the_accelerator_sum_of_client_statistics_matches_the_cpu_scan(name, tiny_model, tiny_params, monkeypatch):
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1),
            "fola": lambda: bf.algorithms.fola(tiny_model, lr=0.1, lam=10.0)}[name]()
    assert algo.streams  # aggregated from client_stats
    server, hp = algo.server_init(tiny_params), traced_hparams(algo, 1)
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    template = _message_like(algo, server, hp)  # positive random entries: valid FOLA precisions too
    messages = jax.vmap(lambda k: jax.tree.map(lambda m: m + jax.random.uniform(k, m.shape), template))(keys)
    weights, mask = jnp.array([0.1, 0.2, 0.3, 0.4]), jnp.ones(4)
    on_cpu = algo.aggregate(server, messages, weights, mask, hp, jax.random.PRNGKey(0))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    chex.assert_trees_all_close(algo.aggregate(server, messages, weights, mask, hp, jax.random.PRNGKey(0)), on_cpu,
                                rtol=1e-6, atol=1e-6)


def _message_like(algo, server, hp):
    """Zeros shaped like a client's message."""
    data = ClientData(jnp.zeros((8, 8, 8, 1)), jnp.zeros((8,), jnp.int32), jnp.int32(8))
    shapes = jax.eval_shape(lambda: local_training(algo, ClientContext(server, (), data, hp), jax.random.PRNGKey(0)))[0]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


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
    nan = float("nan")  # rounds --evaluate_every skipped
    assert not bf.core.patience_reached([{"global_accuracy": nan}] * 4, 1)
    assert bf.core.patience_reached([{"global_accuracy": a} for a in (nan, 0.5, nan, 0.4, nan)], 3)
    np.testing.assert_array_equal(bf.metrics.best_so_far([nan, 0.5, nan, 0.4]), [nan, 0.5, 0.5, 0.5])


@pytest.mark.parametrize("chunk", [None, 2])  # finish_round, and the streamed chunks' running sums
def test_evaluate_every_skips_the_other_rounds_evaluation(chunk, small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    run = lambda every: bf.simulate(algo, small_fed, rounds=4, key=jax.random.PRNGKey(0), init_params=tiny_params,
                                    clients_per_chunk=chunk, evaluate_every=every)
    every_run, second_run = run(1), run(2)
    every, second = every_run.metrics, second_run.metrics
    for name in ("global_accuracy", "global_loss", "local_accuracy"):
        np.testing.assert_array_equal(np.isnan(second[name]), [True, False, True, False], err_msg=name)
        np.testing.assert_allclose(np.asarray(second[name])[[1, 3]], np.asarray(every[name])[[1, 3]], rtol=1e-6)
    chex.assert_trees_all_equal(second_run.state.server, every_run.state.server)  # training is untouched
    assert second["best_global_accuracy"][-1] == max(every["global_accuracy"][1], every["global_accuracy"][3])
    with pytest.raises(ValueError, match="divide rounds=3"):
        bf.simulate(algo, small_fed, rounds=3, key=jax.random.PRNGKey(0), init_params=tiny_params, evaluate_every=2)


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


@pytest.mark.parametrize("name", ["fedavg", "fedcurv_loo"])
def test_clients_one_at_a_time_match_the_reference(name, small_fed, tiny_model, tiny_params):
    """clients_per_chunk=1 (no vmap: streamed stats for FedAvg, stacked messages for FedCurv) equals the reference."""
    algo = {"fedavg": lambda: bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16),
            "fedcurv_loo": lambda: bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16,
                                                         variant="leave_one_out")}[name]()
    config = RoundConfig(num_clients=5, clients_per_round=3, clients_per_chunk=1)
    one_at_a_time = _round(algo, small_fed, tiny_params, config, "vmap")
    reference = _round(algo, small_fed, tiny_params, config, "sequential")
    chex.assert_trees_all_close(one_at_a_time, reference, rtol=2e-5, atol=2e-6)


def _logistic_problem():
    """Two clients on 2-feature inputs: A holds ([1, 0], 0), ([0, 2], 1); B holds ([2, 2], 1)."""
    x = np.array([[1.0, 0.0], [0.0, 2.0], [2.0, 2.0]], np.float32)
    y = np.array([0, 1, 1], np.int32)
    x_test = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)
    y_test = np.array([0, 1, 1], np.int32)
    return bf.data.stack_clients(x, y, [np.array([0, 1]), np.array([2])], x_test=x_test, y_test=y_test,
                                 num_classes=2)


def test_one_fedavg_round_against_numbers_worked_out_by_hand():
    """Zero weights give softmax (1/2, 1/2), so each client's gradient is x^T (1/2 - onehot) / n.

    A (batch of 2, lr 1): W_A = [[1/4, -1/4], [-1/2, 1/2]], b_A = 0.
    B (1 sample):         W_B = [[-1, 1], [-1, 1]],          b_B = [-1/2, 1/2].
    Server, weights 2/3 and 1/3: W = [[-1/6, 1/6], [-2/3, 2/3]], b = [-1/6, 1/6].
    Test logits [-a, a] with a = 1/3, 5/6, 1: the first point is wrong (GA 2/3); A's local
    model gets all three right and B's two (LA = 2/3 * 1 + 1/3 * 2/3 = 8/9).
    """
    fed = _logistic_problem()
    model = bf.models.get_model("logistic", 2)
    zeros = {"Dense_0": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}}
    algo = bf.algorithms.fedavg(model, lr=1.0, batch_size=2, clip_norm=None)
    result = bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(0), init_params=zeros)
    server = result.state.server["params"]["Dense_0"]
    np.testing.assert_allclose(server["kernel"], [[-1 / 6, 1 / 6], [-2 / 3, 2 / 3]], rtol=1e-6)
    np.testing.assert_allclose(server["bias"], [-1 / 6, 1 / 6], rtol=1e-6)
    np.testing.assert_allclose(result.metrics["global_accuracy"], [2 / 3], rtol=1e-6)
    np.testing.assert_allclose(result.metrics["local_accuracy"], [8 / 9], rtol=1e-6)
    softplus = lambda t: math.log1p(math.exp(t))
    loss = (softplus(2 / 3) + softplus(-5 / 3) + softplus(-2.0)) / 3  # -log p_label for logits [-a, a]
    np.testing.assert_allclose(result.metrics["global_loss"], [loss], rtol=1e-5)


def _probe(evaluate=None):
    """An algorithm that trains nothing and reports what the engine hands it.

    Its local model is the global one shifted by the client's sample count.
    """
    def client_final(local, ctx):
        del local
        count = ctx.data.count.astype(jnp.float32)
        return {"params": jax.tree.map(lambda p: p + count, ctx.server["params"])}, (), {"count": count}

    def server_update(server, messages, weights, mask, hparams, key):
        del messages, hparams
        return server, {"noise": jax.random.uniform(key), "real_clients": jnp.sum(mask),
                        "weight_of_real": jnp.sum(weights * mask)}

    return bf.Algorithm("probe", server_init=lambda params: {"params": params},
                        client_init=lambda ctx, key: jnp.zeros(()), client_step=lambda local, batch, ctx, key: local,
                        client_final=client_final, server_update=server_update, evaluate=evaluate)


@pytest.mark.parametrize("backend", ["vmap", "sequential", "debug"])
def test_client_metrics_average_real_clients_and_the_server_gets_a_key(backend, small_fed):
    run = bf.simulate(_probe(), small_fed, rounds=3, key=jax.random.PRNGKey(0), clients_per_round=3,
                      clients_per_chunk=2, init_params={"w": jnp.zeros(2)}, backend=backend)
    # 3 real clients in 4 slots: the padding slot neither counts nor weighs
    assert run.metrics["real_clients"] == [3.0] * 3
    np.testing.assert_allclose(run.metrics["weight_of_real"], 1.0, rtol=1e-6)
    for r, mean_count in enumerate(run.metrics["count"], start=1):
        cohort = bf.core.sample_cohort(RoundConfig(5, 3, clients_per_chunk=2), round_arrays(small_fed),
                                       jax.random.fold_in(jax.random.PRNGKey(0), r))
        real = np.asarray(cohort.ids)[np.asarray(cohort.mask) > 0]
        np.testing.assert_allclose(mean_count, small_fed.counts[real].mean(), rtol=1e-6)
    assert len(set(run.metrics["noise"])) == 3  # a fresh server key every round
    assert "global_accuracy" not in run.metrics  # no evaluate hook: the engine scores nothing
    again = bf.simulate(_probe(), small_fed, rounds=3, key=jax.random.PRNGKey(0), clients_per_round=3,
                        clients_per_chunk=2, init_params={"w": jnp.zeros(2)})
    assert again.metrics["noise"] == run.metrics["noise"]  # every backend hands the server the same key


def test_a_task_plugs_in_its_own_evaluate_hook(small_fed):
    """The engine reports whatever the hook returns: global_<name> of the server's model and
    local_<name>, the weighted sum over the cohort's local models (here w = 0 and w = count_c)."""
    def evaluate(params, x, y):
        return {"w_plus_label": jnp.mean(params["w"]) + jnp.mean(y.astype(jnp.float32))}

    run = bf.simulate(_probe(evaluate), small_fed, rounds=1, key=jax.random.PRNGKey(0),
                      init_params={"w": jnp.zeros(2)})
    label = small_fed.y_test.mean()
    np.testing.assert_allclose(run.metrics["global_w_plus_label"], [label], rtol=1e-6)
    counts = small_fed.counts.astype(np.float64)
    np.testing.assert_allclose(run.metrics["local_w_plus_label"], [label + np.sum(counts ** 2) / counts.sum()],
                               rtol=1e-5)


def test_debug_backend_names_the_client_and_the_stage(small_fed, tiny_model):
    """Two small clients (20 and 40 samples: the debug backend runs every operation eagerly), trained in order by
    the debug backend (jit off)."""
    (x0, y0), (x1, y1) = small_fed.client(0), small_fed.client(1)
    x, y = np.concatenate([x0[:20], x1[:40]]), np.concatenate([y0[:20], y1[:40]])
    n0 = 20
    fed = bf.data.stack_clients(x, y, [np.arange(n0), np.arange(n0, len(y))], x_test=small_fed.x_test[:50],
                                y_test=small_fed.y_test[:50], num_classes=10)
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)

    def poisoned_step(local, batch, ctx, key):  # client 1's second batch goes non-finite
        local = algo.client_step(local, batch, ctx, key)
        bad = (ctx.data.count == fed.counts[1]) & (local.steps == 2)
        return local._replace(params=jax.tree.map(lambda p: p * jnp.where(bad, jnp.nan, 1.0), local.params))

    pattern = r"client 1, stage step \(epoch 0, batch 1\): non-finite values in .params\['Dense_0'\]"
    with pytest.raises(bf.core.StageError, match=pattern):
        bf.simulate(algo.replace(client_step=poisoned_step), fed, rounds=1, key=jax.random.PRNGKey(0),
                    backend="debug")

    def failing_server(server, messages, weights, mask, hparams, key):
        raise ValueError("shapes do not match")

    broken = algo.replace(client_stats=None, server_from_stats=None, server_update=failing_server)
    with pytest.raises(bf.core.StageError, match="stage server: ValueError: shapes do not match"):
        bf.simulate(broken, fed, rounds=1, key=jax.random.PRNGKey(0), backend="debug")


def test_a_real_client_with_zero_weight_keeps_the_bookkeeping(small_fed, tiny_model, tiny_params):
    """It trains and writes its persistent state, so FedCurv's U and SCAFFOLD's c must count it."""
    weights = np.array([0.0, 1.0, 2.0, 1.0, 1.0])
    loo = bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16, variant="leave_one_out")
    res = bf.simulate(loo, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params,
                      client_weights=weights, evaluate_local=False)
    assert float(jnp.abs(res.state.persistent[0]["u"]["Dense_0"]["kernel"][0]).sum()) > 0  # client 0 trained
    chex.assert_trees_all_close(res.state.server["u_sum"], jax.tree.map(lambda u: u.sum(0), res.state.persistent[0]["u"]),
                                rtol=1e-5, atol=1e-10)
    scaffold = bf.algorithms.scaffold(tiny_model, num_clients=5, lr=0.1, batch_size=16)
    res = bf.simulate(scaffold, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params,
                      client_weights=weights, evaluate_local=False)
    chex.assert_trees_all_close(res.state.server["control"], jax.tree.map(lambda c: c.mean(0), res.state.persistent[0]),
                                rtol=1e-5, atol=1e-8)


def test_a_cohort_whose_clients_all_weigh_zero_keeps_the_server(small_fed, tiny_model, tiny_params):
    """Zero-weight clients are sampled like any (they train); if nobody in the cohort counts, nothing moves."""
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    config = RoundConfig(5, 1)
    arrays = round_arrays(small_fed, np.array([0.0, 0.0, 0.0, 0.0, 1.0]))
    step = make_round_step(algo, config, "vmap")
    state, moved, kept = init_state(algo, tiny_params, RoundConfig(5, 5)), 0, 0
    for r in range(1, 9):
        key = jax.random.PRNGKey(r)
        client = int(bf.core.sample_cohort(config, arrays, key).ids[0])
        new, _ = step(state, arrays, key, traced_hparams(algo, r))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.server), jax.tree.leaves(state.server)))
        assert same == (client != 4), (r, client)
        moved, kept, state = moved + (not same), kept + same, new
    assert moved and kept  # both kinds of cohort were drawn


def _cohort_weight_probe(bad_count: int):
    """A streaming algorithm that reports the ``cohort_weight`` its aggregation gets; the client holding
    ``bad_count`` samples sends NaN (so the engine leaves it out)."""
    def client_final(local, ctx):
        del local
        nan = jnp.where(ctx.data.count == bad_count, jnp.nan, 0.0)
        return {"params": jax.tree.map(lambda p: p + nan, ctx.server["params"])}, (), {}

    def server_from_stats(server, stats, mask, hparams, key):
        del stats, mask, key
        return server, {"cohort_weight": hparams["cohort_weight"]}

    return bf.Algorithm("cohort_weight_probe", server_init=lambda params: {"params": params},
                        client_init=lambda ctx, key: jnp.zeros(()), client_step=lambda local, batch, ctx, key: local,
                        client_final=client_final, client_stats=lambda message: message,
                        server_from_stats=server_from_stats)


@pytest.mark.parametrize("chunk", [None, 2])  # finish_round, and the streamed chunks' running sum
def test_the_aggregation_gets_the_cohorts_share_of_the_base_weight(chunk, small_fed):
    """``hparams["cohort_weight"]`` = sum_{n in A} pi_n over the kept real clients; exactly 1 for everybody."""
    pi = small_fed.weights.astype(np.float64)
    run = lambda algo, k: bf.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0), clients_per_round=k,
                                      clients_per_chunk=chunk, init_params={"w": jnp.zeros(2)}).metrics
    assert run(_cohort_weight_probe(-1), 5)["cohort_weight"] == [1.0]
    cohort = bf.core.sample_cohort(RoundConfig(5, 3, clients_per_chunk=chunk), round_arrays(small_fed),
                                   jax.random.fold_in(jax.random.PRNGKey(0), 1))
    real = np.asarray(cohort.ids)[np.asarray(cohort.mask) > 0]
    assert len(real) == 3 and len(set(small_fed.counts)) == 5  # one client per count
    np.testing.assert_allclose(run(_cohort_weight_probe(-1), 3)["cohort_weight"], [pi[real].sum()], rtol=1e-6)
    dropped = run(_cohort_weight_probe(int(small_fed.counts[real[0]])), 3)
    assert dropped["nonfinite_clients"] == [1.0]
    np.testing.assert_allclose(dropped["cohort_weight"], [pi[real[1:]].sum()], rtol=1e-6)
    with pytest.raises(ValueError, match="'cohort_weight' is the engine's hyper-parameter; fix: rename"):
        _cohort_weight_probe(-1).replace(hparams={"cohort_weight": 1.0})


def test_metric_shapes_and_names_are_checked(small_fed):
    probe = _probe()
    vector = probe.replace(client_final=lambda local, ctx: ({"params": ctx.server["params"]}, (), {"v": jnp.ones(2)}))
    with pytest.raises(ValueError, match="client metric 'v' has shape \\(2,\\) per client"):
        bf.simulate(vector, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params={"w": jnp.zeros(2)})
    clash = probe.replace(server_update=lambda server, m, w, mask, hp, key: (server, {"count": jnp.zeros(())}))
    with pytest.raises(ValueError, match="the server metric 'count' clashes"):
        bf.simulate(clash, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params={"w": jnp.zeros(2)})


def test_simulate_updates_the_state_in_place_and_keeps_the_callers_arrays(small_fed, tiny_model, tiny_params):
    # SCAFFOLD keeps per-client control variates: persistent state as well as the server's
    algo = bf.algorithms.scaffold(tiny_model, num_clients=small_fed.num_clients, lr=0.1, batch_size=16)
    config = RoundConfig(small_fed.num_clients, small_fed.num_clients)
    state = init_state(algo, tiny_params, config)
    args = (round_arrays(small_fed), jax.random.PRNGKey(0), traced_hparams(algo, 1))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    kept = make_round_step(algo, config).lower(state, *args).compile()
    donated = make_round_step(algo, config, donate_state=True).lower(state, *args).compile()
    assert kept.memory_analysis().alias_size_in_bytes == 0
    assert donated.memory_analysis().alias_size_in_bytes == state_bytes  # every state buffer is reused
    copy = jax.tree.map(jnp.copy, state)
    new_state, _ = donated(copy, *args)
    assert all(x.is_deleted() for x in jax.tree.leaves(copy))
    chex.assert_trees_all_close(new_state, kept(state, *args)[0])
    # simulate donates only buffers of its own: init_params (which the server state starts as) stays usable
    result = bf.simulate(algo, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params)
    assert not any(x.is_deleted() for x in jax.tree.leaves(tiny_params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(result.state))


def test_with_own_buffers_copies_only_shared_and_repeated_buffers():
    from bfedjax.core import with_own_buffers
    shared, repeated, fresh = jnp.arange(3.0), jnp.ones(2), jnp.zeros(4)
    state = {"a": shared, "b": repeated, "c": repeated, "d": fresh}  # FedRef's server: one model three times
    own = with_own_buffers(state, {"params": shared})
    assert own["b"] is repeated and own["d"] is fresh  # the first holder of a buffer keeps it, uncopied
    assert own["a"] is not shared and own["c"] is not repeated
    chex.assert_trees_all_equal(own, state)
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(own)  # no buffer donated twice
    assert not shared.is_deleted() and repeated.is_deleted() and fresh.is_deleted()


def test_a_local_loop_starts_with_a_per_client_carry(small_fed, tiny_model, tiny_params, monkeypatch):
    """``client_half.per_client`` keeps every value and dtype and makes it per-client under the client vmap (a
    constant too), so a local loop's carry starts batched (JAX then batches the loop body once, not once per
    leaf that turns per-client): a vmap can no longer return it unmapped. ``local_training`` starts the step
    loop's carry and the epoch scan's so; the fixed-step scan (an accelerator's, or unrolled) keeps its own."""
    from bfedjax.core import client_half
    tree = {"w": jnp.arange(3.0), "half": jnp.ones(2, jnp.bfloat16), "step": jnp.int32(0), "flag": jnp.bool_(False),
            "raw_key": jax.random.PRNGKey(1), "key_data": jax.random.key_data(jax.random.key(2))}
    chex.assert_trees_all_equal(client_half.per_client(tree, jnp.bool_(True)), tree, strict=True)
    typed = jax.random.key(3)
    assert jnp.array_equal(jax.random.key_data(client_half.per_client(typed, jnp.bool_(True))), jax.random.key_data(typed))
    counts = jnp.arange(4)
    chex.assert_trees_all_equal(jax.vmap(lambda c: tree, out_axes=None)(counts), tree)  # unmapped without it
    for leaf in tree:
        with pytest.raises(ValueError, match="out_axes"):
            jax.vmap(lambda c: client_half.per_client(tree, c >= 0)[leaf], out_axes=None)(counts)
    chex.assert_trees_all_equal(jax.vmap(lambda c: client_half.per_client(tree, c >= 0))(counts),
                                jax.tree.map(lambda x: jnp.stack([x] * 4), tree), strict=True)
    # where local_training uses it
    calls = []
    real = client_half.per_client
    monkeypatch.setattr(client_half, "per_client", lambda tree, true: (calls.append(len(jax.tree.leaves(tree))),
                                                                   real(tree, true))[1])
    algo = bf.algorithms.build("fedavg", tiny_model, small_fed, batch_size=16)
    data = ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(small_fed.counts[0]))
    ctx = ClientContext({"params": tiny_params}, (), data, traced_hparams(algo, 1))
    for fixed_steps, unroll, expected in ((False, None, 2), (True, 2, 0)):  # the loop; an unrolled fixed-step scan
        calls.clear()
        jax.make_jaxpr(lambda: local_training(algo, ctx, jax.random.PRNGKey(0), fixed_steps=fixed_steps,
                                              unroll=unroll))()
        assert len(calls) == expected


def test_a_fixed_step_epoch_traces_its_step_once(monkeypatch):
    """``client_half.scanned_steps``: where the unroll decision measures the step (an accelerator, epoch short), the
    scan replays the jaxpr it traced, so the Python step runs once, as where the scan traces the step itself (a
    CPU; an unroll given). Used as ``local_training`` uses it (an epoch scan around it, under the client vmap,
    the epochs under a cond, the step closing over per-client values and the epoch's key, with a cond and a grad
    inside), the replay gives the values and gradients of the step traced again and of a Python loop of steps,
    and the same lowered module (which a JAX release lowering a replayed jaxpr's constants differently would
    break)."""
    from bfedjax.core import client_half, layout
    calls, decided = [], []
    real_decision = layout.auto_unroll_local_steps

    def decision(**kwargs):
        decided.append(real_decision(**kwargs))
        return decided[-1]

    monkeypatch.setattr(layout, "auto_unroll_local_steps", decision)

    def one_step(j, local, shift, epoch_key):
        calls.append(j)
        w = jax.lax.cond(j % 2 == 0, lambda w: w * 0.5, lambda w: w + 1.0, local["w"]) + shift
        w = w - 0.1 * jax.grad(lambda w: jnp.sum(jax.nn.softplus(w)))(w)  # a client step differentiates
        noise = jax.random.normal(jax.random.fold_in(epoch_key, j), w.shape)
        return {"w": w + 0.1 * noise, "n": (local["n"][0] + 1,), "key": jax.random.fold_in(local["key"], j)}

    initial = {"w": jnp.arange(3.0), "n": (jnp.int32(0),), "key": jax.random.key(1)}

    def readable(local):
        return {**local, "key": jax.random.key_data(local["key"])}

    def epochs(shift, platform, unroll):
        """As local_training: epochs under a scan, skipped by a cond (a select under the vmap) for no data."""
        def epoch(local, e):
            epoch_key = jax.random.fold_in(jax.random.key(7), e)
            step = functools.partial(one_step, shift=shift, epoch_key=epoch_key)
            return client_half.scanned_steps(step, local, 4, platform, unroll), None

        def train(local):
            return jax.lax.scan(epoch, local, jnp.arange(2))[0]

        return readable(jax.lax.cond(shift > -5.0, train, lambda local: local, initial))

    def in_python(shift):
        local = initial
        for e in range(2):
            for j in range(4):
                local = one_step(jnp.int32(j), local, shift, jax.random.fold_in(jax.random.key(7), e))
        return readable(local)

    shifts = jnp.array([0.0, 1.0, -2.0])
    results = {}
    for platform, unroll, expected_decision in (("gpu", None, [4]), ("gpu", 4, []), ("cpu", None, [1])):
        calls.clear()
        decided.clear()
        results[platform, unroll] = jax.jit(jax.vmap(lambda s: epochs(s, platform, unroll)))(shifts)
        assert len(calls) == 1 and decided == expected_decision
    chex.assert_trees_all_equal(results["gpu", None], results["gpu", 4])
    chex.assert_trees_all_close(results["gpu", None], results["cpu", None], rtol=1e-6)  # one step per iteration
    for client, shift in enumerate(shifts):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[client], results["gpu", None]), in_python(shift), rtol=1e-5)
    grads = {u: jax.grad(lambda s: epochs(s, "gpu", u)["w"].sum())(1.0) for u in (None, 4)}
    assert grads[None] == grads[4] and grads[None] != 0
    text = {u: jax.jit(lambda s: epochs(s, "gpu", u)).lower(1.0).as_text(debug_info=False) for u in (None, 4)}
    assert text[None] == text[4]
