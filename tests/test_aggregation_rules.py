"""Fischer et al. aggregation rules, weightings and parameterisation (spec fischer_bfl.md section 8)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

import bfedjax.posteriors as P
from bfedjax.posteriors import DiagGaussian, weighting


def _clients(seed, k=5, d=7, equal_var=None):
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=(k, d))
    var = np.full((k, d), equal_var) if equal_var else rng.uniform(0.05, 3.0, size=(k, d))
    w = rng.dirichlet(np.ones(k))
    return DiagGaussian(jnp.asarray(mean), jnp.asarray(1.0 / var)), jnp.asarray(w)


var = lambda q: 1.0 / q.precision


@pytest.fixture(autouse=True)
def x64():
    with enable_x64(True):
        yield


def test_linear_pool_variance_in_float32_with_variances_far_below_the_squared_means():
    """Eq. 14 as the spread about the pooled mean: the second moment minus mean^2 cancelled in float32 here (a
    tenth of the coordinates came out <= 0, and their scales NaN)."""
    rng = np.random.default_rng(0)
    means = (0.7 + 1e-4 * rng.normal(size=(10, 1000))).astype(np.float32)
    scales = np.full((10, 1000), 1e-4, np.float32)
    w = rng.dirichlet(np.ones(10)).astype(np.float32)
    got = var(P.linear_pool(DiagGaussian(jnp.asarray(means), jnp.asarray(1.0 / scales ** 2)), jnp.asarray(w)))
    assert got.dtype == jnp.float32
    m64, w64 = means.astype(np.float64), w.astype(np.float64) / w.astype(np.float64).sum()
    want = w64 @ (np.square(scales.astype(np.float64)) + np.square(m64 - w64 @ m64))
    np.testing.assert_allclose(got, want, rtol=1e-3)


def test_shared_means_and_variance_ordering():
    q, w = _clients(0)
    nwa, ws, lp = P.nwa(q, w), P.weighted_sum_of_normals(q, w), P.linear_pool(q, w)
    np.testing.assert_allclose(nwa.mean, w @ q.mean, rtol=1e-12)
    np.testing.assert_allclose(ws.mean, nwa.mean, rtol=1e-12)
    np.testing.assert_allclose(lp.mean, nwa.mean, rtol=1e-12)
    np.testing.assert_allclose(P.weighted_conflation(q, w).mean, P.log_linear_pool(q, w).mean, rtol=1e-12)
    assert np.all(var(ws) <= var(nwa) + 1e-12) and np.all(var(nwa) <= var(lp) + 1e-12)
    one_hot = jnp.zeros(5).at[2].set(1.0)
    np.testing.assert_allclose(var(P.weighted_sum_of_normals(q, one_hot)), var(P.nwa(q, one_hot)), rtol=1e-12)
    same_means = DiagGaussian(jnp.broadcast_to(q.mean[0], q.mean.shape), q.precision)
    np.testing.assert_allclose(var(P.linear_pool(same_means, w)), var(P.nwa(same_means, w)), rtol=1e-10)
    assert P.centered_linear_pool is P.nwa


def test_uniform_weights_wc_is_conflation_and_equal_variances():
    q, _ = _clients(1)
    u = jnp.full(5, 0.2)
    chex.assert_trees_all_close(P.weighted_conflation(q, u), P.conflation(q, u), rtol=1e-12)
    qe, _ = _clients(2, equal_var=0.7)
    for rule in (P.weighted_sum_of_normals, P.weighted_conflation, P.conflation):
        np.testing.assert_allclose(var(rule(qe, u)), 0.7 / 5, rtol=1e-12)
    for rule in (P.nwa, P.log_linear_pool):
        np.testing.assert_allclose(var(rule(qe, u)), 0.7, rtol=1e-12)
    disagreement = jnp.mean(jnp.square(qe.mean - qe.mean.mean(0)), 0)
    np.testing.assert_allclose(var(P.linear_pool(qe, u)), 0.7 + disagreement, rtol=1e-10)


def test_k_fold_shrinkage_over_rounds():
    g = DiagGaussian(jnp.array([0.3, -1.0]), jnp.array([2.0, 0.5]))
    for rule, factor in ((P.weighted_sum_of_normals, 5.0), (P.weighted_conflation, 5.0), (P.conflation, 5.0),
                         (P.nwa, 1.0), (P.log_linear_pool, 1.0), (P.linear_pool, 1.0)):
        cur = g
        for _ in range(3):
            cur = rule(jax.tree.map(lambda x: jnp.broadcast_to(x, (5,) + x.shape), cur), jnp.full(5, 0.2))
        np.testing.assert_allclose(var(cur), var(g) / factor ** 3, rtol=1e-10)
        np.testing.assert_allclose(cur.mean, g.mean, rtol=1e-12)


def test_llp_wc_relation_and_bounds():
    q, w = _clients(3)
    np.testing.assert_allclose(var(P.log_linear_pool(q, w)), var(P.weighted_conflation(q, w)) / jnp.max(w), rtol=1e-12)
    assert np.all(var(P.weighted_conflation(q, w)) <= var(q)[int(jnp.argmax(w))] + 1e-12)
    assert np.all(var(P.conflation(q, w)) <= var(q).min(0) + 1e-12)


def test_conflation_is_a_normalised_product_associative_and_commutative():
    q, w = _clients(4, k=3, d=1)
    grid = np.linspace(-20, 20, 400001)
    logp = sum(-0.5 * float(q.precision[k, 0]) * (grid - float(q.mean[k, 0])) ** 2 for k in range(3))
    p = np.exp(logp - logp.max()); p /= p.sum()
    conf = P.conflation(q, w)
    m = np.sum(p * grid)
    np.testing.assert_allclose(m, conf.mean[0], rtol=1e-6)
    np.testing.assert_allclose(np.sum(p * (grid - m) ** 2), var(conf)[0], rtol=1e-5)
    first_two = P.conflation(jax.tree.map(lambda x: x[:2], q), w[:2])
    nested = P.conflation(jax.tree.map(lambda a, b: jnp.stack([a, b]), first_two, jax.tree.map(lambda x: x[2], q)),
                          jnp.ones(2))
    chex.assert_trees_all_close(nested, conf, rtol=1e-12)
    perm = jnp.array([2, 0, 1])
    chex.assert_trees_all_close(P.conflation(jax.tree.map(lambda x: x[perm], q), w[perm]), conf, rtol=1e-12)


def test_lp_and_ws_match_monte_carlo():
    q, w = _clients(5, k=3, d=2)
    rng = np.random.default_rng(0)
    sd = np.sqrt(np.asarray(var(q)))
    comp = rng.choice(3, size=400000, p=np.asarray(w))
    mixture = np.asarray(q.mean)[comp] + sd[comp] * rng.normal(size=(400000, 2))
    np.testing.assert_allclose(mixture.mean(0), P.linear_pool(q, w).mean, atol=0.02)
    np.testing.assert_allclose(mixture.var(0), var(P.linear_pool(q, w)), rtol=0.02)
    draws = np.asarray(q.mean)[None] + sd[None] * rng.normal(size=(200000, 3, 2))
    weighted = np.einsum("k,nkd->nd", np.asarray(w), draws)
    np.testing.assert_allclose(weighted.var(0), var(P.weighted_sum_of_normals(q, w)), rtol=0.02)


def test_dwc_identities_and_guard():
    q, w = _clients(6)
    prior = DiagGaussian(jnp.zeros(7) + 0.1, jnp.full(7, 0.5))
    one = jax.tree.map(lambda x: x[:1], q)
    chex.assert_trees_all_close(P.distributed_weight_consolidation(one, jnp.ones(1), prior)[0],
                                jax.tree.map(lambda x: x[0], one), rtol=1e-12)
    copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (4,) + x.shape), prior)
    chex.assert_trees_all_close(P.distributed_weight_consolidation(copies, jnp.ones(4), prior)[0], prior, rtol=1e-10)
    # Exact Bayes: client posteriors = prior x Gaussian likelihood factor.
    rng = np.random.default_rng(1)
    lik_mean, lik_prec = rng.normal(size=(4, 7)), rng.uniform(0.5, 2.0, size=(4, 7))
    post_prec = prior.precision + lik_prec
    post_mean = (prior.precision * prior.mean + lik_prec * lik_mean) / post_prec
    dwc, hits = P.distributed_weight_consolidation(DiagGaussian(jnp.asarray(post_mean), jnp.asarray(post_prec)),
                                                   jnp.ones(4), prior)
    joint_prec = prior.precision + lik_prec.sum(0)
    joint_mean = (prior.precision * prior.mean + (lik_prec * lik_mean).sum(0)) / joint_prec
    np.testing.assert_allclose(dwc.precision, joint_prec, rtol=1e-10)
    np.testing.assert_allclose(dwc.mean, joint_mean, rtol=1e-10)
    assert int(hits) == 0
    # The guard: clients vaguer than K-1 priors fall back to conflation, finite output.
    vague = DiagGaussian(q.mean, jnp.full_like(q.precision, 0.1))
    sharp_prior = DiagGaussian(prior.mean, jnp.full(7, 10.0))
    out, hits = P.distributed_weight_consolidation(vague, w, sharp_prior)
    assert int(hits) == 7
    chex.assert_trees_all_close(out, P.conflation(vague, w), rtol=1e-12)
    assert np.all(np.isfinite(out.mean)) and np.all(out.precision > 0)
    with pytest.raises(ValueError, match="prior"):
        P.aggregate("dwc", q, w)


def test_dwc_floor_and_unguarded_options():
    q, w = _clients(4)
    vague = DiagGaussian(q.mean, jnp.full_like(q.precision, 0.1))
    sharp_prior = DiagGaussian(jnp.zeros(7) + 0.3, jnp.full(7, 10.0))
    k = int(jnp.sum(w > 0))
    floored, hits = P.distributed_weight_consolidation(vague, w, sharp_prior, guard="floor", floor_ratio=0.5)
    assert int(hits) == 7
    np.testing.assert_allclose(floored.precision, 0.5 * 0.1, rtol=1e-10)  # 0.5 x the clients' mean precision
    shifted = jnp.sum(vague.precision * vague.mean, 0) - (k - 1) * 10.0 * 0.3
    np.testing.assert_allclose(floored.mean, shifted / 0.05, rtol=1e-10)
    raw, raw_hits = P.distributed_weight_consolidation(vague, w, sharp_prior, guard="none")
    assert int(raw_hits) == 7 and np.all(raw.precision < 0)
    # Where Eq. 17 is already well above the floor, every guard leaves it alone.
    exact, _ = P.distributed_weight_consolidation(q, w, DiagGaussian(q.mean[0], jnp.full(7, 1e-3)))
    for guard in ("floor", "none"):
        other, n = P.distributed_weight_consolidation(q, w, DiagGaussian(q.mean[0], jnp.full(7, 1e-3)), guard=guard,
                                                      floor_ratio=0.01)
        assert int(n) == 0
        chex.assert_trees_all_close(other, exact, rtol=1e-10)
    with pytest.raises(ValueError, match="guard"):
        P.distributed_weight_consolidation(q, w, sharp_prior, guard="clip")


def test_rules_are_elementwise_and_permutation_invariant_on_trees():
    q, w = _clients(7, k=4, d=6)
    tree = DiagGaussian({"a": q.mean[:, :2], "b": q.mean[:, 2:]}, {"a": q.precision[:, :2], "b": q.precision[:, 2:]})
    perm = jnp.array([3, 1, 0, 2])
    for name in sorted(P.RULES):
        flat = P.aggregate(name, q, w)
        split = P.aggregate(name, tree, w)
        np.testing.assert_allclose(jnp.concatenate([split.mean["a"], split.mean["b"]]), flat.mean, rtol=1e-12)
        np.testing.assert_allclose(jnp.concatenate([split.precision["a"], split.precision["b"]]), flat.precision,
                                   rtol=1e-12)
        chex.assert_trees_all_close(P.aggregate(name, jax.tree.map(lambda x: x[perm], q), w[perm]), flat, rtol=1e-12)
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        P.aggregate("median", q, w)


def test_masked_padding_slots_are_ignored():
    q, w = _clients(8, k=4)
    padded_q = jax.tree.map(lambda x: jnp.concatenate([x, x[:2] + 5.0]), q)
    padded_w = jnp.concatenate([w, jnp.full(2, 0.3)])  # even a weight on a padding slot never counts
    mask = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    for name in sorted(P.RULES):
        chex.assert_trees_all_close(P.aggregate(name, padded_q, padded_w, mask=mask), P.aggregate(name, q, w),
                                    rtol=1e-12)
    prior = DiagGaussian(q.mean[0], jnp.full(7, 1e-3))
    chex.assert_trees_all_close(P.aggregate("dwc", padded_q, padded_w, mask=mask, prior=prior),
                                P.aggregate("dwc", q, w, prior=prior), rtol=1e-12)


def test_a_real_client_with_zero_weight_still_counts_where_weights_do_not():
    """Conflation and DWC's K count real clients (mask), not positive weights."""
    q, w = _clients(11, k=4)
    zero = w.at[3].set(0.0)
    chex.assert_trees_all_close(P.conflation(q, zero), P.conflation(q, w), rtol=1e-12)  # weights ignored
    three = jax.tree.map(lambda x: x[:3], q)
    assert not np.allclose(P.conflation(q, zero).precision, P.conflation(three, zero[:3]).precision)
    prior = DiagGaussian(q.mean[0], jnp.full(7, 1e-3))
    k4 = P.distributed_weight_consolidation(q, zero, prior, guard="none")[0].precision
    k3 = P.distributed_weight_consolidation(three, zero[:3], prior, guard="none")[0].precision
    np.testing.assert_allclose(k4 - k3, q.precision[3] - prior.precision, rtol=1e-8)  # K = 4, not 3
    # weighted rules: a zero-weight real client changes nothing
    for name in ("nwa", "ws", "lp", "wc", "llp"):
        chex.assert_trees_all_close(P.aggregate(name, q, zero), P.aggregate(name, three, zero[:3]), rtol=1e-12)


