"""Seeded, pure partitioners of a training set across federated clients.

Every partitioner takes the training label vector ``labels [m]`` and returns
``list[np.ndarray]``: one sorted int64 index array per client, each non-empty,
indexing into the training set. All randomness comes from
``np.random.default_rng(seed)``: the same arguments always give the same
output and the global numpy RNG is never touched.

Schemes (see :data:`PARTITIONERS` and :func:`partition`):

* ``iid``                   shuffled, near-equal sizes.
* ``dirichlet_per_class``   each class split across clients by ``Dir(alpha)``
                            (FOLA authors' code; sizes vary).
* ``dirichlet_per_client``  each client draws class proportions ``Dir(alpha p)``
                            (paper / FedMA / Hsu et al. form; equal sizes).
* ``dirichlet_niid_bench``  each class split by ``Dir(alpha)`` over the clients still
                            below ``m / N`` samples (NIID-Bench, Li et al. 2022;
                            Fischer et al.'s sampler; sizes near ``m / N``).
* ``shards``                sort by label, cut into single-class shards, each
                            client gets ``classes_per_client`` distinct classes.
* ``power_law``             heavy-tailed client sizes, ``classes_per_client``
                            classes per client (FedProx style).
* ``class_groups``          client ``k`` holds all samples of ``groups[k]``.

Only ``dirichlet_per_class`` with ``empty_rule="fallback_sample"`` can give a
sample to two clients (documented there); all other schemes are disjoint.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "PARTITIONERS",
    "class_groups",
    "describe",
    "dirichlet_niid_bench",
    "dirichlet_per_class",
    "dirichlet_per_client",
    "iid",
    "partition",
    "power_law",
    "shards",
]


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------


def _check_labels(labels) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {y.shape}; fix: pass y_train of shape [m]")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}; fix: pass class ids, e.g. y.astype(np.int64)")
    if y.min() < 0:
        raise ValueError(f"labels must be >= 0, got min {y.min()}; fix: map classes to 0..K-1")
    return y.astype(np.int64)


def _num_samples(labels) -> int:
    """``m`` for partitioners that only use the number of samples (``labels [m, ...]``: class ids or masks)."""
    y = np.asarray(labels)
    if y.ndim == 0 or len(y) == 0:
        raise ValueError(f"labels must be a non-empty array [m, ...], got shape {y.shape}; fix: pass y_train")
    return len(y)


def _check_clients(num_clients, m: int) -> int:
    if not isinstance(num_clients, numbers.Integral) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}; fix: pass e.g. num_clients=10")
    if num_clients > m:
        raise ValueError(f"num_clients={num_clients} exceeds the {m} training samples; fix: use at most {m} clients "
                         "or more data (a larger max_train)")
    return int(num_clients)


def _check_positive(name: str, value) -> float:
    if not isinstance(value, numbers.Real) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}; fix: pass e.g. {name}=0.5")
    return float(value)


def _check_int(name: str, value, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}; fix: pass e.g. {name}={max(lo, 1)}")
    return int(value)


def _dirichlet_arguments(labels, num_clients, alpha, min_size, max_tries):
    """The checked ``(labels, num_clients, alpha, min_size, max_tries)`` of a per-class Dirichlet split."""
    y = _check_labels(labels)
    return (y, _check_clients(num_clients, len(y)), _check_positive("alpha", alpha), _check_int("min_size", min_size, 1),
            _check_int("max_tries", max_tries, 1))


def _class_pools(y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Present classes and, per class, its indices in a seeded random order."""
    classes = np.unique(y)
    return classes, [rng.permutation(np.flatnonzero(y == c)) for c in classes]


def _finish(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, np.int64)) for p in parts]


# --------------------------------------------------------------------------
# Partitioners
# --------------------------------------------------------------------------


