"""FOLA's options beyond the engine tests (tests/test_algorithms.py): parameter compression (spec D21) and
fixed pi under partial participation (spec D23)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.algorithms.fola import prune_precision
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, local_training, make_round_step, sample_cohort
from bfedjax.core.simulate import round_arrays, traced_hparams


def test_parameter_compression_keeps_the_top_precisions_and_the_mean_of_the_rest():
    w = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1.0, 21.0)).reshape(4, 5), jnp.float32)
    pruned = prune_precision({"k": w, "b": jnp.asarray([3.0, 1.0, 2.0])}, 0.25)
    flat = np.asarray(pruned["k"]).ravel()
    original = np.asarray(w).ravel()
    # the authors' threshold: the int(0.25 * 20) = 5th largest (0-based), i.e. 15; 15..20 kept, 1..14 -> 7.5
    np.testing.assert_array_equal(flat[original >= 15], original[original >= 15])
    np.testing.assert_allclose(flat[original < 15], 7.5)
    assert flat.sum() == pytest.approx(original.sum())  # the tensor's total precision is kept
    np.testing.assert_allclose(pruned["b"], [3.0, 1.5, 1.5])  # int(0.25 * 3) = 0: only the largest kept
    with pytest.raises(ValueError, match="prune_p"):
        bf.algorithms.fola(bf.models.get_model("logistic", 10), prune_p=1.0)


def test_compressed_fola_clients_send_few_distinct_precisions(small_fed):
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    params = bf.models.init_params(model, small_fed.input_shape, jax.random.PRNGKey(0))
    config = RoundConfig(num_clients=small_fed.num_clients, clients_per_round=2)
    outs = {}
    for prune_p in (None, 0.1):
        algo = bf.algorithms.fola(model, lr=0.05, lam=10.0, batch_size=16, prune_p=prune_p)
        state, _ = make_round_step(algo, config)(init_state(algo, params, config), round_arrays(small_fed),
                                                 jax.random.PRNGKey(1), traced_hparams(algo, 1))
        outs[prune_p] = state.server
    kernel = outs[0.1]["precision"]["Dense_0"]["kernel"]  # [64, 16]: the product of two clients' compressed ones
    assert len(np.unique(np.asarray(kernel))) < 0.3 * kernel.size
    assert len(np.unique(np.asarray(outs[None]["precision"]["Dense_0"]["kernel"]))) > 0.6 * kernel.size


def _fola_round(fed, model, params, config, rounds=1, **options):
    algo = bf.algorithms.fola(model, lr=0.1, lam=1.0, batch_size=16, **options)
    step, arrays, state = make_round_step(algo, config), round_arrays(fed), init_state(algo, params, config)
    for r in range(1, rounds + 1):
        state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r))
    return algo, state.server


def test_fixed_pi_aggregates_the_active_clients_with_their_own_weights(small_fed, tiny_model, tiny_params):
    """Spec D23, 2 of 5 clients: omega_S = sum_{n in A} pi_n omega_n and mu_S = sum pi_n omega_n theta_n /
    (omega_S + eps), from the clients' messages trained outside the engine (not the default's omega_S / sum_A pi)."""
    config = RoundConfig(small_fed.num_clients, 2)
    algo, fixed = _fola_round(small_fed, tiny_model, tiny_params, config, fixed_pi=True)
    cohort = sample_cohort(config, round_arrays(small_fed), jax.random.PRNGKey(1))
    ids = np.asarray(cohort.ids)
    ctx = lambda n: ClientContext(algo.server_init(tiny_params), (), ClientData(
        jnp.asarray(small_fed.x[n]), jnp.asarray(small_fed.y[n]), jnp.int32(small_fed.counts[n])), traced_hparams(algo, 1))
    train = jax.jit(lambda ctx, key: local_training(algo, ctx, key)[0])
    messages = [train(ctx(n), cohort.keys[i]) for i, n in enumerate(ids)]
    pi = small_fed.weights[ids]
    weigh = lambda trees: jax.tree.map(lambda *w: sum(p * x for p, x in zip(pi, w)), *trees)
    precision = weigh([m["precision"] for m in messages])
    weighted = weigh([jax.tree.map(jnp.multiply, m["precision"], m["params"]) for m in messages])
    chex.assert_trees_all_close(fixed["precision"], precision, rtol=1e-5, atol=1e-12)
    chex.assert_trees_all_close(fixed["params"], jax.tree.map(lambda a, w: a / (w + 1e-5), weighted, precision),
                                rtol=1e-4, atol=1e-6)
    assert 0.1 < pi.sum() < 0.9  # the default's renormalised precision is larger by 1 / sum_A pi
    kernel = np.asarray(fixed["precision"]["Dense_0"]["kernel"])
    assert not np.allclose(kernel, np.asarray(precision["Dense_0"]["kernel"]) / pi.sum(), rtol=1e-2)


def test_fixed_pi_changes_nothing_under_full_participation(small_fed, tiny_model, tiny_params):
    config = RoundConfig(small_fed.num_clients, small_fed.num_clients)
    _, fixed = _fola_round(small_fed, tiny_model, tiny_params, config, rounds=2, fixed_pi=True)
    _, default = _fola_round(small_fed, tiny_model, tiny_params, config, rounds=2)
    chex.assert_trees_all_equal(fixed, default)


def test_fixed_pi_errors_name_the_fix(tiny_model):
    with pytest.raises(ValueError, match="FOLA fixed_pi='yes' must be a bool; fix: fixed_pi=True"):
        bf.algorithms.fola(tiny_model, fixed_pi="yes")
    algo = bf.algorithms.fola(tiny_model, fixed_pi=True)
    stats = ({"w": jnp.ones(2)}, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="needs hparams\\['cohort_weight'\\].*fix: aggregate through the engine"):
        algo.server_from_stats(None, stats, jnp.ones(2), {"round": jnp.int32(1)}, None)
    server, _ = algo.server_from_stats({"params": {"w": jnp.zeros(2)}}, stats, jnp.ones(2),
                                       {"cohort_weight": jnp.float32(0.25), "round": jnp.int32(1)}, None)
    np.testing.assert_allclose(server["precision"]["w"], 0.25)


@pytest.mark.parametrize("options", [{}, {"damping": 1e-3}, {"precision_mode": "running_average"},
                                     {"normalisation": "mean_over_steps"}])
def test_client_precision_adds_the_round_fisher_to_the_server_precision(small_fed, tiny_model, tiny_params, options):
    """Round 3 with a server precision S != 0: the message is S + F (running sum; the default accumulates F
    in place from S) or F / 3 + 2 / 3 * S (running average, Eq. 24), F the client's round Fisher (the
    message at S = 0 is F, or F / 3)."""
    algo = bf.algorithms.fola(tiny_model, lr=0.0, lam=0.0, batch_size=16, local_epochs=2, **options)
    data = ClientData(jnp.asarray(small_fed.x[1]), jnp.asarray(small_fed.y[1]), jnp.int32(small_fed.counts[1]))
    hparams = {**traced_hparams(algo, 3)}

    def message_precision(server):
        ctx = ClientContext(server, (), data, hparams)
        return local_training(algo, ctx, jax.random.PRNGKey(0))[0]["precision"]

    zero = algo.server_init(tiny_params)
    s = jax.tree.map(lambda p: jnp.linspace(0.5, 2.0, p.size, dtype=p.dtype).reshape(p.shape), zero["precision"])
    fisher = message_precision(zero)  # the message at S = 0, weights frozen by lr = 0
    share = 2.0 / 3.0 if options.get("precision_mode") == "running_average" else 1.0
    expected = jax.tree.map(lambda f, s: f + share * s, fisher, s)
    chex.assert_trees_all_close(message_precision({**zero, "precision": s}), expected, rtol=1e-5, atol=1e-7)
    assert float(jax.tree.leaves(fisher)[0].max()) > 1e-6  # the Fisher is not trivially zero


def test_precision_similarity_layer_reports_fig_11a_and_keeps_the_aggregation(small_fed, tiny_model, tiny_params):
    """3 of 5 clients: the layer's precision_cosine is the mean over the cohort's pairs of the paper's cosine
    of the clients' normalised precision matrices (from messages trained outside the engine); the server
    state is the plain FOLA round's."""
    config = RoundConfig(small_fed.num_clients, 3)
    algo = bf.algorithms.fola(tiny_model, lr=0.1, lam=1.0, batch_size=16)
    layered = bf.algorithms.with_precision_similarity(algo)
    arrays, hparams, key = round_arrays(small_fed), traced_hparams(algo, 1), jax.random.PRNGKey(1)
    plain_state, _ = make_round_step(algo, config)(init_state(algo, tiny_params, config), arrays, key, hparams)
    state, metrics = make_round_step(layered, config)(init_state(layered, tiny_params, config), arrays, key, hparams)
    chex.assert_trees_all_close(state.server, plain_state.server, rtol=1e-5, atol=1e-7)
    cohort = sample_cohort(config, arrays, key)
    ctx = lambda n: ClientContext(algo.server_init(tiny_params), (), ClientData(
        jnp.asarray(small_fed.x[n]), jnp.asarray(small_fed.y[n]), jnp.int32(small_fed.counts[n])), hparams)
    train = jax.jit(lambda ctx, key: local_training(algo, ctx, key)[0])
    diagonals = [np.concatenate([np.ravel(p) for p in jax.tree.leaves(train(ctx(n), cohort.keys[i])["precision"])])
                 for i, n in enumerate(np.asarray(cohort.ids))]
    def cosine(a, b):  # the d x d diagonal matrices, min-max normalised and vectorised (Fig. 10a, 11a)
        a, b = ((m - m.min()) / (m - m.min()).max() for m in (np.diag(a), np.diag(b)))
        return float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))
    want = np.mean([cosine(diagonals[i], diagonals[j]) for i in range(3) for j in range(i + 1, 3)])
    np.testing.assert_allclose(float(metrics["precision_cosine"]), want, rtol=1e-4)
    assert 0.0 < want < 0.999  # clients with different classes have different precisions
    fedavg = bf.algorithms.with_precision_similarity(bf.algorithms.fedavg(tiny_model, batch_size=16))
    with pytest.raises(ValueError, match="needs Gaussian messages"):
        make_round_step(fedavg, config)(init_state(fedavg, tiny_params, config), arrays, key,
                                        traced_hparams(fedavg, 1))