def test_weightings():
    q, _ = _clients(9, k=4)
    g = jax.tree.map(lambda x: x[0] * 0.9, q)
    for w in (weighting.uniform(4), weighting.by_size(jnp.array([5, 1, 3, 2])), weighting.max_discrepancy(q),
              weighting.max_discrepancy(q, literal=True), weighting.distance(q, g)):
        assert np.all(np.isfinite(w)) and np.all(w > 0)
        np.testing.assert_allclose(jnp.sum(w), 1.0, rtol=1e-12)
    np.testing.assert_allclose(weighting.by_size(jnp.array([3, 3, 3, 3])), weighting.uniform(4), rtol=1e-12)
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[0], x.shape), q)
    np.testing.assert_allclose(weighting.max_discrepancy(same), jnp.full(4, 0.25), rtol=1e-12)
    np.testing.assert_allclose(weighting.distance(same, jax.tree.map(lambda x: x[0], q)), jnp.full(4, 0.25), rtol=1e-12)
    # A client far from the others gets the smallest max-discrepancy weight.
    outlier = DiagGaussian(q.mean.at[2].add(10.0), q.precision)
    assert int(jnp.argmin(weighting.max_discrepancy(outlier))) == 2
    np.testing.assert_allclose(weighting.max_discrepancy(q, mask=jnp.array([1., 1., 1., 0.]))[3], 0.0)