def iid(labels: np.ndarray, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Uniformly shuffled split; client sizes differ by at most one.

    Args:
      labels: ``[m, ...]`` class ids or segmentation masks (only ``m`` is used).
      num_clients: ``N``, ``1 <= N <= m``.
      seed: RNG seed.

    Returns:
      ``N`` sorted int64 index arrays partitioning ``range(m)``.
    """
    m = _num_samples(labels)
    n = _check_clients(num_clients, m)
    perm = np.random.default_rng(seed).permutation(m)
    return _finish(np.array_split(perm, n))


def nested(labels: np.ndarray, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """FedRef's partition (the authors' code): every client holds the same seeded permutation of ``range(m)``.

    Train with ``simulate(..., round_fractions=(0.5, 0.6, 0.7, 0.8, 0.9))``: each round
    each client takes the first ``f * m`` indices of the permutation, ``f`` drawn afresh,
    so the clients' subsets are nested, overlapping and label-IID. Unlike the other
    partitioners the arrays are in permutation order (not sorted) and not disjoint.

    Args:
      labels: ``[m, ...]`` class ids or masks (only ``m`` is used).
      num_clients: ``N >= 1``.
      seed: RNG seed of the permutation.

    Returns:
      ``N`` copies of one int64 permutation of ``range(m)``.
    """
    m = _num_samples(labels)
    if not isinstance(num_clients, numbers.Integral) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}; fix: pass e.g. num_clients=10")
    perm = np.random.default_rng(seed).permutation(m).astype(np.int64)
    return [perm.copy() for _ in range(int(num_clients))]


_EMPTY_RULES = ("fallback_sample", "resample")


def _class_proportions(rng: np.random.Generator, num_clients: int, num_classes: int, alpha: float) -> np.ndarray:
    """``P [N, K]``: every column ``P[:, c] ~ Dir(alpha * 1_N)`` (a NaN column from a tiny alpha goes to one client)."""
    prop = rng.dirichlet(np.full(num_clients, alpha), size=num_classes).T
    bad = ~np.isfinite(prop).all(axis=0)  # guard against NaN columns (old numpy, tiny alpha)
    for c in np.flatnonzero(bad):
        prop[:, c] = np.eye(num_clients)[rng.integers(num_clients)]
    return prop


def _split_pools(pools: Sequence[np.ndarray], prop: np.ndarray) -> list[np.ndarray]:
    """Clients ``i = 0..N-1`` in order take the next ``floor(|I_c| * P[i, c])`` indices of each class pool."""
    sizes_c = np.array([len(p) for p in pools])
    counts = np.floor(sizes_c[None, :] * prop).astype(np.int64)  # [N, K]
    ends = np.cumsum(counts, axis=0)
    starts = ends - counts
    return [np.concatenate([pools[c][starts[i, c]: ends[i, c]] for c in range(len(pools))])
            for i in range(prop.shape[0])]


def dirichlet_per_class(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 1,
    empty_rule: str = "fallback_sample",
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Per-class Dirichlet split (the FOLA authors' code form).

    Rule: the indices of each class ``c`` form a list ``I_c`` (shuffled with
    the seed; the authors' code keeps data order, we shuffle within class so
    the split is random but reproducible). Draw ``P [N, K]`` with every column
    ``P[:, c] ~ Dir(alpha * 1_N)``. With one pointer per class, clients
    ``i = 0..N-1`` in order take, for each class, the next
    ``floor(|I_c| * P[i, c])`` indices of ``I_c``. The few samples lost to the
    floors are left unused. Small ``alpha`` puts each class on few clients.

    Tiny clients (fewer than ``min_size`` samples):

    * ``empty_rule="fallback_sample"`` (default, the authors' rule): the
      client is topped up to ``min_size`` with the first indices of ``I_0``
      (the lowest class label, in its shuffled order) it does not already
      hold. With ``min_size=1`` an empty client gets exactly one sample, the
      first index of class 0. Such samples usually also belong to another
      client, so the partition may then *overlap* (a few shared indices).
    * ``empty_rule="resample"``: redraw ``P`` (up to ``max_tries`` times)
      until every client has ``>= min_size`` samples, else raise ValueError.
      The output is then disjoint.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      alpha: Dirichlet concentration, ``> 0``.
      seed: RNG seed.
      min_size: smallest allowed client size, ``>= 1``.
      empty_rule: ``"fallback_sample"`` or ``"resample"``.
      max_tries: draws of ``P`` allowed by ``"resample"``.

    Returns:
      ``N`` sorted int64 index arrays, each with ``>= min_size`` entries.
    """
    y, n, alpha, min_size, max_tries = _dirichlet_arguments(labels, num_clients, alpha, min_size, max_tries)
    if empty_rule not in _EMPTY_RULES:
        raise ValueError(f"empty_rule must be one of {_EMPTY_RULES}, got {empty_rule!r}; fix: pass one of those")
    if min_size > len(y):
        raise ValueError(f"min_size={min_size} exceeds the {len(y)} samples; fix: lower min_size")
    if min_size * n > len(y) and empty_rule == "resample":
        raise ValueError(f"min_size={min_size} x {n} clients exceeds the {len(y)} samples; fix: lower min_size or num_clients")
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)

    def draw() -> list[np.ndarray]:
        return _split_pools(pools, _class_proportions(rng, n, len(classes), alpha))

    for _ in range(max_tries if empty_rule == "resample" else 1):
        parts = draw()
        if min(len(p) for p in parts) >= min_size:
            return _finish(parts)
    if empty_rule == "resample":
        raise ValueError(
            f"dirichlet_per_class: no draw in {max_tries} gave all {n} clients >= {min_size} samples "
            f"(alpha={alpha}); fix: raise alpha, lower num_clients/min_size, or use empty_rule='fallback_sample'"
        )
    fallback = pools[0]
    out = []
    for p in parts:
        if len(p) < min_size:
            extra = fallback[~np.isin(fallback, p)][: min_size - len(p)]
            if len(p) + len(extra) < min_size:  # class 0 too small: use any other samples
                rest = np.setdiff1d(np.concatenate(pools), np.concatenate([p, extra]))
                extra = np.concatenate([extra, rest[: min_size - len(p) - len(extra)]])
            p = np.concatenate([p, extra])
        out.append(p)
    return _finish(out)


