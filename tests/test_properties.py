"""Property-based tests (Hypothesis) of the aggregation rules and the partitioners (issue 16, item 5).

The example-based tests (test_aggregation_rules.py, test_posteriors.py, test_partition.py) pin
closed forms on a few fixed inputs; these check the invariances and identities the docstrings
promise on random small inputs. ``derandomize=True`` makes every run draw the same examples, so CI
is deterministic; no example database is written.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from jax import enable_x64

import bfedjax.posteriors as P
from bfedjax.data.partition import PARTITIONERS, dirichlet_per_class, dirichlet_train_test, partition
from bfedjax.posteriors import DiagGaussian

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
# Eager JAX costs ~40 ms per call of the seven masked rules (more on a loaded machine) once its ops are
# compiled for a shape, so the aggregation properties draw 10-20 examples; the numpy-only partitioner
# properties draw 40.
FEW = settings(max_examples=10, **SETTINGS)
SOME = settings(max_examples=20, **SETTINGS)
MANY = settings(max_examples=40, **SETTINGS)
RTOL = ATOL = 1e-9


@pytest.fixture(autouse=True, scope="module")
def x64():
    """float64 throughout, so the tolerances can be tight (the rules are dtype-generic)."""
    with enable_x64(True):
        yield


# ---------------------------------------------------------------------------------------------
# Strategies: cohorts of client posteriors with two leaves "w" and "b", each [K, D]
# ---------------------------------------------------------------------------------------------

MEAN = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False)
PREC = st.floats(0.05, 20.0)  # precisions > 0, bounded away from 0
WEIGHT = st.one_of(st.just(0.0), st.floats(0.05, 1.0))  # real clients may weigh zero


def _tree(draw, lead, d, elements):
    """Two leaves of one shape (eager JAX compiles each op once per shape, so one shape is cheaper)."""
    return {"w": draw(arrays(np.float64, lead + (d,), elements=elements)),
            "b": draw(arrays(np.float64, lead + (d,), elements=elements))}


D = 2  # one leaf width for every test: few shapes to compile keep the file fast


@st.composite
def cohorts(draw, k_min=1, k_max=3):
    """``(stacked DiagGaussian with leaves [K, D], weights [K] >= 0 with a positive sum, D)``."""
    k = draw(st.integers(k_min, k_max))
    d = D
    q = DiagGaussian(_tree(draw, (k,), d, MEAN), _tree(draw, (k,), d, PREC))
    w = draw(arrays(np.float64, (k,), elements=WEIGHT))
    if not w.any():
        w[draw(st.integers(0, k - 1))] = 1.0
    return q, w, d


@st.composite
def priors(draw, d, prec=st.floats(0.001, 0.04)):
    """A DWC prior. The default precision (< every client's 0.05) keeps Eq. 17's precision >= 0.05."""
    return DiagGaussian(_tree(draw, (), d, MEAN), _tree(draw, (), d, prec))


def take(tree, idx):
    return jax.tree.map(lambda x: np.asarray(x)[np.asarray(idx)], tree)


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# Every rule of the RULES table once (aliases: "clp" is nwa, "iv" is conflation), plus DWC.
MASKED = ("nwa", "ws", "lp", "conflation", "wc", "llp", "raw_param_fedavg", "dwc")
ALIASES = {"clp": "nwa", "iv": "conflation"}


def rule(name, q, w, mask=None, prior=None):
    return P.aggregate(name, q, jnp.asarray(w), mask=None if mask is None else jnp.asarray(mask), prior=prior)


def unmasked(q, w):
    """The rules with no mask: a padding client is one of weight 0."""
    w = jnp.asarray(w)
    return {"gaussian_product": P.gaussian_product(q, w),
            "moment_matched_mixture": P.moment_matched_mixture(q, w),
            "weighted_mean": P.weighted_mean(q.mean, w)}


def test_every_rule_is_covered():
    """A new rule in RULES must be added to the properties below."""
    assert set(P.RULES) == (set(MASKED) - {"dwc"}) | set(ALIASES)
    for alias, name in ALIASES.items():
        assert P.RULES[alias] is P.RULES[name]


# ---------------------------------------------------------------------------------------------
# Invariances
# ---------------------------------------------------------------------------------------------


@SOME
@given(st.data())
def test_permutation_invariance(data):
    """Permuting the client axis together with the weights (and mask) changes no rule's result."""
    q, w, d = data.draw(cohorts(k_min=2))
    k = len(w)
    perm = np.asarray(data.draw(st.permutations(range(k))))
    mask = np.ones(k)
    mask[data.draw(st.integers(0, k - 1))] = data.draw(st.sampled_from([0.0, 1.0]))  # maybe one padding slot
    assume((w * mask).sum() > 0)
    prior = data.draw(priors(d))
    for name in MASKED:
        assert_close(rule(name, take(q, perm), w[perm], mask[perm], prior), rule(name, q, w, mask, prior))
    a, b = unmasked(take(q, perm), w[perm]), unmasked(q, w)
    for name in a:
        assert_close(a[name], b[name])


@SOME
@given(st.data())
def test_padding_invariance(data):
    """Padding slots (mask 0, any finite mean, any precision > 0, any weight), anywhere, never count.

    The rules without a mask (product, mixture, weighted mean) are given padding as weight-0
    clients. Zero or non-finite values in a padding slot: see ``test_masked_slot_holding_*``.
    """
    q, w, d = data.draw(cohorts())
    k = len(w)
    extra = data.draw(st.integers(1, max(1, 4 - k)))  # K + extra <= 4: few shapes to compile
    pad = DiagGaussian(_tree(data.draw, (extra,), d, MEAN), _tree(data.draw, (extra,), d, PREC))
    padded = jax.tree.map(lambda a, b: np.concatenate([a, b]), q, pad)
    pad_w = data.draw(arrays(np.float64, (extra,), elements=st.floats(0.0, 1.0)))
    order = np.asarray(data.draw(st.permutations(range(k + extra))))  # padding slots anywhere
    padded = take(padded, order)
    mask = np.concatenate([np.ones(k), np.zeros(extra)])[order]
    prior = data.draw(priors(d))
    for name in MASKED:
        assert_close(rule(name, padded, np.concatenate([w, pad_w])[order], mask, prior), rule(name, q, w, None, prior))
    a, b = unmasked(padded, np.concatenate([w, np.zeros(extra)])[order]), unmasked(q, w)
    for name in a:
        assert_close(a[name], b[name])


@SOME
@given(cohorts(), st.floats(0.01, 100.0))
def test_scaling_the_weights(cohort, c):
    """Weights times c: the normalising and weight-free rules are unchanged; the product's powers
    scale its precision by c (mean unchanged); the weighted mean is linear in the weights."""
    q, w, d = cohort
    prior = DiagGaussian(jax.tree.map(lambda x: x[0], q.mean), jax.tree.map(lambda x: 0.01 + 0 * x[0], q.precision))
    for name in MASKED:
        assert_close(rule(name, q, c * w, prior=prior), rule(name, q, w, prior=prior), rtol=1e-8)
    a, b = unmasked(q, c * w), unmasked(q, w)
    assert_close(a["moment_matched_mixture"], b["moment_matched_mixture"], rtol=1e-8)
    assert_close(a["gaussian_product"].mean, b["gaussian_product"].mean, rtol=1e-8)
    assert_close(a["gaussian_product"].precision, jax.tree.map(lambda p: c * p, b["gaussian_product"].precision))
    assert_close(a["weighted_mean"], jax.tree.map(lambda m: c * m, b["weighted_mean"]), rtol=1e-8, atol=1e-8)


@FEW
@given(cohorts(k_min=2), st.data())
def test_the_product_is_additive_over_chunks(cohort, data):
    """Streamed rounds: summing gaussian_product_stats chunk by chunk gives the whole cohort's product."""
    q, w, _ = cohort
    cut = data.draw(st.integers(1, len(w) - 1))
    stats = jax.vmap(P.gaussian_product_stats)(q)
    head = jax.tree.map(lambda x: jnp.tensordot(jnp.asarray(w[:cut]), x[:cut], 1), stats)
    tail = jax.tree.map(lambda x: jnp.tensordot(jnp.asarray(w[cut:]), x[cut:], 1), stats)
    summed = jax.tree.map(jnp.add, head, tail)
    assert_close(P.gaussian_product_from_stats(summed), P.gaussian_product(q, jnp.asarray(w)))


@settings(max_examples=8, **SETTINGS)
@given(cohorts(), st.data())
def test_rules_are_elementwise_over_leaves(cohort, data):
    """A two-leaf posterior aggregates like each leaf on its own."""
    q, w, d = cohort
    prior = data.draw(priors(d))
    for name in MASKED:
        both = rule(name, q, w, prior=prior)
        for leaf in ("w", "b"):
            one = lambda t: {leaf: t[leaf]}
            alone = rule(name, DiagGaussian(one(q.mean), one(q.precision)), w,
                         prior=DiagGaussian(one(prior.mean), one(prior.precision)))
            assert_close(DiagGaussian(one(both.mean), one(both.precision)), alone)


# ---------------------------------------------------------------------------------------------
# Identities
# ---------------------------------------------------------------------------------------------


@FEW
@given(cohorts(k_min=1, k_max=1), st.floats(0.05, 5.0), st.data())
def test_one_client_is_its_own_posterior(cohort, w0, data):
    """With one real client every rule returns its posterior (the product raised to the power w
    has precision w * precision); DWC does so whatever the prior (K - 1 = 0)."""
    q, _, d = cohort
    w = np.array([w0])
    own = take(q, 0)
    prior = data.draw(priors(d, prec=PREC))
    for name in MASKED:
        assert_close(rule(name, q, w, prior=prior), own)
    out = unmasked(q, w)
    assert_close(out["moment_matched_mixture"], own)
    assert_close(out["gaussian_product"], DiagGaussian(own.mean, jax.tree.map(lambda p: w0 * p, own.precision)))
    assert_close(P.weighted_mean(q.mean, jnp.ones(1)), own.mean)


@SOME
@given(cohorts(k_min=1, k_max=1), cohorts(), st.data())
def test_identical_clients(one, shape_of, data):
    """K copies of one posterior (mean m, precision p), weights w: every mean stays m, and
    precision is p (nwa, lp, llp, raw_param_fedavg, mixture), K p (conflation), p / sum(wn^2) (ws), p / max(wn)
    (wc), sum(w) p (product); DWC with that posterior as prior returns it."""
    q1, _, d = one
    _, w, _ = shape_of
    k = len(w)
    q = jax.tree.map(lambda x: np.repeat(x, k, axis=0), q1)
    m, p = take(q1, 0)
    wn = w / w.sum()
    expected = {"nwa": 1.0, "lp": 1.0, "llp": 1.0, "conflation": k, "ws": 1.0 / np.sum(wn ** 2), "wc": 1.0 / wn.max(),
                "raw_param_fedavg": 1.0, "dwc": 1.0}
    for name in MASKED:
        out = rule(name, q, w, prior=DiagGaussian(m, p))
        assert_close(out, DiagGaussian(m, jax.tree.map(lambda x: expected[name] * x, p)), rtol=1e-8)
    out = unmasked(q, w)
    assert_close(out["moment_matched_mixture"], DiagGaussian(m, p), rtol=1e-8)
    assert_close(out["gaussian_product"], DiagGaussian(m, jax.tree.map(lambda x: w.sum() * x, p)), rtol=1e-8)
    assert_close(out["weighted_mean"], jax.tree.map(lambda x: w.sum() * x, m))  # FedAvg of equal params
    assert_close(P.weighted_mean(q.mean, jnp.asarray(wn)), m)


@SOME
@given(cohorts(), st.floats(1e-6, 1.0))
def test_product_eps_is_a_zero_mean_prior(cohort, eps):
    """gaussian_product's eps acts like one more client N(0, 1/eps) of power 1 (on the mean)."""
    q, w, _ = cohort
    extra = DiagGaussian(jax.tree.map(lambda x: np.zeros_like(x[:1]), q.mean),
                         jax.tree.map(lambda x: np.full_like(x[:1], eps), q.precision))
    with_prior = jax.tree.map(lambda a, b: np.concatenate([a, b]), q, extra)
    assert_close(P.gaussian_product(q, jnp.asarray(w), eps).mean,
                 P.gaussian_product(with_prior, jnp.asarray(np.append(w, 1.0))).mean)


# ---------------------------------------------------------------------------------------------
# Bounds and orderings the docstrings state
# ---------------------------------------------------------------------------------------------


@SOME
@given(cohorts())
def test_means_in_the_hull_and_variance_orderings(cohort):
    """Every rule but DWC averages the means with non-negative weights, so the mean lies between the
    clients' smallest and largest; var(ws) <= var(nwa) <= var(lp); var(conflation) <= every
    client's; llp's variance lies between the clients'; var(wc) = max(wn) var(llp) <= var(llp)."""
    q, w, _ = cohort
    lo, hi = jax.tree.map(lambda x: x.min(0), q.mean), jax.tree.map(lambda x: x.max(0), q.mean)
    var = lambda g: jax.tree.map(lambda p: 1.0 / np.asarray(p), g.precision)
    out = {name: rule(name, q, w) for name in MASKED if name != "dwc"}
    out.update({k: v for k, v in unmasked(q, w).items() if k != "weighted_mean"})
    for name, g in out.items():
        for leaf in ("w", "b"):
            assert np.all(np.asarray(g.mean[leaf]) >= lo[leaf] - 1e-9), name
            assert np.all(np.asarray(g.mean[leaf]) <= hi[leaf] + 1e-9), name
    v = {name: var(g) for name, g in out.items()}
    client_var = var(q)
    for leaf in ("w", "b"):
        tol = 1e-9 * (1 + client_var[leaf].max())
        assert np.all(v["ws"][leaf] <= v["nwa"][leaf] + tol)
        assert np.all(v["nwa"][leaf] <= v["lp"][leaf] + tol)
        assert np.all(v["conflation"][leaf] <= client_var[leaf].min(0) + tol)
        assert np.all(v["llp"][leaf] >= client_var[leaf].min(0) - tol)
        assert np.all(v["llp"][leaf] <= client_var[leaf].max(0) + tol)
        assert np.all(v["wc"][leaf] <= v["llp"][leaf] + tol)


@SOME
@given(cohorts(), st.data())
def test_dwc_guards(cohort, data):
    """DWC: with guard="none" the precision is Eq. 17's sum_k p_k - (K-1) p0; the default guard
    replaces exactly the coordinates where that is <= 0 by Conflation (positive, finite) and counts
    them; "floor" clips the precision at floor_ratio x the clients' mean precision."""
    q, w, d = cohort
    k = len(w)
    prior = data.draw(priors(d, prec=PREC))
    ratio = data.draw(st.floats(0.1, 2.0))
    raw, raw_hits = P.distributed_weight_consolidation(q, jnp.asarray(w), prior, guard="none")
    eq17 = jax.tree.map(lambda p, p0: p.sum(0) - (k - 1) * p0, q.precision, prior.precision)
    assert_close(raw.precision, eq17)
    bad = jax.tree.map(lambda x: np.asarray(x) <= 0, raw.precision)
    n_bad = sum(int(b.sum()) for b in jax.tree.leaves(bad))
    assert int(raw_hits) == n_bad
    guarded, hits = P.distributed_weight_consolidation(q, jnp.asarray(w), prior)
    conf = P.conflation(q, jnp.asarray(w))
    assert int(hits) == n_bad
    for leaf in ("w", "b"):
        g_prec, g_mean = np.asarray(guarded.precision[leaf]), np.asarray(guarded.mean[leaf])
        assert np.all(g_prec > 0) and np.all(np.isfinite(g_mean))
        b = bad[leaf]
        np.testing.assert_allclose(g_prec[b], np.asarray(conf.precision[leaf])[b], rtol=RTOL)
        np.testing.assert_allclose(g_mean[b], np.asarray(conf.mean[leaf])[b], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(g_prec[~b], np.asarray(raw.precision[leaf])[~b], rtol=RTOL)
        np.testing.assert_allclose(g_mean[~b], np.asarray(raw.mean[leaf])[~b], rtol=RTOL, atol=ATOL)
    floored, _ = P.distributed_weight_consolidation(q, jnp.asarray(w), prior, guard="floor", floor_ratio=ratio)
    for leaf in ("w", "b"):
        floor = ratio * q.precision[leaf].mean(0)
        np.testing.assert_allclose(floored.precision[leaf], np.maximum(eq17[leaf], floor), rtol=1e-9)


@st.composite
def full_cohorts(draw):
    k, d = draw(st.integers(1, 3)), D
    means = draw(arrays(np.float64, (k, d), elements=MEAN))
    a = draw(arrays(np.float64, (k, d, d), elements=st.floats(-2.0, 2.0)))
    precisions = np.einsum("kij,klj->kil", a, a) + 0.5 * np.eye(d)  # symmetric positive definite
    w = draw(arrays(np.float64, (k,), elements=st.floats(0.05, 1.0)))
    return means, precisions, w


@FEW
@given(full_cohorts(), st.data())
def test_full_covariance_product(cohort, data):
    """gaussian_product_full: permutation and weight-0 padding invariance, precision linear in the
    weights with the mean unchanged, one client of power 1 is itself, and on diagonal precisions it
    is gaussian_product."""
    means, precs, w = cohort
    k, d = means.shape
    mean, prec = P.gaussian_product_full(means, precs, w)
    perm = np.asarray(data.draw(st.permutations(range(k))))
    assert_close(P.gaussian_product_full(means[perm], precs[perm], w[perm]), (mean, prec), rtol=1e-7, atol=1e-7)
    pad = np.concatenate([means, means[:1] + 3.0]), np.concatenate([precs, 2.0 * precs[:1]]), np.append(w, 0.0)
    assert_close(P.gaussian_product_full(*pad), (mean, prec), rtol=1e-7, atol=1e-7)
    c = data.draw(st.floats(0.1, 10.0))
    assert_close(P.gaussian_product_full(means, precs, c * w), (mean, c * prec), rtol=1e-7, atol=1e-7)
    assert_close(P.gaussian_product_full(means[:1], precs[:1], np.ones(1)), (means[0], precs[0]), rtol=1e-7, atol=1e-7)
    diag = np.einsum("kii->ki", precs)
    dmean, dprec = P.gaussian_product_full(means, diag[:, :, None] * np.eye(d), w)
    prod = P.gaussian_product(DiagGaussian(jnp.asarray(means), jnp.asarray(diag)), jnp.asarray(w))
    assert_close((dmean, np.einsum("ii->i", dprec)), (prod.mean, prod.precision), rtol=1e-7, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Padding slots may hold any finite values (the module docstring: "Padding slots never count"),
# a zero precision included: a dropped client's message is zeroed by the engine.
# ---------------------------------------------------------------------------------------------


def _slot_cases():
    """A padding slot holding mean 0 and precision 0, as the engine leaves a client it dropped."""
    cases = []
    for name in MASKED:
        cases.append(pytest.param(name, 0.0, 0.0, id=f"{name}-zero_precision"))
    return cases


@pytest.mark.parametrize("name,bad_mean,bad_precision", _slot_cases())
def test_masked_slot_holding_a_zero_precision(name, bad_mean, bad_precision):
    q = DiagGaussian(np.array([[0.5], [1.0]]), np.array([[2.0], [1.0]]))
    padded = DiagGaussian(np.array([[0.5], [1.0], [bad_mean]]), np.array([[2.0], [1.0], [bad_precision]]))
    prior = DiagGaussian(np.array([0.1]), np.array([0.01]))
    out = rule(name, padded, np.array([0.5, 0.5, 0.0]), np.array([1.0, 1.0, 0.0]), prior)
    assert_close(out, rule(name, q, np.array([0.5, 0.5]), None, prior))


# =============================================================================================
# Partitioners
# =============================================================================================

SCHEMES = ("iid", "nested", "dirichlet_per_class", "dirichlet_per_client", "dirichlet_niid_bench", "shards",
           "power_law", "single_class", "class_groups")


def test_every_scheme_is_covered():
    assert set(PARTITIONERS) == set(SCHEMES)


@st.composite
def label_vectors(draw, min_m=1, max_m=48, max_classes=5):
    """Integer labels ``[m]`` over a few (not necessarily contiguous) class ids."""
    ids = draw(st.lists(st.integers(0, 12), min_size=1, max_size=max_classes, unique=True))
    m = draw(st.integers(min_m, max_m))
    return draw(arrays(np.int64, (m,), elements=st.sampled_from(sorted(ids))))


def _valid(parts, m, n):
    """n sorted, duplicate-free int64 index arrays into range(m)."""
    assert len(parts) == n
    for p in parts:
        assert isinstance(p, np.ndarray) and p.dtype == np.int64 and p.ndim == 1
        assert np.all(np.diff(p) > 0)
        assert p.size == 0 or (p.min() >= 0 and p.max() < m)


def _disjoint(parts):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx)


def _same(a, b):
    assert len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b))