def test_raw_param_fedavg_averages_mu_and_rho_as_stored():
    q, w = _clients(11, k=4, d=6)
    out = P.aggregate("raw_param_fedavg", q, w)
    sigma = np.sqrt(np.asarray(var(q)))
    rho = np.log(np.expm1(sigma))  # NumPyro's softplus-constrained scale, unconstrained
    expected_sigma = np.log1p(np.exp(np.asarray(w) @ rho))
    np.testing.assert_allclose(out.mean, np.asarray(w) @ np.asarray(q.mean), rtol=1e-10)
    np.testing.assert_allclose(np.sqrt(var(out)), expected_sigma, rtol=1e-8)
    nwa = P.aggregate("nwa", q, w)  # same mean, another variance (Eq. 10 averages sigma^2)
    np.testing.assert_allclose(out.mean, nwa.mean, rtol=1e-12)
    assert not np.allclose(var(out), var(nwa), rtol=1e-3)
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[0], x.shape), q)
    chex.assert_trees_all_close(P.aggregate("raw_param_fedavg", same, w), jax.tree.map(lambda x: x[0], q), rtol=1e-8)


def test_weightings_spec_alternatives():
    q, _ = _clients(12, k=4)
    g = jax.tree.map(lambda x: x[0] * 0.9, q)
    kl = np.asarray(weighting.pairwise_kl(q))
    sym = kl + kl.T
    gamma = 1.0 / np.max(np.where(np.eye(4) > 0, 0.0, sym), axis=1)
    np.testing.assert_allclose(weighting.max_discrepancy(q, symmetric=True), gamma / gamma.sum(), rtol=1e-10)
    literal_sym = np.max(np.where(np.eye(4) > 0, -np.inf, 1.0 / np.where(np.eye(4) > 0, 1.0, sym)), axis=1)
    np.testing.assert_allclose(weighting.max_discrepancy(q, literal=True, symmetric=True),
                               literal_sym / literal_sym.sum(), rtol=1e-10)
    reverse = np.array([float(P.kl_divergence(jax.tree.map(lambda x: x[k], q), g)) for k in range(4)])
    np.testing.assert_allclose(weighting.distance(q, g, reverse=True), (1 / reverse) / (1 / reverse).sum(), rtol=1e-10)
    assert not np.allclose(weighting.distance(q, g, reverse=True), weighting.distance(q, g), rtol=1e-3)


