"""Client weightings of Fischer et al. (section 2.6, Eqs. 18-21).

Each returns weights ``[C]`` that are positive, finite and sum to one.
Clients with ``mask == 0`` (padding) get weight zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.posteriors.gaussian import DiagGaussian, kl_divergence

KL_FLOOR = 1e-12
WEIGHTINGS = ("uniform", "by_size", "max_discrepancy", "max_discrepancy_literal", "max_discrepancy_symmetric",
              "distance", "distance_reversed")


def _normalise(gamma, mask):
    gamma = jnp.where(mask > 0, gamma, 0.0)
    return gamma / jnp.sum(gamma)


def uniform(num_clients: int, mask=None):
    """Eq. 18 ("equal"): 1/K over the K real clients."""
    mask = jnp.ones(num_clients) if mask is None else mask
    return _normalise(jnp.ones(num_clients), mask)


def by_size(counts, mask=None):
    """Eq. 19 ("train size"): ``|D_k| / |D|``."""
    counts = jnp.asarray(counts, jnp.float32)
    return _normalise(counts, jnp.ones_like(counts) if mask is None else mask)


def pairwise_kl(stacked: DiagGaussian) -> jax.Array:
    """``[C, C]`` matrix of KL[q_i || q_j] summed over all coordinates."""
    one = lambda i, j: kl_divergence(jax.tree.map(lambda x: x[i], stacked), jax.tree.map(lambda x: x[j], stacked))
    c = jax.tree.leaves(stacked.mean)[0].shape[0]
    idx = jnp.arange(c)
    return jax.vmap(lambda i: jax.vmap(lambda j: one(i, j))(idx))(idx)


def max_discrepancy(stacked: DiagGaussian, mask=None, literal: bool = False, symmetric: bool = False):
    """Eq. 20 (Koliander et al.).

    Default (the spec's reading): gamma_k = 1 / max_{j != k} KL[q_k || q_j] (floored), so
    clients far from the others weigh less. ``literal=True``: the equation as
    printed with j != k, gamma_k = max_{j != k} 1 / KL[q_k || q_j]. ``symmetric=True``:
    the symmetric KL[q_k || q_j] + KL[q_j || q_k] in place of KL[q_k || q_j] (spec D15).
    """
    kl = pairwise_kl(stacked)
    if symmetric:
        kl = kl + kl.T
    c = kl.shape[0]
    mask = jnp.ones(c) if mask is None else mask
    others = (1.0 - jnp.eye(c)) * mask[None, :]
    if literal:
        inv = jnp.where(others > 0, 1.0 / jnp.maximum(kl, KL_FLOOR), -jnp.inf)
        gamma = jnp.max(inv, axis=1)
        gamma = jnp.where(jnp.isfinite(gamma), gamma, 1.0)  # a lone client
    else:
        worst = jnp.max(jnp.where(others > 0, kl, 0.0), axis=1)
        gamma = 1.0 / jnp.maximum(worst, KL_FLOOR)
    return _normalise(gamma, mask)


def distance(stacked: DiagGaussian, global_posterior: DiagGaussian, mask=None, reverse: bool = False):
    """Eq. 21: gamma_k = 1 / KL[q_g || q_k] with q_g the previous global posterior (floored);
    ``reverse=True``: 1 / KL[q_k || q_g] (spec D16)."""
    if reverse:
        kl = jax.vmap(lambda q: kl_divergence(q, global_posterior))(stacked)
    else:
        kl = jax.vmap(lambda q: kl_divergence(global_posterior, q))(stacked)
    mask = jnp.ones_like(kl) if mask is None else mask
    return _normalise(1.0 / jnp.maximum(kl, KL_FLOOR), mask)
