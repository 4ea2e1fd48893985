"""Faulty and malicious clients: non-finite messages dropped in the round, robust rules, attack simulation."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import bfedjax as bf
from bfedjax.core import Attack, NonFiniteClientError, RoundConfig, init_state, make_round_step
from bfedjax.core.attacks import attacked_messages, flip_labels, malicious_clients
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.posteriors import DiagGaussian, gaussian_product
from bfedjax.posteriors.robust import (bound_update_norms, coordinate_median, krum_selection, robust_product,
                                       trimmed_mean)


@pytest.fixture(scope="module")
def nan_fed(small_fed):
    """``small_fed`` with NaN pixels in client 3's first sample."""
    x = np.array(small_fed.x)
    x[3, 0] = np.nan
    return dataclasses.replace(small_fed, x=x)


def _round(algo, fed, params, backend="vmap", chunk=None, client_weights=None, on_nonfinite="drop"):
    config = RoundConfig(fed.num_clients, fed.num_clients, clients_per_chunk=chunk, on_nonfinite=on_nonfinite)
    state = init_state(algo, params, config, jax.random.PRNGKey(9))
    step = make_round_step(algo, config, backend)
    return step(state, round_arrays(fed, client_weights), jax.random.PRNGKey(3), traced_hparams(algo, 1))


# --- non-finite clients ------------------------------------------------------------------------------


def test_finite_rows_flags_nan_and_both_infinities_in_any_leaf_without_overflow():
    """finite.finite_rows sums x * 0 per row (x times a zero vector on a CPU): NaN, +inf and -inf anywhere
    flag their row; values near float32's maximum, integer, bfloat16 and empty leaves do not break it."""
    from bfedjax.core.finite import finite_rows
    k = np.full((5, 6, 7, 8), 3e38, np.float32)  # a plain sum of a row would overflow to inf
    b = np.ones((5, 3), np.float32)
    k[1, 5, 6, 7], k[2, 0, 0, 0], b[3, 1] = np.nan, np.inf, -np.inf
    tree = {"k": jnp.asarray(k), "b": jnp.asarray(b), "s": jnp.asarray([0.0, 1.0, 2.0, 3.0, np.nan]),
            "n": jnp.arange(5), "h": jnp.ones((5, 4, 4), jnp.bfloat16), "e": jnp.ones((5, 3, 0)), "z": jnp.ones((5, 0))}
    expected = [True, False, False, False, False]
    np.testing.assert_array_equal(finite_rows(tree, 5), expected)
    np.testing.assert_array_equal(jax.jit(finite_rows, static_argnums=1)(tree, 5), expected)
    tree["h"] = tree["h"].at[0, 1, 2].set(jnp.inf)
    np.testing.assert_array_equal(finite_rows(tree, 5), [False] * 5)


def test_a_cpu_reads_a_checked_array_once():
    """On a CPU the float32 check is ``x @ zeros`` with the zeros behind an optimisation barrier: no ``x * 0``
    written out first (a multiply in the compiled check), and no zero vector folded away (a folded product
    would report every row finite)."""
    from bfedjax.tree import zero_products_per_row
    check = jax.jit(zero_products_per_row, static_argnums=1)
    x = jnp.ones((4, 64, 32), jnp.float32).at[2, 5, 7].set(jnp.inf)
    np.testing.assert_array_equal(np.isnan(check(x, 4)), [False, False, True, False])
    if jax.default_backend() == "cpu":
        hlo = check.lower(x, 4).compile().as_text()
        assert " dot(" in hlo and " multiply(" not in hlo


@pytest.mark.parametrize("name,backend,chunk", [("fedavg", "vmap", None), ("fola", "vmap", 2),
                                                ("scaffold", "sequential", None), ("fedavg", "vmap", 1)])
def test_a_nan_client_drops_out_and_the_rest_aggregate_as_without_it(nan_fed, small_fed, tiny_model, tiny_params,
                                                                     name, backend, chunk):
    """The NaN client leaves the aggregation through the mask (streamed chunks for FOLA, the reference loop,
    one client at a time): the server equals the round in which that client weighs zero."""
    algo = bf.algorithms.build(name, tiny_model, small_fed, lr=0.1, batch_size=32)
    state, metrics = _round(algo, nan_fed, tiny_params, backend, chunk)
    assert float(metrics["nonfinite_clients"]) == 1.0
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(state.server))
    weights = np.array(small_fed.weights)
    weights[3] = 0.0
    reference, _ = _round(algo, small_fed, tiny_params, backend, chunk, client_weights=weights)
    # (SCAFFOLD's server control variate counts the real clients, so only its model compares)
    compared = (lambda server: server["params"]) if name == "scaffold" else (lambda server: server)
    chex.assert_trees_all_close(compared(state.server), compared(reference.server), rtol=1e-5, atol=1e-6)
    if name == "scaffold":  # the NaN client keeps its old control variate
        start = init_state(algo, tiny_params, RoundConfig(5, 5), jax.random.PRNGKey(9)).persistent[0]
        chex.assert_trees_all_close(jax.tree.map(lambda a: a[3], state.persistent[0]),
                                    jax.tree.map(lambda a: a[3], start))


