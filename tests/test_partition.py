"""Tests for bfedjax.data.partition (numpy only, synthetic labels)."""

import numpy as np
import pytest

from bfedjax.data.partition import (
    PARTITIONERS,
    class_groups,
    describe,
    dirichlet_niid_bench,
    dirichlet_per_class,
    dirichlet_per_client,
    iid,
    partition,
    power_law,
    shards,
    single_class,
)

K = 10


def _labels(per_class=600, k=K, seed=0):
    """Balanced labels ``[per_class * k]`` in a shuffled order."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(k), per_class))


def _imbalanced_labels(seed=0):
    counts = [2000, 1000, 500, 300, 200, 100, 50, 20, 10, 5]
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(K), counts))


Y = _labels()
M = len(Y)

# scheme -> (num_clients, kwargs) used by the generic tests
CASES = {
    "iid": (10, {}),
    "dirichlet_per_class": (10, {"alpha": 0.5}),
    "dirichlet_per_client": (10, {"alpha": 0.5}),
    "dirichlet_niid_bench": (10, {"alpha": 0.5}),
    "shards": (10, {"classes_per_client": 2}),
    "power_law": (20, {"classes_per_client": 2}),
    "single_class": (50, {"samples_per_client": 24}),
    "class_groups": (2, {"groups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]}),
}


def _check(parts, m, n, disjoint=True):
    assert len(parts) == n
    for p in parts:
        assert isinstance(p, np.ndarray) and p.dtype == np.int64 and p.ndim == 1
        assert len(p) > 0
        assert p.min() >= 0 and p.max() < m
        assert len(np.unique(p)) == len(p)
        assert np.all(np.diff(p) > 0)  # sorted
    if disjoint:
        allidx = np.concatenate(parts)
        assert len(np.unique(allidx)) == len(allidx)


def test_registry_covers_all_schemes():
    # "nested" (FedRef's overlapping prefixes, not disjoint) is tested in test_fedref.py
    assert set(PARTITIONERS) == set(CASES) | {"nested"}


@pytest.mark.parametrize("scheme", sorted(CASES))
def test_generic_properties_and_determinism(scheme):
    n, kw = CASES[scheme]
    a = partition(Y, scheme, n, seed=3, **kw)
    _check(a, M, n)
    b = partition(Y, scheme, n, seed=3, **kw)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p, q)
    if scheme != "class_groups":  # class_groups with fraction=1 ignores the seed
        c = partition(Y, scheme, n, seed=4, **kw)
        assert any(not np.array_equal(p, q) for p, q in zip(a, c))


def test_global_rng_untouched():
    np.random.seed(123)
    state = np.random.get_state()
    for scheme, (n, kw) in CASES.items():
        partition(Y, scheme, n, seed=0, **kw)
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1]) and state[2:] == after[2:]


def test_iid_sizes():
    parts = iid(Y, 7, seed=0)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == M and max(sizes) - min(sizes) <= 1


# --------------------------------------------------------------------------
# dirichlet_niid_bench
# --------------------------------------------------------------------------


@pytest.mark.parametrize("alpha,labels", [(0.1, Y), (0.5, Y), (5.0, Y), (0.3, _imbalanced_labels())])
def test_niid_bench_caps_clients_at_the_mean_size_class_by_class(alpha, labels):
    n = 10
    parts = dirichlet_niid_bench(labels, n, alpha=alpha, seed=1)
    _check(parts, len(labels), n)
    assert sum(len(p) for p in parts) == len(labels)  # every sample goes to a client
    assert min(len(p) for p in parts) >= 10
    # replay the classes in increasing order: a client takes samples of class c only while it holds
    # fewer than m / N samples of the classes before
    held = np.zeros(n, np.int64)
    for c in np.unique(labels):
        got = np.array([np.sum(labels[p] == c) for p in parts])
        assert np.all(got[held >= len(labels) / n] == 0)
        held += got


def test_niid_bench_sizes_stay_nearer_the_mean_than_the_uncapped_split():
    spread = lambda parts: np.std([len(p) for p in parts])
    capped = [spread(dirichlet_niid_bench(Y, 10, alpha=0.1, seed=s)) for s in range(10)]
    uncapped = [spread(dirichlet_per_class(Y, 10, alpha=0.1, seed=s, empty_rule="resample", min_size=10))
                for s in range(10)]
    assert np.mean(capped) < 0.8 * np.mean(uncapped)


def test_niid_bench_min_size_redraws_or_fails_in_one_line():
    parts = dirichlet_niid_bench(Y, 20, alpha=0.05, seed=0, min_size=50)
    assert min(len(p) for p in parts) >= 50
    with pytest.raises(ValueError, match="fix: raise alpha"):
        dirichlet_niid_bench(Y, 50, alpha=0.001, seed=0, min_size=100, max_tries=3)
    with pytest.raises(ValueError, match="exceeds"):
        dirichlet_niid_bench(Y, 10, alpha=0.5, seed=0, min_size=M)


# --------------------------------------------------------------------------
# dirichlet_per_class
# --------------------------------------------------------------------------


def test_per_class_sizes_sum():
    parts = dirichlet_per_class(Y, 10, alpha=0.5, seed=0)
    total = sum(len(p) for p in parts)
    assert M - 10 * K <= total <= M  # only floor leftovers (< N per class) are lost


def test_per_class_small_alpha_concentrates_each_class():
    # Dir(1e-3 * 1_10) splits a class noticeably only ~2.5% of the time.
    shares = []
    for seed in range(5):
        hist = describe(dirichlet_per_class(Y, 10, alpha=1e-3, seed=seed), Y, K)["class_hist"]  # [N, K]
        shares.append(hist.max(axis=0) / np.bincount(Y))
    shares = np.concatenate(shares)
    assert np.mean(shares > 0.95) >= 0.9 and np.median(shares) > 0.99


def test_per_class_large_alpha_is_near_uniform():
    n = 10
    parts = dirichlet_per_class(Y, n, alpha=1e4, seed=0)
    d = describe(parts, Y, K)
    np.testing.assert_allclose(d["class_hist"] / np.bincount(Y)[None, :], 1 / n, atol=0.02)
    np.testing.assert_allclose(d["sizes"], M / n, rtol=0.05)


@pytest.mark.parametrize("seed", range(5))
def test_per_class_many_clients_tiny_alpha_never_empty(seed):
    parts = dirichlet_per_class(Y, 50, alpha=0.01, seed=seed)
    _check(parts, M, 50, disjoint=False)
    d = describe(parts, Y, K)
    assert d["min_size"] >= 1
    # fallback samples are the first (shuffled) index of class 0 -> shared
    assert d["num_shared"] <= 1


def test_per_class_min_size_fallback_and_resample():
    parts = dirichlet_per_class(Y, 50, alpha=0.01, seed=0, min_size=3)
    assert min(len(p) for p in parts) >= 3
    parts = dirichlet_per_class(Y, 20, alpha=1.0, seed=0, min_size=50, empty_rule="resample")
    _check(parts, M, 20)
    assert min(len(p) for p in parts) >= 50
    with pytest.raises(ValueError, match="fallback_sample"):
        dirichlet_per_class(Y, 50, alpha=0.01, seed=0, empty_rule="resample", max_tries=5)
    with pytest.raises(ValueError, match="empty_rule"):
        dirichlet_per_class(Y, 5, alpha=1.0, seed=0, empty_rule="nope")


# --------------------------------------------------------------------------
# dirichlet_per_client
# --------------------------------------------------------------------------


@pytest.mark.parametrize("balanced", [False, True])
def test_per_client_equal_sizes(balanced):
    parts = dirichlet_per_client(Y, 7, alpha=0.5, seed=0, balanced=balanced)
    _check(parts, M, 7)
    assert [len(p) for p in parts] == [M // 7] * 7


def test_per_client_alpha_controls_heterogeneity():
    small = describe(dirichlet_per_client(Y, 20, alpha=0.05, seed=0), Y, K)
    # sizes below m / N so no class runs out (exhaustion would skew the last clients)
    large = describe(dirichlet_per_client(Y, 20, alpha=1e4, seed=0, sizes=[200] * 20), Y, K)
    assert small["classes_per_client"].mean() < 3
    assert np.all(large["classes_per_client"] == K)
    np.testing.assert_allclose(large["class_hist"] / large["sizes"][:, None], 1 / K, atol=0.1)  # ~5 sigma at n=200


def test_per_client_exhaustion_and_sizes_argument():
    y = _imbalanced_labels()
    parts = dirichlet_per_client(y, 30, alpha=0.1, seed=0)  # rare classes run out
    _check(parts, len(y), 30)
    assert sum(len(p) for p in parts) == (len(y) // 30) * 30
    sizes = [100, 200, 300]
    parts = dirichlet_per_client(y, 3, alpha=1.0, seed=1, sizes=sizes, balanced=True)
    assert [len(p) for p in parts] == sizes
    with pytest.raises(ValueError, match="sizes"):
        dirichlet_per_client(y, 2, alpha=1.0, seed=0, sizes=[len(y), 1])


# --------------------------------------------------------------------------
# shards
# --------------------------------------------------------------------------


def test_shards_two_class_split_fischer():
    parts = shards(Y, 10, classes_per_client=2, seed=0)
    _check(parts, M, 10)
    hist = describe(parts, Y, K)["class_hist"]
    assert np.all((hist > 0).sum(axis=1) == 2)
    assert set(np.unique(hist)) == {0, 300}  # 20 half-class shards
    assert sum(len(p) for p in parts) == M


@pytest.mark.parametrize("n,cpc", [(100, 2), (7, 3), (30, 5), (10, 10), (3, 2)])
def test_shards_exact_classes_per_client(n, cpc):
    y = _imbalanced_labels() if n == 30 else Y
    parts = shards(y, n, classes_per_client=cpc, seed=1)
    _check(parts, len(y), n)
    d = describe(parts, y, K)
    assert np.all(d["classes_per_client"] == cpc)


def test_shards_round_robin_fallback():
    """With no repair budget the class-sorted round-robin deal must still be exact."""
    for n, cpc in [(10, 2), (100, 2), (7, 3), (10, 10)]:
        parts = shards(Y, n, classes_per_client=cpc, seed=0, max_repairs=0)
        _check(parts, M, n)
        assert np.all(describe(parts, Y, K)["classes_per_client"] == cpc)


def test_shards_invalid():
    with pytest.raises(ValueError, match="classes_per_client"):
        shards(Y, 10, classes_per_client=11, seed=0)


# --------------------------------------------------------------------------
# power_law
# --------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["lognormal", "pareto"])
def test_power_law_skewed_and_classes(distribution):
    parts = power_law(Y, 100, seed=0, classes_per_client=2, distribution=distribution, min_size=4)
    _check(parts, M, 100)
    d = describe(parts, Y, K)
    assert np.all(d["classes_per_client"] == 2)
    assert d["min_size"] >= 4
    assert d["max_size"] > 4 * np.median(d["sizes"])  # heavy tail
    assert d["total"] <= M


def test_power_law_clamps_when_supply_is_short():
    y = _imbalanced_labels()  # smallest class has 5 samples
    parts = power_law(y, 10, seed=0, classes_per_client=3, sigma=3.0)
    _check(parts, len(y), 10)
    assert np.all(describe(parts, y, K)["classes_per_client"] == 3)
    with pytest.raises(ValueError, match="min_size"):
        power_law(y, 10, seed=0, classes_per_client=3, min_size=60)


# --------------------------------------------------------------------------
# class_groups
# --------------------------------------------------------------------------


def test_class_groups_halves():
    parts = class_groups(Y, [range(5), range(5, 10)], seed=0)
    _check(parts, M, 2)
    assert set(np.unique(Y[parts[0]])) == set(range(5))
    assert set(np.unique(Y[parts[1]])) == set(range(5, 10))
    assert len(parts[0]) + len(parts[1]) == M
    half = class_groups(Y, [[0, 1], [2]], seed=0, fraction=0.5)
    assert [len(p) for p in half] == [600, 300]
    with pytest.raises(ValueError, match="disjoint"):
        class_groups(Y, [[0, 1], [1, 2]], seed=0)
    with pytest.raises(ValueError, match="no training sample"):
        class_groups(Y, [[0], [42]], seed=0)


# --------------------------------------------------------------------------
# dispatcher validation and describe
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("nope", 10), {}, "unknown partition scheme"),
        (("iid", 0), {}, "num_clients"),
        (("iid", M + 1), {}, "exceeds"),
        (("dirichlet_per_class", 10), {}, "missing required option"),
        (("dirichlet_per_class", 10), {"alpha": 0.0}, "alpha"),
        (("dirichlet_per_class", 10), {"alpha": -1.0}, "alpha"),
        (("iid", 10), {"alpha": 0.5}, "unknown option"),
        (("class_groups", 3), {"groups": [[0], [1]]}, "num_clients"),
    ],
)
def test_dispatcher_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        partition(Y, *args, seed=0, **kwargs)


def test_label_validation():
    with pytest.raises(ValueError, match="integers"):
        partition(Y.astype(np.float32), "dirichlet_per_class", 2, seed=0, alpha=1.0)
    with pytest.raises(ValueError, match="1-D"):
        partition(Y.reshape(-1, 2), "dirichlet_per_class", 2, seed=0, alpha=1.0)
    # iid and nested only count samples: segmentation masks [m, H, W] split like labels [m]
    masks = np.zeros((M, 4, 4), np.int32)
    for p, q in zip(iid(masks, 3, seed=1), iid(Y, 3, seed=1)):
        np.testing.assert_array_equal(p, q)
    with pytest.raises(ValueError, match="non-empty"):
        iid(np.zeros((0, 4, 4)), 2, seed=0)


def test_describe():
    parts = iid(Y, 4, seed=0)
    d = describe(parts, Y, K)
    assert d["num_clients"] == 4 and d["class_hist"].shape == (4, K)
    np.testing.assert_array_equal(d["class_hist"].sum(axis=1), d["sizes"])
    assert d["total"] == M and d["num_unused"] == 0 and d["num_shared"] == 0


# ---------------------------------------------------------------------------
# single_class (FedReg's EMNIST split: many tiny one-class clients)


def test_single_class_tiny_one_class_clients():
    parts = single_class(Y, 200, samples_per_client=24, seed=3)
    _check(parts, M, 200)
    assert {len(p) for p in parts} == {24}
    assert {len(np.unique(Y[p])) for p in parts} == {1}
    per_class = np.bincount([Y[p[0]] for p in parts], minlength=K)
    assert set(per_class) == {20}  # round-robin: N/K clients per class


def test_single_class_uneven_count_and_too_many_clients():
    parts = single_class(Y, 13, samples_per_client=5, seed=0)
    per_class = np.bincount([Y[p[0]] for p in parts], minlength=K)
    assert sorted(per_class) == [1] * 7 + [2] * 3
    with pytest.raises(ValueError, match="fix: lower num_clients"):
        single_class(Y, 300, samples_per_client=24, seed=0)  # 30 clients x 24 > 600 per class
