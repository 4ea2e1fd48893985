"""Small pytree helpers used across the engine and the algorithms.

All functions are pure and jit/vmap friendly. "Stacked" trees carry a leading
client axis ``[C, ...]`` on every leaf.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PyTree = object


def tree_where(pred, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leafwise ``jnp.where(pred, a, b)`` with a scalar predicate."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def tree_zeros_like(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.add, a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.subtract, a, b)


def tree_scale(tree: PyTree, s) -> PyTree:
    return jax.tree.map(lambda x: x * s, tree)


def tree_dot(a: PyTree, b: PyTree) -> jax.Array:
    """Sum over all leaves of the elementwise product (a scalar)."""
    leaves = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.vdot(x, y), a, b))
    return sum(leaves, jnp.zeros((), jnp.float32))


def tree_sq_norm(tree: PyTree) -> jax.Array:
    return tree_dot(tree, tree)


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
    """``sum_c weights[c] * stacked[c]`` for every leaf.

    Args:
      stacked: leaves ``[C, ...]``.
      weights: ``[C]``.
    Returns:
      leaves ``[...]``.
    """
    return jax.tree.map(lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked)


def tree_stack(trees: list) -> PyTree:
    """Stack a list of identical trees into one tree with a leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def tree_index(stacked: PyTree, i) -> PyTree:
    return jax.tree.map(lambda x: x[i], stacked)


def tree_size(tree: PyTree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))