def _run(y, scheme, n, seed, **kw):
    """partition(), called twice: the same arguments give the same partition."""
    parts = partition(y, scheme, n, seed=seed, **kw)
    _same(parts, partition(y, scheme, n, seed=seed, **kw))
    return parts


def _one_line_error(err):
    assert "\n" not in str(err), str(err)


SEED = st.integers(0, 2 ** 31 - 1)
ALPHA = st.sampled_from([0.01, 0.1, 0.5, 1.0, 10.0])


@MANY
@given(label_vectors(), st.integers(1, 8), SEED)
def test_iid_is_an_exact_cover_with_balanced_sizes(y, n, seed):
    assume(n <= len(y))
    parts = _run(y, "iid", n, seed)
    _valid(parts, len(y), n)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(y)))  # disjoint, nothing dropped
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@SOME
@given(label_vectors(), st.integers(1, 6), SEED)
def test_nested_gives_every_client_one_permutation(y, n, seed):
    """By design not disjoint: N copies of one seeded permutation of range(m) (not sorted)."""
    parts = _run(y, "nested", n, seed)
    assert len(parts) == n and all(p.dtype == np.int64 for p in parts)
    np.testing.assert_array_equal(np.sort(parts[0]), np.arange(len(y)))
    for p in parts[1:]:
        np.testing.assert_array_equal(p, parts[0])