def dirichlet_niid_bench(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """NIID-Bench's label-Dirichlet split (Li et al., ICDE 2022; the sampler Fischer et al. cite).

    Rule, for the classes in increasing order: shuffle the class's indices (seeded),
    draw ``p ~ Dir(alpha * 1_N)`` over the ``N`` clients, set ``p_k = 0`` for every
    client that already holds ``>= m / N`` samples (from the classes before), renormalise,
    and cut the class at the floored cumulative proportions (NIID-Bench's cuts, with a 1e-6 tolerance
    for float error), so every sample goes to a client.
    The whole draw repeats until every client holds ``>= min_size`` samples (at most
    ``max_tries`` times, else ValueError). The cap keeps the sizes near ``m / N``, unlike
    ``dirichlet_per_class``; clients are disjoint and their union is the training set.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      alpha: Dirichlet concentration, ``> 0``.
      seed: RNG seed.
      min_size: smallest allowed client size (NIID-Bench: 10).
      max_tries: whole draws allowed.

    Returns:
      ``N`` sorted int64 index arrays, each with ``>= min_size`` entries.
    """
    y, n, alpha, min_size, max_tries = _dirichlet_arguments(labels, num_clients, alpha, min_size, max_tries)
    if min_size * n > len(y):
        raise ValueError(f"min_size={min_size} x {n} clients exceeds the {len(y)} samples; fix: lower min_size or "
                         "num_clients")
    rng = np.random.default_rng(seed)
    cap = len(y) / n

    def draw() -> list[np.ndarray] | None:
        parts = [[] for _ in range(n)]
        sizes = np.zeros(n, np.int64)
        for pool in _class_pools(y, rng)[1]:  # every draw reshuffles the classes, as NIID-Bench's code
            p = rng.dirichlet(np.full(n, alpha)) * (sizes < cap)
            if not np.isfinite(p).all() or p.sum() <= 0:  # all the mass on full clients (or underflow): redraw
                return None
            # floored as NIID-Bench's code, with a 1e-6 tolerance: a cumulative sum that float error leaves
            # just below 1 would otherwise hand a full last client one sample
            cuts = np.floor(np.cumsum(p / p.sum()) * len(pool) + 1e-6).astype(np.int64)[:-1]
            for k, piece in enumerate(np.split(pool, cuts)):
                parts[k].append(piece)
                sizes[k] += len(piece)
        return [np.concatenate(ps) for ps in parts]

    for _ in range(max_tries):
        parts = draw()
        if parts is not None and min(len(p) for p in parts) >= min_size:
            return _finish(parts)
    raise ValueError(f"dirichlet_niid_bench: no draw in {max_tries} gave all {n} clients >= {min_size} samples "
                     f"(alpha={alpha}); fix: raise alpha, or lower num_clients or min_size")


def dirichlet_train_test(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 1,
    max_tries: int = 1000,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-class Dirichlet split of the training **and** the test set with the same proportions.

    For every class ``c``, ``p_c ~ Dir(alpha * 1_N)`` over clients splits class
    ``c``'s training images and its test images alike (``dirichlet_per_class``'s
    rule on each set), so each client's test split has its own label mix (HBFL
    spec Decision 10, as FML and HBFL evaluate their clients). ``P`` is redrawn
    until every client holds ``>= min_size`` training samples; both outputs are
    disjoint. Clients may get an empty test split at small ``alpha``.

    Returns:
      ``(train_parts, test_parts)``: ``N`` sorted index arrays into each label set.
    """
    y, y_test = _check_labels(train_labels), _check_labels(test_labels)
    n = _check_clients(num_clients, len(y))
    alpha = _check_positive("alpha", alpha)
    min_size = _check_int("min_size", min_size, 1)
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)
    test_pools = [rng.permutation(np.flatnonzero(y_test == c)) for c in classes]
    for _ in range(_check_int("max_tries", max_tries, 1)):
        prop = _class_proportions(rng, n, len(classes), alpha)
        train = _split_pools(pools, prop)
        if min(len(p) for p in train) >= min_size:
            return _finish(train), [np.sort(p) for p in _split_pools(test_pools, prop)]
    raise ValueError(f"dirichlet_train_test: no draw in {max_tries} gave all {n} clients >= {min_size} training "
                     f"samples (alpha={alpha}); fix: raise alpha or lower num_clients / min_size")


def dirichlet_per_client(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    seed: int,
    sizes: Sequence[int] | None = None,
    balanced: bool = False,
    rounds: int = 20,
) -> list[np.ndarray]:
    """Per-client Dirichlet split (the paper / FedMA / Hsu et al. form).

    Rule: client ``n`` draws class proportions ``q_n ~ Dir(alpha * p)`` with
    ``p`` uniform over the ``K`` present classes, i.e. concentration
    ``alpha / K`` per class (Hsu et al.'s convention: ``alpha = K`` is a flat
    Dirichlet, ``alpha -> 0`` one class per client). Client sizes are equal, ``m // N`` each (or
    ``sizes``). A client draws its samples without replacement as a
    multinomial over classes with weights ``q_n``; when a class runs out it
    is dropped and ``q_n`` is renormalised over the classes that still have
    samples (if ``q_n`` is zero on all of those, the remaining classes are
    weighted by how many samples they still have). Hence all sizes are met
    exactly, but clients served after a class is exhausted deviate from
    ``q_n``.

    Order of service:

    * ``balanced=False``: clients are filled one after the other (order
      ``0..N-1``), so exhaustion only affects later clients.
    * ``balanced=True``: clients are filled in ``rounds`` interleaved rounds,
      in a fresh random order each round, each taking about
      ``size / rounds`` samples per round, so exhaustion is shared evenly.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      alpha: total Dirichlet concentration ``> 0`` (``alpha / K`` per class).
      seed: RNG seed.
      sizes: optional ``N`` client sizes (each ``>= 1``, sum ``<= m``).
      balanced: interleave the clients' draws (see above).
      rounds: number of interleaved rounds when ``balanced``.

    Returns:
      ``N`` disjoint sorted int64 index arrays with the requested sizes.
    """
    y = _check_labels(labels)
    n = _check_clients(num_clients, len(y))
    alpha = _check_positive("alpha", alpha)
    rounds = _check_int("rounds", rounds, 1)
    if sizes is None:
        sizes = np.full(n, len(y) // n, np.int64)
    else:
        sizes = np.asarray(sizes)
        if sizes.shape != (n,) or not np.issubdtype(sizes.dtype, np.integer) or sizes.min() < 1:
            raise ValueError(f"sizes must be {n} integers >= 1, got {sizes!r}; fix: pass one size per client")
        if sizes.sum() > len(y):
            raise ValueError(f"sizes sum to {sizes.sum()} > {len(y)} samples; fix: shrink sizes")
        sizes = sizes.astype(np.int64)
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)
    k = len(classes)
    q = rng.dirichlet(np.full(k, alpha / k), size=n)  # [N, K]; Dir(alpha * p), p = 1/K
    q = np.where(np.isfinite(q), q, 0.0)
    left = np.array([len(p) for p in pools], np.int64)  # samples remaining per class
    ptr = np.zeros(k, np.int64)
    taken = [[] for _ in range(n)]

    def serve(i: int, need: int) -> None:
        while need > 0:
            avail = left > 0
            w = q[i] * avail
            if w.sum() <= 0:
                w = left.astype(np.float64)
            want = rng.multinomial(need, w / w.sum())
            got = np.minimum(want, left)
            for c in np.flatnonzero(got):
                taken[i].append(pools[c][ptr[c] : ptr[c] + got[c]])
            ptr[:] += got
            left[:] -= got
            need -= int(got.sum())

    if not balanced:
        for i in range(n):
            serve(i, int(sizes[i]))
    else:
        done = np.zeros(n, np.int64)
        for r in range(rounds):
            for i in rng.permutation(n):
                target = (sizes[i] * (r + 1)) // rounds  # cumulative share after round r
                serve(int(i), int(target - done[i]))
                done[i] = target
    return _finish([np.concatenate(t) if t else np.zeros(0, np.int64) for t in taken])


def _allocate(total: int, weights: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integers ``a`` with ``lo <= a <= hi``, ``sum(a) == total``, ``a ~ weights``.

    Largest-remainder rounding, then one-at-a-time fixes within the bounds.
    Caller guarantees ``sum(lo) <= total <= sum(hi)``.
    """
    exact = total * weights / weights.sum()
    a = np.clip(np.floor(exact).astype(np.int64), lo, hi)
    while a.sum() != total:
        gap = exact - a
        if a.sum() < total:
            gap = np.where(a < hi, gap, -np.inf)
            a[np.argmax(gap)] += 1
        else:
            gap = np.where(a > lo, gap, np.inf)
            a[np.argmin(gap)] -= 1
    return a


