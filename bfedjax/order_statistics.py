"""Order statistics of large float arrays without a sort (a leaf module: jax only).

XLA:CPU sorts slowly: ``jnp.median`` of a 199,210-parameter vector (the MLP 784-200-200-10) took 51 ms on the
2-core development CPU, a third of a FOLA round at K = 100. ``kth_smallest`` finds the k-th smallest value by
bisecting the bits of an order-preserving integer key: one compare-and-count pass over the array per bit
(32 for float32), 3.2 ms for the same vector (``python -m experiments.bench_reductions``,
``results/bench/reductions.md``), exactly the value the sort would give. Jit and vmap friendly; ``k`` may be
traced.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_KEY_TYPES = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _order_keys(x: jax.Array) -> jax.Array:
    """Unsigned integer keys of a float array whose integer order is the floats' order (``-0.0`` before
    ``+0.0``; positive NaNs after ``+inf``, negative NaNs before ``-inf``), same shape."""
    key_type = _KEY_TYPES[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, key_type)
    sign = key_type(1 << (8 * x.dtype.itemsize - 1))
    return jnp.where(bits & sign, ~bits, bits | sign)


def _from_order_keys(keys: jax.Array, dtype) -> jax.Array:
    """The inverse of ``_order_keys``."""
    sign = keys.dtype.type(1 << (8 * keys.dtype.itemsize - 1))
    return jax.lax.bitcast_convert_type(jnp.where(keys & sign, keys & ~sign, ~keys), dtype)


def _smallest_key(keys: jax.Array, k) -> jax.Array:
    """The k-th smallest (0-based) of the unsigned ``keys [n]``: the largest key v with at most k keys below it,
    built bit by bit from the top."""
    width = 8 * keys.dtype.itemsize

    def next_bit(i, prefix):
        candidate = prefix | (keys.dtype.type(1) << (width - 1 - i).astype(keys.dtype))
        return jnp.where(jnp.sum(keys < candidate) <= k, candidate, prefix)

    return jax.lax.fori_loop(0, width, next_bit, jnp.zeros((), keys.dtype))


def _float_input(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"order statistics take a float array, got {x.dtype}; fix: cast it, e.g. x.astype(jnp.float32)")
    if x.size == 0:
        raise ValueError("order statistics of an empty array; fix: pass at least one value")
    return x.ravel()


def kth_smallest(x: jax.Array, k) -> jax.Array:
    """The ``k``-th smallest entry (0-based, ``0 <= k < x.size``) of the float array ``x`` (any shape,
    flattened): ``jnp.sort(x.ravel())[k]`` without the sort (NaNs last, as ``jnp.sort`` puts them; of equal
    zeros ``-0.0`` counts first, where a sort keeps their order). Returns a scalar of ``x.dtype``."""
    x = _float_input(x)
    if isinstance(k, (int, np.integer)) and not 0 <= k < x.size:
        raise ValueError(f"kth_smallest k={k} of {x.size} values; fix: 0 <= k < {x.size}")
    keys = _order_keys(jnp.where(jnp.isnan(x), jnp.nan, x))  # every NaN as the positive one, sorted last
    return _from_order_keys(_smallest_key(keys, k), x.dtype)


def median(x: jax.Array) -> jax.Array:
    """``jnp.median(x)`` (all entries, flattened; the mean of the two middle values for an even count, NaN if
    any entry is NaN) from ``kth_smallest``: a scalar of ``x.dtype``."""
    x = _float_input(x)
    n = x.size
    keys = _order_keys(x)
    lower = _smallest_key(keys, (n - 1) // 2)
    if n % 2:
        middle = _from_order_keys(lower, x.dtype)
    else:  # the next value up: the same key if it repeats past the middle, else the smallest key above it
        repeats = jnp.sum(keys <= lower) > n // 2
        above = jnp.min(jnp.where(keys > lower, keys, keys.dtype.type(jnp.iinfo(keys.dtype).max)))
        upper = jnp.where(repeats, lower, above)
        middle = (_from_order_keys(lower, x.dtype) + _from_order_keys(upper, x.dtype)) / 2
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.nan, middle).astype(x.dtype)