def _unused_per_class(parts, y):
    covered = np.zeros(len(y), bool)
    covered[np.concatenate(parts)] = True
    return {int(c): int(np.sum(~covered[y == c])) for c in np.unique(y)}


@MANY
@given(label_vectors(), st.integers(1, 8), ALPHA, st.integers(1, 3), st.sampled_from(["fallback_sample", "resample"]),
       SEED)
def test_dirichlet_per_class(y, n, alpha, min_size, empty_rule, seed):
    """Floors drop at most N samples per class; every client holds >= min_size samples;
    "resample" is disjoint; "fallback_sample" with min_size=1 shares at most one index, of the
    lowest class (the first of its seeded shuffle)."""
    m = len(y)
    assume(n <= m and min_size <= m)  # min_size > m: see test_dirichlet_per_class_min_size_above_m
    try:
        parts = _run(y, "dirichlet_per_class", n, seed, alpha=alpha, min_size=min_size, empty_rule=empty_rule,
                     max_tries=50)
    except ValueError as err:  # "resample": min_size x N > m, or no draw in max_tries
        assert empty_rule == "resample"
        _one_line_error(err)
        assume(False)
    _valid(parts, m, n)
    assert min(len(p) for p in parts) >= min_size
    # floor(n_c P_ic) drops < N samples of class c in exact arithmetic; P's column sums 1 - 1 ulp can drop one
    # more (even with N = 1: Dir([alpha]) may return 0.9999999999999999, and floor(19 * that) = 18)
    assert max(_unused_per_class(parts, y).values()) <= n
    if empty_rule == "resample":
        _disjoint(parts)
    elif min_size == 1:
        counts = np.bincount(np.concatenate(parts), minlength=m)
        shared = np.flatnonzero(counts > 1)
        assert len(shared) <= 1 and np.all(y[shared] == y.min())


