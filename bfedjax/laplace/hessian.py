"""Exact Hessians of a client's cross-entropy, for FOLA's full and e-full Laplace approximations (Sec. IV-E).

The parameters are raveled with ``jax.flatten_util.ravel_pytree`` (the leaves of ``jax.tree.leaves`` in order,
each row-major); ``d`` is their number and every Hessian here is a ``[d, d]`` matrix in that order. That is
``4 d^2`` bytes in float32, so these are for small models: the paper's 784-10 softmax regression has
``d = 7,850`` (246 MB). ``jax.hessian`` pushes ``d`` tangents through the gradient, about ``d`` times a
gradient's work.

``batch_hessian``     the Hessian of one batch's summed cross-entropy (forward-over-reverse ``jax.hessian``;
                      exact for any model, not a Gauss-Newton or Fisher stand-in)
``offline_hessian``   the Hessian of the client's mean cross-entropy at fixed weights (one ordered pass)
``eigenvalue_diagonal``  the paper's "e-full": the full Hessian's eigenvalues placed on a diagonal
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from bfedjax.core.batching import ordered_pass
from bfedjax.core.types import Batch, ClientData
from bfedjax.losses import cross_entropy

EIGEN_ORDERS = ("diagonal_rank", "solver")


def batch_hessian(apply_fn: Callable, params, batch: Batch) -> jax.Array:
    """``[d, d]``: the Hessian of ``sum_i mask_i CE(apply_fn(params, x_i), y_i)`` over the batch's rows,
    with respect to the raveled ``params`` (padding rows, ``mask = 0``, add nothing)."""
    flat, unravel = ravel_pytree(params)

    def summed_loss(theta):
        return jnp.sum(cross_entropy(apply_fn(unravel(theta), batch.x), batch.y) * batch.mask)

    return jax.hessian(summed_loss)(flat)


def offline_hessian(apply_fn: Callable, params, data: ClientData, batch_size: int) -> jax.Array:
    """``[d, d]``: the Hessian of the client's mean cross-entropy over its ``data.count`` real samples at
    ``params`` (one ordered pass of ``batch_size`` batches; FOLA's "offline" evaluation of the full Laplace)."""
    flat = ravel_pytree(params)[0]
    total = ordered_pass(lambda h, batch: h + batch_hessian(apply_fn, params, batch),
                         jnp.zeros((flat.size, flat.size), flat.dtype), data, batch_size)
    return total / jnp.maximum(data.count.astype(flat.dtype), 1.0)


def eigenvalue_diagonal(hessian: jax.Array, order: str = "diagonal_rank") -> jax.Array:
    """``[d]``: the eigenvalues of the symmetric ``hessian [d, d]`` as a diagonal precision (FOLA's "e-full").

    The paper does not say which eigenvalue goes to which coordinate (spec D24). ``"diagonal_rank"`` (the
    spec's default) gives the coordinate with the ``k``-th largest ``hessian[i, i]`` the ``k``-th largest
    eigenvalue, so the spectrum keeps the diagonal's ranking; ``"solver"`` leaves them in the solver's
    (ascending) order, coordinate ``i`` getting the ``i``-th smallest. Negative eigenvalues (rounding
    around a positive semi-definite Hessian's zeros, or a non-convex model's curvature) become 0: a
    precision is not negative.
    """
    if order not in EIGEN_ORDERS:
        raise ValueError(f"eigen_order={order!r}; choose one of {EIGEN_ORDERS}")
    eigenvalues = jnp.maximum(jnp.linalg.eigvalsh(0.5 * (hessian + hessian.T)), 0.0)  # ascending
    if order == "solver":
        return eigenvalues
    rank = jnp.argsort(jnp.argsort(jnp.diagonal(hessian)))  # coordinate i's position in the ascending diagonal
    return eigenvalues[rank]