def shards(
    labels: np.ndarray,
    num_clients: int,
    *,
    classes_per_client: int = 2,
    seed: int,
    max_repairs: int | None = None,
) -> list[np.ndarray]:
    """Label-sorted shards; every client gets ``classes_per_client`` distinct classes.

    Rule (McMahan et al.'s shards, made class-pure as in Fischer et al.'s
    2-class split): with ``S = N * classes_per_client`` shards, class ``c``
    receives ``s_c`` shards proportional to its size (largest remainder; at
    least 1 and at most ``min(N, n_c)`` when ``S >= K``; if ``S < K`` only
    ``S`` randomly chosen classes get one shard each and the other classes
    are left out). Each class's indices (shuffled with the seed, i.e. "sorted
    by label") are cut into ``s_c`` near-equal contiguous shards, so every
    shard holds one class. Shards are dealt at random, ``classes_per_client``
    per client, then clashes (a client holding two shards of one class) are
    repaired by random swaps between clients; if the repair stalls, a
    round-robin deal over class-sorted shards (always clash-free because no
    class has more than ``N`` shards) is used. For 10 classes, 10 clients and
    2 classes per client this is exactly 20 half-class shards, two distinct
    classes per client.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      classes_per_client: shards (= distinct classes) per client,
        ``1 <= classes_per_client <= K``.
      seed: RNG seed.
      max_repairs: swap attempts for the clash repair; None means
        ``4 * N * classes_per_client + 100`` (each success removes a clash).

    Returns:
      ``N`` disjoint sorted int64 index arrays; client ``i`` holds exactly
      ``classes_per_client`` distinct labels.
    """
    y = _check_labels(labels)
    n = _check_clients(num_clients, len(y))
    cpc = _check_int("classes_per_client", classes_per_client, 1)
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)
    k = len(classes)
    if cpc > k:
        raise ValueError(f"classes_per_client={cpc} exceeds the {k} classes present; fix: lower classes_per_client")
    total = n * cpc
    counts = np.array([len(p) for p in pools])
    hi = np.minimum(n, counts)
    if total > hi.sum():
        raise ValueError(
            f"cannot cut {total} single-class shards with <= {n} per class from class sizes {counts.tolist()}; "
            "fix: lower num_clients or classes_per_client"
        )
    if total >= k:
        per_class = _allocate(total, counts.astype(np.float64), np.ones(k, np.int64), hi)
    else:
        per_class = np.zeros(k, np.int64)
        per_class[rng.choice(k, size=total, replace=False)] = 1
    shard_idx: list[np.ndarray] = []
    shard_cls: list[int] = []
    for c in rng.permutation(k):  # random class order for the fallback deal
        for piece in np.array_split(pools[c], per_class[c]) if per_class[c] else []:
            shard_idx.append(piece)
            shard_cls.append(int(c))
    cls = np.asarray(shard_cls)

    assign = rng.permutation(total).reshape(n, cpc)  # [N, cpc] shard ids

    def clashes(row: np.ndarray) -> bool:
        return len(set(cls[row].tolist())) < cpc

    max_repairs = 4 * total + 100 if max_repairs is None else _check_int("max_repairs", max_repairs, 0)
    bad = [i for i in range(n) if clashes(assign[i])]
    repairs = 0
    while bad and repairs < max_repairs:
        # Swap a duplicate shard of row i with shard (j, t) of another row when
        # that fixes row i and adds no clash to row j (strictly fewer clashes).
        repairs += 1
        i = bad[rng.integers(len(bad))]
        row = cls[assign[i]]
        dup = next(p for p in range(1, cpc) if (row[p] == row[:p]).any())
        keep_i = set(np.delete(row, dup).tolist())
        cands = []
        for j in rng.permutation(n)[:64]:  # bounded random search
            if j == i:
                continue
            for t in range(cpc):
                keep_j = set(np.delete(cls[assign[j]], t).tolist())
                if cls[assign[j, t]] not in keep_i and row[dup] not in keep_j:
                    cands.append((int(j), t))
        if cands:
            j, t = cands[rng.integers(len(cands))]
            assign[i, dup], assign[j, t] = assign[j, t], assign[i, dup]
            bad = [r for r in range(n) if clashes(assign[r])]
    if bad:  # deterministic fallback: round-robin over class-sorted shards
        deal = np.arange(total).reshape(cpc, n).T  # client i gets shards i, i+N, ...
        assign = deal[rng.permutation(n)]
    return _finish([np.concatenate([shard_idx[s] for s in row]) for row in assign])