def test_dirichlet_per_class_min_size_above_m():
    """No client can hold more than the m samples: a one-line error, whatever the empty rule."""
    for rule in ("fallback_sample", "resample"):
        with pytest.raises(ValueError, match=r"min_size=3 exceeds the 2 samples; fix"):
            dirichlet_per_class(np.array([0, 1]), 1, alpha=1.0, seed=0, min_size=3, empty_rule=rule)


@MANY
@given(label_vectors(), st.integers(1, 8), ALPHA, st.integers(1, 3), SEED)
def test_dirichlet_niid_bench_is_an_exact_cover_below_the_cap(y, n, alpha, min_size, seed):
    """Every sample goes to exactly one client; each client holds >= min_size; replaying the classes in
    order, no client receives a class after reaching m / N. Impossible sizes: a one-line ValueError."""
    m = len(y)
    assume(n <= m)
    try:
        parts = _run(y, "dirichlet_niid_bench", n, seed, alpha=alpha, min_size=min_size, max_tries=50)
    except ValueError as err:  # min_size x N > m, or no draw in max_tries
        _one_line_error(err)
        assume(False)
    _valid(parts, m, n)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(m))
    assert min(len(p) for p in parts) >= min_size
    held = np.zeros(n, np.int64)
    for c in np.unique(y):
        got = np.array([np.sum(y[p] == c) for p in parts])
        assert np.all(got[held >= m / n] == 0)
        held += got