def test_every_client_nan_keeps_the_server(nan_fed, tiny_model, tiny_params):
    x = np.full_like(np.asarray(nan_fed.x), np.nan)
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=32)
    state, metrics = _round(algo, dataclasses.replace(nan_fed, x=x), tiny_params)
    assert float(metrics["nonfinite_clients"]) == 5.0
    chex.assert_trees_all_close(state.server["params"], tiny_params)


def test_nan_fault_clients_are_counted_every_round(small_fed, tiny_model):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=32)
    result = bf.simulate(algo, small_fed, rounds=2, key=jax.random.PRNGKey(0), attack=Attack("nan", 0.4),
                         evaluate_local=False)
    assert result.metrics["nonfinite_clients"] == [2.0, 2.0] and min(result.metrics["global_accuracy"]) > 0.15


def test_stop_policy_names_the_round_and_the_client(nan_fed, tiny_model):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=32)
    with pytest.raises(NonFiniteClientError, match=r"round 1: client 3 sent NaN or Inf"):
        bf.simulate(algo, nan_fed, rounds=2, key=jax.random.PRNGKey(0), on_nonfinite="stop")
    result = bf.simulate(algo, nan_fed, rounds=2, key=jax.random.PRNGKey(0))
    assert result.metrics["nonfinite_clients"] == [1.0, 1.0] and np.isfinite(result.metrics["global_accuracy"]).all()


# --- robust rules: worked numbers and properties -----------------------------------------------------


