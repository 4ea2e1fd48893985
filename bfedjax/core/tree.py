"""Small pytree helpers used across the engine and the algorithms.

All functions are pure and jit/vmap friendly. "Stacked" trees carry a leading
client axis ``[C, ...]`` on every leaf.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PyTree = object




def tree_zeros_like(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)




def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(jnp.subtract, a, b)








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
