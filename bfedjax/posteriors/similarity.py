"""How alike the clients' precisions are: FOLA Fig. 11a's cosine similarity of normalised precision matrices.

FOLA (Sec. IV-E, Figs. 10a and 11a) normalises a precision matrix Sigma^-1 by subtracting its smallest
entry and dividing by its largest, vectorises the d x d matrix and compares two clients by the cosine of
the two vectors. The division does not change a cosine; the shift does. A diagonal precision is the
d x d matrix diag(p): its off-diagonal zeros take part in the shift (its smallest entry is
min(0, min p)) and in the sums, which are formed without building the matrix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _gram_of_shifted(vectors: jax.Array, off_diagonal: int) -> jax.Array:
    """``[K, K]`` inner products of the K vectorised, min-shifted matrices.

    ``vectors [K, n]``: with ``off_diagonal = 0`` each row is a whole vectorised matrix; otherwise each row
    is the diagonal of a diagonal matrix with ``off_diagonal`` zero entries besides it.
    """
    smallest = jnp.min(vectors, axis=1)
    if off_diagonal:
        smallest = jnp.minimum(smallest, 0.0)
    shifted = vectors - smallest[:, None]
    gram = shifted @ shifted.T
    if off_diagonal:  # every off-diagonal zero became -min
        gram = gram + off_diagonal * jnp.outer(smallest, smallest)
    return gram


def precision_cosines(precisions, num_params: int) -> jax.Array:
    """``[K, K]`` cosine similarities of K clients' normalised precision matrices (FOLA Fig. 11a).

    Args:
      precisions: stacked over clients: either one ``[K, d, d]`` array (full precision matrices) or a pytree
        of ``[K, ...]`` leaves holding ``num_params = d`` diagonal entries per client.
      num_params: d, the model's parameter count (tells the two forms apart).
    Returns ``[K, K]``; NaN where a client's shifted matrix is all zeros (a constant matrix).
    """
    leaves = jax.tree.leaves(precisions)
    k = leaves[0].shape[0]
    per_client = sum(leaf[0].size for leaf in leaves)
    if len(leaves) == 1 and leaves[0].shape[1:] == (num_params, num_params):
        gram = _gram_of_shifted(leaves[0].reshape(k, -1), 0)
    elif per_client == num_params:
        gram = _gram_of_shifted(jnp.concatenate([leaf.reshape(k, -1) for leaf in leaves], axis=1),
                                num_params * num_params - num_params)
    else:
        raise ValueError(f"precisions hold {per_client} numbers per client; a model of {num_params} parameters has "
                         f"{num_params} (diagonal) or a [{num_params}, {num_params}] matrix (full)")
    norms = jnp.sqrt(jnp.diagonal(gram))
    denominator = jnp.outer(norms, norms)
    return jnp.where(denominator > 0, gram / jnp.where(denominator > 0, denominator, 1.0), jnp.nan)


def mean_pairwise_precision_cosine(precisions, num_params: int, mask: jax.Array) -> jax.Array:
    """``[]``: the mean of ``precision_cosines`` over the pairs of real clients (``mask [K] > 0``); with two
    clients, Fig. 11a's value. NaN with fewer than two real clients."""
    cosines = precision_cosines(precisions, num_params)
    real = mask > 0
    pairs = real[:, None] & real[None, :] & jnp.triu(jnp.ones(cosines.shape, bool), 1)
    count = jnp.sum(pairs)
    return jnp.where(count > 0, jnp.sum(jnp.where(pairs, cosines, 0.0)) / jnp.maximum(count, 1), jnp.nan)


__all__ = ["mean_pairwise_precision_cosine", "precision_cosines"]