def test_robust_rules_on_worked_numbers():
    x = jnp.array([[1.0, -2.0], [5.0, 0.0], [100.0, 1.0], [3.0, 9.0], [7.0, 7.0]])
    mask = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])  # the last slot is padding
    np.testing.assert_allclose(coordinate_median(x, mask), [4.0, 0.5])  # (3 + 5) / 2, (0 + 1) / 2
    np.testing.assert_allclose(coordinate_median(x[:3], mask[:3]), [5.0, 0.0])
    np.testing.assert_allclose(trimmed_mean(x, mask, 0.25), [4.0, 0.5])  # drops one at each end of four
    np.testing.assert_allclose(trimmed_mean(x, mask, 0.0), [27.25, 2.0])
    # Krum: three clustered clients and one far away; f = 1 -> k - f - 2 = 1 neighbour
    y = jnp.array([[0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [50.0, 50.0]])
    np.testing.assert_array_equal(krum_selection(y, jnp.ones(4), 1), [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(krum_selection(y, jnp.ones(4), 1, 3), [1.0, 1.0, 1.0, 0.0])
    bounded, norms = bound_update_norms(jnp.array([[3.0, 4.0], [0.3, 0.4]]), jnp.zeros(2), jnp.ones(2), 1.0)
    np.testing.assert_allclose(norms, [5.0, 0.5])
    np.testing.assert_allclose(bounded, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


def test_robust_product_limits():
    rng = np.random.default_rng(0)
    mean, precision = jnp.asarray(rng.normal(size=(6, 3))), jnp.asarray(rng.uniform(0.5, 2.0, size=(6, 3)))
    w, mask = jnp.full(6, 1 / 6), jnp.ones(6)
    plain = gaussian_product(DiagGaussian(mean, precision), w)
    chex.assert_trees_all_close(robust_product(DiagGaussian(mean, precision), w, mask, trim=0.0), plain, rtol=1e-5)
    # an outlier mean with a huge precision drags the product; the trimmed, capped product ignores it
    bad_mean, bad_precision = mean.at[0].set(1e3), precision.at[0].set(1e4)
    dragged = gaussian_product(DiagGaussian(bad_mean, bad_precision), w)
    robust = robust_product(DiagGaussian(bad_mean, bad_precision), w, mask, trim=0.2, precision_cap=3.0)
    assert float(jnp.min(dragged.mean)) > 900
    assert float(jnp.max(jnp.abs(robust.mean))) < 3.0
    assert float(jnp.max(robust.precision)) <= 3.0 * float(jnp.max(jnp.median(precision, axis=0))) + 1e-5


def test_robust_product_is_the_sorted_definition_with_ties_and_padding():
    """Against the rule written with stable argsorts over the client axis (numpy): ties among the means (drawn
    from five values, -0.0 among them) keep the clients a stable sort keeps; padding slots never count."""
    rng = np.random.default_rng(3)
    for trial in range(6):
        c = 7
        mean = rng.choice([-1.0, -0.0, 0.0, 1.0, 2.5], size=(c, 4, 3)) if trial % 2 else rng.normal(size=(c, 4, 3))
        precision, w = rng.uniform(0.5, 2.0, size=(c, 4, 3)), rng.uniform(0.1, 1.0, size=c)
        mask = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
        trim, cap = 0.25, 1.5
        real = mask[:, None, None] > 0
        k = int(mask.sum())
        drop = min(int(np.floor(trim * k)), (k - 1) // 2)
        rank = np.argsort(np.argsort(np.where(real, mean, np.inf), axis=0, kind="stable"), axis=0, kind="stable")
        kept = real & (rank >= drop) & (rank < k - drop)
        capped = np.minimum(precision, cap * np.median(precision[mask > 0], axis=0))
        wk = np.where(kept, w[:, None, None], 0.0)
        wk = wk / wk.sum(0)
        expected_precision = (wk * capped).sum(0)
        expected_mean = (wk * capped * mean).sum(0) / expected_precision
        got = robust_product(DiagGaussian(jnp.asarray(mean, jnp.float32), jnp.asarray(precision, jnp.float32)),
                             jnp.asarray(w, jnp.float32), jnp.asarray(mask), trim=trim, precision_cap=cap)
        np.testing.assert_allclose(got.precision, expected_precision, rtol=1e-5)
        np.testing.assert_allclose(got.mean, expected_mean, rtol=1e-5, atol=1e-6)


values = arrays(np.float32, st.tuples(st.integers(1, 6), st.just(2)),
                elements=st.floats(-1e3, 1e3, width=32, allow_nan=False))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(values, st.randoms(use_true_random=False), st.integers(0, 3), st.floats(0.0, 0.49))
def test_robust_rules_ignore_order_and_padding(x, rnd, pad, trim):
    """Permuting the clients changes nothing; padding slots (any finite value, mask 0) change nothing."""
    k = x.shape[0]
    perm = np.array(rnd.sample(range(k), k))
    mask = jnp.ones(k)
    padded = np.concatenate([x, np.full((pad, x.shape[1]), 123.0, np.float32)])
    padded_mask = jnp.concatenate([mask, jnp.zeros(pad)])
    trimmed = jax.jit(trimmed_mean, static_argnums=2)  # jitted: one compile per shape, not one per operation
    for rule in (jax.jit(coordinate_median), lambda v, m: trimmed(v, m, trim)):
        base = rule(jnp.asarray(x), mask)
        np.testing.assert_allclose(rule(jnp.asarray(x[perm]), mask), base, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(rule(jnp.asarray(padded), padded_mask), base, rtol=1e-5, atol=1e-3)
        assert np.all(base >= x.min(0) - 1e-3) and np.all(base <= x.max(0) + 1e-3)  # inside the clients' range
    krum = jax.jit(krum_selection, static_argnums=(2, 3))
    chosen = np.asarray(krum(jnp.asarray(x), mask, 0, 2))
    np.testing.assert_array_equal(np.asarray(krum(jnp.asarray(x[perm]), mask, 0, 2)).sum(), chosen.sum())
    np.testing.assert_array_equal(np.asarray(krum(jnp.asarray(padded), padded_mask, 0, 2))[:k], chosen)


# --- the layer and attacks in the round ----------------------------------------------------------------


def test_robust_layer_puts_the_rule_under_any_algorithm(small_fed, tiny_model, tiny_params):
    fedavg = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=32)
    messages = {"params": jax.tree.map(lambda p: jnp.stack([p, 2 * p, 10 * p]), tiny_params)}
    w, mask = jnp.array([0.2, 0.3, 0.5]), jnp.ones(3)
    # jitted: one compilation each, not one per operation of the order statistics' bisections
    server, _ = jax.jit(bf.algorithms.with_robust_aggregation(fedavg, "median").server_update)(
        {"params": tiny_params}, messages, w, mask, {}, jax.random.PRNGKey(0))
    chex.assert_trees_all_close(server["params"], coordinate_median(messages["params"], mask))
    four = {"params": jax.tree.map(lambda p: jnp.stack([p, 2 * p, 3 * p, 10 * p]), tiny_params)}
    server, metrics = jax.jit(bf.algorithms.with_robust_aggregation(fedavg, "krum", byzantine_fraction=0.0)
                              .server_update)({"params": tiny_params}, four, jnp.full(4, 0.25), jnp.ones(4), {},
                                              jax.random.PRNGKey(0))
    assert float(metrics["robust_kept"]) == 1.0  # 2p: squared distances 1 + 1 to its 2 nearest, the lowest score
    chex.assert_trees_all_close(server["params"], jax.tree.map(lambda p: 2 * p, tiny_params))
    fola = bf.algorithms.fola(tiny_model, lr=0.1, batch_size=32)
    precision = jax.tree.map(lambda p: jnp.ones((3,) + p.shape), tiny_params)
    server, _ = jax.jit(bf.algorithms.with_robust_aggregation(fola, "robust_product", trim=0.34).server_update)(
        {"params": tiny_params, "precision": jax.tree.map(jnp.zeros_like, tiny_params)},
        {**messages, "precision": precision}, w, mask, {"round": jnp.int32(1)}, jax.random.PRNGKey(0))
    chex.assert_trees_all_close(server["params"], jax.tree.map(lambda p: 2 * p, tiny_params), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="robust_product needs Gaussian messages"):
        bf.algorithms.with_robust_aggregation(fedavg, "robust_product").server_update(
            {"params": tiny_params}, messages, w, mask, {}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="choose one of"):
        bf.algorithms.with_robust_aggregation(fedavg, "geometric")


def test_attacks_change_only_the_malicious_clients(small_fed, tiny_params):
    malicious = malicious_clients(20, 0.2, seed=1)
    assert malicious.sum() == 4 and np.all(malicious_clients(20, 0.3, seed=1)[malicious])  # nested fractions
    g = tiny_params
    m = jax.tree.map(lambda p: jnp.stack([p + 1.0, p + 2.0]), g)
    who, keys = jnp.array([True, False]), jax.random.split(jax.random.PRNGKey(0), 2)
    flipped = attacked_messages(Attack("sign_flip", 0.5), {"params": m}, g, who, keys)["params"]
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], flipped), jax.tree.map(lambda p: p - 1.0, g))
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[1], flipped), jax.tree.map(lambda p: p + 2.0, g))
    boosted = attacked_messages(Attack("scale", 0.5), {"params": m}, g, who, keys)["params"]
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], boosted), jax.tree.map(lambda p: p + 10.0, g))
    noisy = attacked_messages(Attack("noise", 0.5, noise_std=2.0), {"params": m}, g, who, keys)["params"]
    spread = np.concatenate([np.ravel(a[0] - b) for a, b in zip(jax.tree.leaves(noisy), jax.tree.leaves(g))])
    assert 1.8 < spread.std() < 2.2
    y = jnp.array([[0, 3, 9], [1, 2, 3]])
    np.testing.assert_array_equal(flip_labels(y, jnp.array([True, False]), 10), [[9, 6, 0], [1, 2, 3]])


