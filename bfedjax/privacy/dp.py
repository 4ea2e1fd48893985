"""DP-SGD (Abadi et al. 2016) for any local trainer, and its privacy accounting.

One private step on a masked batch of ``n`` real examples:

    g_b  = grad of example b's cross-entropy                  (vmap over the batch)
    g~   = (sum_b g_b * min(1, C / ||g_b||) + N(0, sigma^2 C^2 I)) / n

(as the FedReg authors run it: noise on the clipped sum at every local step,
divided by the batch's real size; a regulariser's gradient, e.g. FedProx's, is added
after, un-noised). ``sigma`` is the noise multiplier, ``C`` the clip norm.

Privacy spent is computed by Google's ``dp_accounting`` RDP accountant,
treating each local step as a Poisson-subsampled Gaussian mechanism with
rate ``B / n_client`` (the usual approximation for shuffled batches) and
composing over every step a client's data sees in the whole run.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from bfedjax import flat_random
from bfedjax.core.types import Batch
from bfedjax.laplace.fisher import per_example_grads
from bfedjax.optional import require
from bfedjax.tree import sums_per_row, weighted_sum

RDP_ORDERS = tuple(range(2, 257))  # integer Renyi orders (fractional ones need a slow, noisy series)


def clip_per_example(grads, clip_norm: float):
    """Scales every example's gradient to global norm at most ``clip_norm``.

    Args:
      grads: pytree with leaves ``[B, ...]`` (one gradient per example).
    Returns:
      ``(clipped grads [B, ...], norms before clipping [B])``.
    """
    norms = per_example_norms(grads)
    factor = clip_factors(norms, clip_norm)
    return jax.tree.map(lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), grads), norms


def per_example_norms(grads) -> jax.Array:
    """``[B]``: the global norm of each example's gradient (leaves ``[B, ...]``), summed with
    ``tree.sums_per_row`` (matrix-vector products on a CPU, not XLA:CPU's slow tree reduction)."""
    return jnp.sqrt(sum(sums_per_row(jnp.square(g), g.shape[0]) for g in jax.tree.leaves(grads)))


def clip_factors(norms: jax.Array, clip_norm: float) -> jax.Array:
    """``[B]``: ``min(1, C / ||g_b||)``, the factor that clips each example's gradient to norm ``C``."""
    return jnp.minimum(1.0, clip_norm / jnp.maximum(norms, 1e-30))


def gaussian_like(tree, key: jax.Array, std) -> object:
    """Independent ``N(0, std^2)`` noise shaped like every leaf of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([std * flat_random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def private_gradient(apply_fn: Callable, params, batch: Batch, key: jax.Array, *, clip_norm: float,
                     noise_multiplier: float):
    """``(loss, noisy clipped mean gradient)`` of one masked batch (padded rows contribute nothing).

    Args:
      apply_fn: ``(params, x [B, ...]) -> logits [B, K]``.
      batch: ``Batch`` with ``x [B, ...]``, ``y [B]``, ``mask [B]``.
      key: noise key of this step.
    """
    losses, grads = per_example_grads(apply_fn, params, batch)
    factor = clip_factors(per_example_norms(grads), clip_norm)
    n = jnp.maximum(jnp.sum(batch.mask), 1.0)
    # the clipped sum as one product [B] x [B, ...] (tree.weighted_sum): scaling and then summing over B read
    # the per-example gradients twice (with the norms' sums_per_row, an MLP's DP-SGD step is 4.4x faster
    # on a CPU: results/bench/reductions.md)
    total = weighted_sum(grads, factor)
    if noise_multiplier:
        noise = gaussian_like(total, key, noise_multiplier * clip_norm)
        total = jax.tree.map(jnp.add, total, noise)
    return jnp.sum(losses * batch.mask) / n, jax.tree.map(lambda g: g / n, total)


def dp_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    """epsilon of ``steps`` compositions of the Poisson-subsampled Gaussian (RDP accountant).

    Returns ``inf`` for zero noise.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must be in (0, 1), e.g. 1e-5")
    if noise_multiplier <= 0:
        return math.inf
    if steps <= 0:
        return 0.0
    dp_accounting = require("dp_accounting")
    from dp_accounting import rdp
    accountant = rdp.RdpAccountant(orders=RDP_ORDERS)
    event = dp_accounting.PoissonSampledDpEvent(min(1.0, sampling_rate), dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(event, int(steps))
    return float(accountant.get_epsilon(delta))


def client_epsilon(noise_multiplier: float, *, batch_size: int, client_size: int, local_epochs: int,
                   participations: float, delta: float) -> float:
    """Sample-level epsilon of one client's data after ``participations`` rounds of local DP-SGD.

    Every participation runs ``local_epochs * ceil(client_size / batch_size)``
    private steps at sampling rate ``min(1, batch_size / client_size)``.
    """
    steps = int(math.ceil(participations)) * local_epochs * math.ceil(client_size / batch_size)
    return dp_epsilon(noise_multiplier, batch_size / max(client_size, 1), steps, delta)