def test_kl_and_scale_parameterisation():
    q, _ = _clients(10, k=2, d=3)
    a, b = jax.tree.map(lambda x: x[0], q), jax.tree.map(lambda x: x[1], q)
    np.testing.assert_allclose(P.kl_divergence(a, a), 0.0, atol=1e-12)
    assert P.kl_divergence(a, b) > 0
    rng = np.random.default_rng(0)
    x = np.asarray(a.mean) + np.sqrt(np.asarray(1 / a.precision)) * rng.normal(size=(400000, 3))
    logq = -0.5 * (np.log(2 * np.pi / np.asarray(a.precision)) + np.asarray(a.precision) * (x - np.asarray(a.mean)) ** 2)
    logp = -0.5 * (np.log(2 * np.pi / np.asarray(b.precision)) + np.asarray(b.precision) * (x - np.asarray(b.mean)) ** 2)
    np.testing.assert_allclose(np.mean((logq - logp).sum(1)), P.kl_divergence(a, b), rtol=0.02)
    per_coord = sum(P.kl_divergence(DiagGaussian(a.mean[i], a.precision[i]), DiagGaussian(b.mean[i], b.precision[i]))
                    for i in range(3))
    np.testing.assert_allclose(per_coord, P.kl_divergence(a, b), rtol=1e-12)


def test_rho_scale_round_trip_float32():
    with enable_x64(False):
        rho = jnp.linspace(-20.0, 5.0, 1001, dtype=jnp.float32)
        back = P.softplus_inverse(jax.nn.softplus(rho))
        np.testing.assert_allclose(back, rho, rtol=2e-3, atol=2e-3)
        scale = P.rho_to_scale(jnp.array([-3.0, 0.0, 2.0], jnp.float32))
        rho_back, hits = P.scale_to_rho(scale)
        np.testing.assert_allclose(P.rho_to_scale(rho_back), scale, rtol=1e-5)
        assert int(hits) == 0
        _, hits = P.scale_to_rho(jnp.array([1e-9, 0.5], jnp.float32))
        assert int(hits) == 1
