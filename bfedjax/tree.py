"""Pytree helpers shared by the engine, the algorithms and the posteriors (a leaf module: jax only).

All functions are pure and jit/vmap friendly. "Stacked" trees carry a leading
client axis ``[C, ...]`` on every leaf.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PyTree = object


def tree_zeros_like(tree: PyTree) -> PyTree:
    """Zeros shaped and typed like every leaf of ``tree``."""
    return jax.tree.map(jnp.zeros_like, tree)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """``a - b`` leaf by leaf."""
    return jax.tree.map(jnp.subtract, a, b)


def tree_dot(a: PyTree, b: PyTree) -> jax.Array:
    """Dot product of two real pytrees flattened together (a scalar)."""
    return sum(leaf_dot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def tree_squared_norm(tree: PyTree) -> jax.Array:
    """``sum`` of every leaf's squares (a scalar): the squared global norm of a real pytree."""
    return sum(leaf_dot(x, x) for x in jax.tree.leaves(tree))


def leaf_dot(x: jax.Array, y: jax.Array) -> jax.Array:
    """``sum(x * y)`` of two real arrays of one shape (a scalar), summed by ``sums_per_row``."""
    if x.shape != y.shape or jnp.iscomplexobj(x) or jnp.iscomplexobj(y):
        raise ValueError(f"leaf_dot takes two real arrays of one shape, got {x.dtype}{list(x.shape)} and "
                         f"{y.dtype}{list(y.shape)}")
    return sums_per_row((x * y)[None], 1)[0]


def sums_per_row(x: jax.Array, rows: int) -> jax.Array:
    """``[rows]``: the sum of ``x [rows, ...]`` over everything but its leading axis, as ``row_sums`` of
    ``x`` reshaped to its last axis (then a short sum over the rest)."""
    if x.size == 0:
        return jnp.zeros((rows,), x.dtype)
    if x.ndim == 1:
        return x
    if x.ndim == 2:
        return row_sums(x)
    return jnp.sum(row_sums(x.reshape(-1, x.shape[-1])).reshape(rows, -1), axis=1)


def zero_products_per_row(x: jax.Array, rows: int) -> jax.Array:
    """``[rows]``: 0 where row ``r`` of ``x [rows, ...]`` is finite, NaN where it holds a NaN or an infinity.

    The row's sum of ``x * 0``, which cannot overflow (``inf * 0`` and ``nan * 0`` are NaN). On a CPU a float32
    ``x`` is multiplied by a vector of zeros (``x [R, N] @ zeros(N)``, kept opaque to XLA's simplifier by an
    optimisation barrier), which reads ``x`` once: ``sums_per_row(x * 0)`` wrote ``x * 0`` out first when ``x``
    came from a loop (a client's message), XLA:CPU not fusing that product into the matrix-vector product
    (``experiments.bench_reductions``: FOLA's round with this check 1.02x the one with ``jnp.isfinite``).
    """
    if x.shape[:1] != (rows,):
        raise ValueError(f"zero_products_per_row: x has leading axis {x.shape[:1]}, expected ({rows},)")
    if x.size == 0:
        return jnp.zeros((rows,), x.dtype)
    if x.ndim == 1 or x.dtype != jnp.float32 or jax.default_backend() != "cpu":
        return sums_per_row(x * 0, rows)
    zeros = jax.lax.optimization_barrier(jnp.zeros((x.shape[-1],), x.dtype))
    return sums_per_row((x.reshape(-1, x.shape[-1]) @ zeros).reshape(rows, -1), rows)


def row_sums(x: jax.Array) -> jax.Array:
    """``x.sum(axis=1)`` of ``x [R, N]``, as ``[R]``.

    On a CPU a float32 ``x`` is summed as the matrix-vector product ``x @ ones(N)``, which XLA usually fuses
    with the elementwise producer of ``x`` (not always: ``zero_products_per_row``). XLA:CPU compiles a long
    sum of a weight gradient (a transposed layout before layout assignment) or of a flag array as a windowed
    tree reduction that reads a few GB/s: with the product FOLA's local MLP step is 1.5-1.8x faster and a DP-SGD step 4.4-4.8x
    (``python -m experiments.bench_reductions``, ``results/bench/reductions.md``). Elsewhere it is ``jnp.sum``.
    """
    if x.dtype == jnp.float32 and jax.default_backend() == "cpu":
        return x @ jnp.ones((x.shape[1],), jnp.float32)
    return jnp.sum(x, axis=1)


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
    """``sum_c weights[c] * stacked[c]`` for every leaf.

    Args:
      stacked: leaves ``[C, ...]``.
      weights: ``[C]``.
    Returns:
      leaves ``[...]``.
    A product at ``HIGHEST`` precision: accelerators' default matmul precision (TF32, bfloat16) would round
    float32 sums.
    """
    return jax.tree.map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1,
                                                precision=jax.lax.Precision.HIGHEST), stacked)


def sum_over_rows(row_terms, num_rows: int) -> PyTree:
    """``sum_c row_terms(c)`` for ``c < num_rows``: ``row_terms`` maps a row index (traced) to a pytree of arrays
    (e.g. ``[P]`` terms computed from row ``c`` of stacked ``[C, P]`` arrays), added up a row at a time.

    For terms computed on the fly (a comparison, a select) this streams: each row is read contiguously, the
    terms never exist as a ``[C, P]`` array and the ``[P]`` sums stay in cache (``jnp.sum(..., axis=0)`` reads
    the rows strided on XLA:CPU). Counting per column the entries of a ``[100, 199210]`` array below a
    threshold took 4.8 ms on the 2-core CPU, against 45.9 ms for ``weighted_sum`` of the materialised mask
    (``python -m experiments.bench_reductions``). For values already in memory ``weighted_sum``'s
    matrix-vector product, which reads them once, is the one to use. Off a CPU, where a loop would launch
    kernels row by row, the terms of every row are computed at once (a vmap) and summed over the rows.
    """
    if jax.default_backend() != "cpu":
        return jax.tree.map(lambda t: jnp.sum(t, axis=0), jax.vmap(row_terms)(jnp.arange(num_rows)))
    return jax.lax.fori_loop(1, num_rows, lambda c, total: jax.tree.map(jnp.add, total, row_terms(c)), row_terms(0))


def tree_stack(trees: list) -> PyTree:
    """Stack a list of identical trees into one tree with a leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


__all__ = ["leaf_dot", "row_sums", "sum_over_rows", "sums_per_row", "tree_dot", "tree_squared_norm", "tree_stack", "tree_sub", "tree_zeros_like", "weighted_sum",
           "zero_products_per_row"]
