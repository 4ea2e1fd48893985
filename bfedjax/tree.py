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
    """Dot product of two pytrees flattened together (a scalar)."""
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


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


__all__ = ["tree_dot", "tree_stack", "tree_sub", "tree_zeros_like", "weighted_sum"]