def test_median_holds_where_fedavg_breaks_under_noise_attackers(digits, tiny_model):
    """30% of 10 clients send N(0, 1) updates: FedAvg's model is ruined, the median's keeps learning."""
    parts = bf.data.partition(digits.y_train, "iid", 10, seed=0)
    fed = bf.data.from_partition(digits, parts)
    fedavg = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=32)
    attack = Attack("noise", 0.3)
    run = lambda algo: bf.simulate(algo, fed, rounds=4, key=jax.random.PRNGKey(0), attack=attack,
                                   evaluate_local=False).metrics["global_accuracy"][-1]
    plain, median = run(fedavg), run(bf.algorithms.with_robust_aggregation(fedavg, "median"))
    assert median > 0.4 and plain < median - 0.2, (plain, median)


def test_krum_leaves_out_clients_from_the_cohort_weight():
    """FOLA's fixed_pi reads ``hparams["cohort_weight"]``; the clients Krum drops count as absent."""
    def server_update(server, messages, weights, mask, hparams, key):
        del messages, mask, key
        return server, {"cohort_weight": hparams["cohort_weight"], "weight_sum": jnp.sum(weights)}

    probe = bf.Algorithm("probe", server_init=lambda params: {"params": params}, client_init=lambda ctx, key: 0.0,
                         client_step=lambda local, batch, ctx, key: local,
                         client_final=lambda local, ctx: ({"params": ctx.server["params"]}, (), {}),
                         server_update=server_update)
    krum = bf.algorithms.with_robust_aggregation(probe, "multi_krum", byzantine_fraction=0.25)
    messages = {"params": {"w": jnp.array([[0.0], [0.1], [0.2], [10.0]])}}  # the last is far from the rest
    weights, mask = jnp.array([0.1, 0.2, 0.3, 0.4]), jnp.ones(4)
    _, metrics = krum.server_update({"params": {"w": jnp.zeros(1)}}, messages, weights, mask,
                                    {"round": 1, "cohort_weight": jnp.float32(0.5)}, jax.random.PRNGKey(0))
    assert float(metrics["weight_sum"]) == pytest.approx(1.0)
    assert float(metrics["cohort_weight"]) == pytest.approx(0.5 * 0.6)