@MANY
@given(label_vectors(), st.integers(1, 6), ALPHA, st.booleans(), st.integers(1, 5), st.booleans(), st.data())
def test_dirichlet_per_client_sizes(y, n, alpha, balanced, rounds, given_sizes, data):
    """Disjoint; client sizes exactly m // N (or ``sizes``); the m - sum(sizes) rest is dropped."""
    m = len(y)
    assume(n <= m)
    kw = dict(alpha=alpha, balanced=balanced, rounds=rounds)
    if given_sizes:
        sizes = data.draw(st.lists(st.integers(1, max(1, m // n + 2)), min_size=n, max_size=n))
        assume(sum(sizes) <= m)
        kw["sizes"] = sizes
    else:
        sizes = [m // n] * n
    parts = _run(y, "dirichlet_per_client", n, data.draw(SEED), **kw)
    _valid(parts, m, n)
    _disjoint(parts)
    assert [len(p) for p in parts] == list(sizes)


@MANY
@given(label_vectors(), st.integers(1, 6), st.integers(1, 4), st.sampled_from([None, 0]), SEED)
def test_shards(y, n, cpc, max_repairs, seed):
    """Disjoint, each client exactly cpc classes; with N*cpc >= K shards every sample is used, else
    N*cpc whole classes are (the others are dropped). Infeasible sizes: a one-line ValueError."""
    m = len(y)
    assume(n <= m)
    counts = np.bincount(y)[np.unique(y)]
    k = len(counts)
    feasible = cpc <= k and n * cpc <= np.minimum(n, counts).sum()
    if not feasible:
        with pytest.raises(ValueError) as err:
            partition(y, "shards", n, seed=seed, classes_per_client=cpc, max_repairs=max_repairs)
        _one_line_error(err.value)
        return
    parts = _run(y, "shards", n, seed, classes_per_client=cpc, max_repairs=max_repairs)
    _valid(parts, m, n)
    _disjoint(parts)
    assert all(len(np.unique(y[p])) == cpc for p in parts)
    used = np.unique(y[np.concatenate(parts)])
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.flatnonzero(np.isin(y, used)))
    assert len(used) == (k if n * cpc >= k else n * cpc)


@MANY
@given(label_vectors(), st.integers(1, 6), st.integers(1, 3), st.sampled_from(["lognormal", "pareto"]),
       st.floats(0.2, 3.0), st.integers(1, 4), st.sampled_from([1.0, 0.6, 0.25]), SEED)
def test_power_law(y, n, cpc, distribution, shape, min_size, fraction, seed):
    """Disjoint; each client exactly cpc classes and >= min_size samples; at most
    max(fraction * m, N * cpc * ceil(min_size / cpc)) samples handed out. A class-supply error is
    one line and only where some class has fewer than ceil(N*cpc/K) * ceil(min_size/cpc) samples."""
    m = len(y)
    assume(n <= m)
    counts = np.bincount(y)[np.unique(y)]
    k = len(counts)
    assume(cpc <= k)
    base = -(-min_size // cpc)
    kw = dict(classes_per_client=cpc, distribution=distribution, sigma=shape, exponent=shape, min_size=min_size,
              fraction=fraction)
    try:
        parts = _run(y, "power_law", n, seed, **kw)
    except ValueError as err:
        _one_line_error(err)
        assert -(-n * cpc // k) * base > counts.min()  # the sufficient condition failed
        return
    _valid(parts, m, n)
    _disjoint(parts)
    assert all(len(np.unique(y[p])) == cpc and len(p) >= min_size for p in parts)
    assert sum(len(p) for p in parts) <= max(int(fraction * m), n * cpc * base)


@MANY
@given(label_vectors(), st.integers(1, 8), st.integers(1, 4), SEED)
def test_single_class(y, n, size, seed):
    """Disjoint; every client exactly ``samples_per_client`` samples of one class; classes dealt
    round-robin (clients per class differ by at most one)."""
    m = len(y)
    assume(n <= m)
    classes, counts = np.unique(y, return_counts=True)
    try:
        parts = _run(y, "single_class", n, seed, samples_per_client=size)
    except ValueError as err:
        _one_line_error(err)
        assert -(-n // len(classes)) * size > counts.min()  # the sufficient condition failed
        return
    _valid(parts, m, n)
    _disjoint(parts)
    assert all(len(p) == size and len(np.unique(y[p])) == 1 for p in parts)
    per_class = np.array([sum(int(y[p[0]] == c) for p in parts) for c in classes])
    assert per_class.max() - per_class.min() <= 1


@MANY
@given(label_vectors(), st.data())
def test_class_groups(y, data):
    """Disjoint; client k holds exactly the samples labelled in groups[k] (fraction 1, seed unused),
    or max(1, round(fraction * n_c)) of each of its classes c; other classes are dropped."""
    present = np.unique(y).tolist()
    chosen = data.draw(st.lists(st.sampled_from(present), min_size=1, unique=True))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(chosen) - 1), max_size=2))) if len(chosen) > 1 else []
    groups = [chosen[a:b] for a, b in zip([0] + cuts, cuts + [len(chosen)])]
    fraction = data.draw(st.sampled_from([1.0, 0.5, 0.3]))
    seed = data.draw(SEED)
    parts = _run(y, "class_groups", len(groups), seed, groups=groups, fraction=fraction)
    _valid(parts, len(y), len(groups))
    _disjoint(parts)
    for part, group in zip(parts, groups):
        if fraction == 1.0:
            np.testing.assert_array_equal(part, np.flatnonzero(np.isin(y, group)))
        else:
            for c in group:
                n_c = int(np.sum(y == c))
                assert int(np.sum(y[part] == c)) == max(1, int(round(fraction * n_c)))
            assert np.all(np.isin(y[part], group))
    if fraction == 1.0:
        _same(parts, partition(y, "class_groups", len(groups), seed=seed + 1, groups=groups))


@MANY
@given(label_vectors(min_m=2), st.data())
def test_dirichlet_train_test_uses_the_same_proportions(y, data):
    """Both splits disjoint, train clients >= min_size. For every client i and class c, the train
    count a = floor(n_c P_ic) and the test count b = floor(t_c P_ic) come from one P_ic, so
    b n_c <= (a + 1) t_c and a t_c <= (b + 1) n_c; with test labels = train labels the class
    histograms are identical. Floors drop at most N samples per class in each set."""
    m = len(y)
    n = data.draw(st.integers(1, min(6, m)))
    alpha = data.draw(ALPHA)
    min_size = data.draw(st.integers(1, 2))
    seed = data.draw(SEED)
    test_size = data.draw(st.integers(1, 40))
    y_test = data.draw(arrays(np.int64, (test_size,), elements=st.sampled_from(np.unique(y).tolist())))
    try:
        train, test = dirichlet_train_test(y, y_test, n, alpha=alpha, seed=seed, min_size=min_size, max_tries=50)
    except ValueError as err:
        _one_line_error(err)
        assume(False)
    again = dirichlet_train_test(y, y_test, n, alpha=alpha, seed=seed, min_size=min_size, max_tries=50)
    _same(train, again[0])
    _same(test, again[1])
    _valid(train, m, n)
    _valid(test, len(y_test), n)
    _disjoint(train)
    _disjoint(test)
    assert min(len(p) for p in train) >= min_size
    assert max(_unused_per_class(train, y).values()) <= n  # < N in exact arithmetic; see test_dirichlet_per_class
    assert max(_unused_per_class(test, y_test).values()) <= n
    for c in np.unique(y):
        n_c, t_c = int(np.sum(y == c)), int(np.sum(y_test == c))
        for tr, te in zip(train, test):
            a, b = int(np.sum(y[tr] == c)), int(np.sum(y_test[te] == c))
            assert b * n_c <= (a + 1) * t_c and a * t_c <= (b + 1) * n_c, (c, a, b, n_c, t_c)
    try:  # the test set's shuffle takes other random numbers, so P is another draw that may not fit
        same_train, same_test = dirichlet_train_test(y, y.copy(), n, alpha=alpha, seed=seed, min_size=min_size,
                                                     max_tries=50)
    except ValueError:
        return
    for tr, te in zip(same_train, same_test):
        np.testing.assert_array_equal(np.bincount(y[tr], minlength=13), np.bincount(y[te], minlength=13))


@SOME
@given(label_vectors(min_m=20), st.integers(2, 4),
       st.sampled_from(["iid", "nested", "dirichlet_per_class", "dirichlet_per_client"]))
def test_the_seed_matters(y, n, scheme):
    """Different seeds give different partitions (statistical: among 8 seeds of these shuffling
    schemes on >= 20 samples, all equal has probability far below 1e-9)."""
    kw = {"alpha": 1.0} if scheme.startswith("dirichlet") else {}
    first = partition(y, scheme, n, seed=0, **kw)
    assert any(any(not np.array_equal(p, q) for p, q in zip(first, partition(y, scheme, n, seed=s, **kw)))
               for s in range(1, 8))