_SIZE_DISTS = ("lognormal", "pareto")


def power_law(
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    classes_per_client: int = 2,
    distribution: str = "lognormal",
    sigma: float = 2.0,
    exponent: float = 1.5,
    min_size: int = 2,
    fraction: float = 1.0,
) -> list[np.ndarray]:
    """Heavy-tailed client sizes, each client holding few classes (FedProx style).

    Rule:

    1. Classes: with a seeded random class order ``pi``, client slot ``i``
       gets classes ``pi[(i*cpc + j) mod K]`` for ``j < cpc``
       (``cpc = classes_per_client``; FedProx gives client ``i`` digits ``i``
       and ``i+1``); slots are then shuffled over clients. Every class is used
       by about ``N*cpc/K`` clients.
    2. Size weights ``w_i``: ``LogNormal(0, sigma)`` (FedProx's data scripts)
       or ``Pareto(exponent)`` (``numpy pareto + 1``, a true power-law tail).
    3. Every (client, class) pair first gets ``b = ceil(min_size / cpc)``
       samples. The remaining budget ``fraction*m - N*cpc*b`` is split over
       clients in proportion to ``w_i`` and evenly over each client's
       classes (largest-remainder rounding).
    4. Clamp: where a class's demand exceeds its supply, that class's extra
       demands are scaled down proportionally (floor) to fit, so big clients
       shrink but keep their classes; leftover samples stay unused.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      seed: RNG seed.
      classes_per_client: distinct classes per client, ``<= K``.
      distribution: ``"lognormal"`` or ``"pareto"``.
      sigma: log-normal shape (bigger = more skew).
      exponent: Pareto tail index ``a > 0`` (smaller = more skew).
      min_size: minimum client size, ``>= 1``.
      fraction: share of the training set to hand out, ``(0, 1]``.

    Returns:
      ``N`` disjoint sorted int64 index arrays; client ``i`` holds exactly
      ``classes_per_client`` distinct labels and ``>= min_size`` samples.
    """
    y = _check_labels(labels)
    n = _check_clients(num_clients, len(y))
    cpc = _check_int("classes_per_client", classes_per_client, 1)
    min_size = _check_int("min_size", min_size, 1)
    if distribution not in _SIZE_DISTS:
        raise ValueError(f"distribution must be one of {_SIZE_DISTS}, got {distribution!r}; fix: pass one of those")
    sigma = _check_positive("sigma", sigma)
    exponent = _check_positive("exponent", exponent)
    fraction = _check_positive("fraction", fraction)
    if fraction > 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}; fix: pass e.g. fraction=0.5")
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)
    k = len(classes)
    if cpc > k:
        raise ValueError(f"classes_per_client={cpc} exceeds the {k} classes present; fix: lower classes_per_client")
    supply = np.array([len(p) for p in pools], np.int64)

    order = rng.permutation(k)
    slots = np.array([[order[(i * cpc + j) % k] for j in range(cpc)] for i in range(n)])
    client_cls = slots[rng.permutation(n)]  # [N, cpc] class positions

    base = -(-min_size // cpc)
    users = np.bincount(client_cls.ravel(), minlength=k)
    if (users * base > supply).any():
        c = int(np.argmax(users * base - supply))
        raise ValueError(
            f"class {classes[c]} has {supply[c]} samples but {users[c]} clients need >= {base} each; "
            "fix: lower num_clients or min_size"
        )
    if distribution == "lognormal":
        w = rng.lognormal(0.0, sigma, size=n)
    else:
        w = rng.pareto(exponent, size=n) + 1.0
    budget = max(0, int(fraction * len(y)) - n * cpc * base)
    extra_client = _allocate(budget, w, np.zeros(n, np.int64), np.full(n, budget, np.int64))
    extra = np.zeros((n, cpc), np.int64)  # [N, cpc]
    for i in range(n):
        extra[i] = _allocate(int(extra_client[i]), np.ones(cpc), np.zeros(cpc, np.int64), np.full(cpc, extra_client[i]))
    for c in range(k):  # clamp classes whose demand exceeds supply
        mask = client_cls == c
        room = supply[c] - users[c] * base
        want = extra[mask].sum()
        if want > room:
            extra[mask] = np.floor(extra[mask] * (room / want)).astype(np.int64)
    demand = base + extra
    ptr = np.zeros(k, np.int64)
    parts = []
    for i in range(n):
        pieces = []
        for j in range(cpc):
            c = client_cls[i, j]
            pieces.append(pools[c][ptr[c] : ptr[c] + demand[i, j]])
            ptr[c] += demand[i, j]
        parts.append(np.concatenate(pieces))
    return _finish(parts)


def single_class(
    labels: np.ndarray,
    num_clients: int,
    *,
    seed: int,
    samples_per_client: int,
) -> list[np.ndarray]:
    """Many tiny clients, each holding ``samples_per_client`` images of one class (EMNIST style).

    The FedReg paper's EMNIST split: 10,000 clients x 24 images of one digit.
    Rule: with a seeded class order ``pi``, client ``i`` gets class
    ``pi[i mod K]`` (classes are used round-robin, so every class has
    ``N/K`` clients up to one) and the next ``samples_per_client`` samples of
    that class's seeded shuffle; leftover samples stay unused.

    Args:
      labels: ``[m]`` integer class ids.
      num_clients: ``N``.
      seed: RNG seed.
      samples_per_client: images per client, ``>= 1``.

    Returns:
      ``N`` disjoint sorted int64 index arrays of equal size, one label each.
    """
    y = _check_labels(labels)
    n = _check_clients(num_clients, len(y))
    size = _check_int("samples_per_client", samples_per_client, 1)
    rng = np.random.default_rng(seed)
    classes, pools = _class_pools(y, rng)
    order = rng.permutation(len(classes))
    client_cls = order[np.arange(n) % len(classes)]
    users = np.bincount(client_cls, minlength=len(classes))
    for c in range(len(classes)):
        if users[c] * size > len(pools[c]):
            fits = sum(min(users[k], len(pools[k]) // size) for k in range(len(classes)))
            most = min(len(pools[k]) // users[k] for k in range(len(classes)) if users[k])
            fix = (f"lower num_clients (about {fits} fit) or samples_per_client" if fits
                   else f"lower samples_per_client to at most {most}")
            raise ValueError(f"class {classes[c]} has {len(pools[c])} samples but {users[c]} clients x {size} are "
                             f"needed; fix: {fix}")
    taken = np.zeros(len(classes), np.int64)
    parts = []
    for c in client_cls:
        parts.append(pools[c][taken[c]:taken[c] + size])
        taken[c] += size
    return _finish(parts)


def class_groups(
    labels: np.ndarray,
    groups: Sequence[Sequence[int]],
    *,
    seed: int,
    fraction: float = 1.0,
) -> list[np.ndarray]:
    """Client ``k`` holds the samples whose label is in ``groups[k]``.

    E.g. ``groups=[[0,1,2,3,4],[5,6,7,8,9]]`` is the FOLA paper's two-client
    experiment. With ``fraction < 1`` each client keeps a seeded random
    ``round(fraction * n_c)`` (at least 1) samples of each of its classes.

    Args:
      labels: ``[m]`` integer class ids.
      groups: one non-empty collection of class ids per client; groups must
        be disjoint and each must match at least one sample.
      seed: RNG seed (only used when ``fraction < 1``).
      fraction: share of each class to keep, ``(0, 1]``.

    Returns:
      ``len(groups)`` disjoint sorted int64 index arrays.
    """
    y = _check_labels(labels)
    fraction = _check_positive("fraction", fraction)
    if fraction > 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}; fix: pass e.g. fraction=0.5")
    if isinstance(groups, (str, bytes)) or len(groups) == 0:
        raise ValueError("groups must be a non-empty list of class-id lists; fix: pass e.g. [[0,1,2,3,4],[5,6,7,8,9]]")
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    parts = []
    for g, group in enumerate(groups):
        ids = [int(c) for c in np.atleast_1d(np.asarray(group))]
        if not ids or seen.intersection(ids):
            raise ValueError(f"groups[{g}]={list(ids)} is empty or overlaps an earlier group; fix: give disjoint class lists")
        seen.update(ids)
        pieces = []
        for c in ids:
            idx = np.flatnonzero(y == c)
            if fraction < 1 and len(idx):
                idx = rng.choice(idx, size=max(1, int(round(fraction * len(idx)))), replace=False)
            pieces.append(idx)
        part = np.concatenate(pieces)
        if part.size == 0:
            raise ValueError(f"groups[{g}]={ids} matches no training sample; fix: use labels present in the data")
        parts.append(part)
    return _finish(parts)


# --------------------------------------------------------------------------
# Dispatcher and summary
# --------------------------------------------------------------------------

PARTITIONERS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "nested": nested,
    "dirichlet_per_class": dirichlet_per_class,
    "dirichlet_per_client": dirichlet_per_client,
    "dirichlet_niid_bench": dirichlet_niid_bench,
    "shards": shards,
    "power_law": power_law,
    "single_class": single_class,
    "class_groups": class_groups,
}


def partition(labels: np.ndarray, scheme: str, num_clients: int, *, seed: int, **kwargs) -> list[np.ndarray]:
    """Runs the partitioner named ``scheme`` (a key of :data:`PARTITIONERS`).

    Args:
      labels: ``[m]`` integer class ids.
      scheme: partitioner name.
      num_clients: ``N`` (for ``class_groups`` it must equal ``len(groups)``).
      seed: RNG seed.
      **kwargs: scheme options, e.g. ``alpha=0.1`` or ``classes_per_client=2``.

    Returns:
      ``N`` sorted int64 index arrays (see the partitioner).

    Raises:
      ValueError: unknown scheme, unknown/missing option or invalid value.
    """
    if scheme not in PARTITIONERS:
        raise ValueError(f"unknown partition scheme {scheme!r}; fix: use one of {', '.join(PARTITIONERS)}")
    fn = PARTITIONERS[scheme]
    params = inspect.signature(fn).parameters
    options = [p for p in params if p not in ("labels", "num_clients", "seed")]
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise ValueError(f"{scheme}: unknown option(s) {unknown}; fix: pass only its options {options}")
    missing = [
        p for p in options
        if params[p].default is inspect.Parameter.empty and p not in kwargs
    ]
    if missing:
        raise ValueError(f"{scheme}: missing required option(s) {missing}; fix: pass them, e.g. alpha=0.5 or "
                         "groups=[[0,1],[2,3]]")
    if scheme == "class_groups":
        if num_clients != len(kwargs["groups"]):
            raise ValueError(f"class_groups: num_clients={num_clients} but {len(kwargs['groups'])} groups; fix: make them equal")
        return fn(labels, seed=seed, **kwargs)
    return fn(labels, num_clients, seed=seed, **kwargs)


def describe(parts: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> dict:
    """Summary statistics of a partition.

    Args:
      parts: ``N`` index arrays.
      labels: ``[m]`` integer class ids.
      num_classes: ``K``.

    Returns:
      dict with ``num_clients`` (int), ``sizes`` ``[N]`` int64,
      ``class_hist`` ``[N, K]`` int64 (samples per client and class),
      ``classes_per_client`` ``[N]`` (non-zero classes), ``total``,
      ``min_size``, ``max_size``, ``mean_size``, ``num_unused`` (training
      samples on no client) and ``num_shared`` (samples on >1 client).
    """
    y = _check_labels(labels)
    hist = np.stack([np.bincount(y[p], minlength=num_classes)[:num_classes] for p in parts]).astype(np.int64)
    sizes = np.array([len(p) for p in parts], np.int64)
    cover = np.bincount(np.concatenate(list(parts)).astype(np.int64), minlength=len(y)) if len(parts) else np.zeros(len(y))
    return {
        "num_clients": len(parts),
        "sizes": sizes,
        "class_hist": hist,
        "classes_per_client": (hist > 0).sum(axis=1),
        "total": int(sizes.sum()),
        "min_size": int(sizes.min()),
        "max_size": int(sizes.max()),
        "mean_size": float(sizes.mean()),
        "num_unused": int((cover == 0).sum()),
        "num_shared": int((cover > 1).sum()),
    }
