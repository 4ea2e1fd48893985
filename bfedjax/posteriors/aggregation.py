"""Aggregation rules over stacked diagonal-Gaussian posteriors.

Every rule is a pure function of client posteriors stacked on a leading axis
``[C, ...]`` and client weights ``[C]`` (non-negative; the engine passes
weights summing to one over the cohort, zero for padding clients). Algorithms
call these rules; they never re-implement them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.core.tree import weighted_sum
from bfedjax.posteriors.gaussian import DiagGaussian


def weighted_mean(stacked_params, weights: jax.Array):
    """FedAvg (FOLA Eq. 6): ``sum_c w_c * theta_c``; leaves ``[C, ...]`` -> ``[...]``."""
    return weighted_sum(stacked_params, weights)


def gaussian_product_stats(posterior: DiagGaussian):
    """Per-client sufficient statistics of the product: ``(precision * mean, precision)``."""
    return (jax.tree.map(jnp.multiply, posterior.precision, posterior.mean), posterior.precision)


def gaussian_product_from_stats(summed_stats, eps: float = 0.0) -> DiagGaussian:
    """The product from ``sum_c w_c * gaussian_product_stats(posterior_c)``."""
    weighted_means, precision = summed_stats
    mean = jax.tree.map(lambda num, prec: num / (prec + eps), weighted_means, precision)
    return DiagGaussian(mean, precision)


def gaussian_product(stacked: DiagGaussian, weights: jax.Array, eps: float = 0.0) -> DiagGaussian:
    """Product of client Gaussians raised to powers ``w_c`` (FOLA Eqs. 11-12, diagonal form).

    precision_S = sum_c w_c * precision_c
    mean_S      = sum_c w_c * precision_c * mean_c / (precision_S + eps)

    ``eps`` (the FOLA authors use 1e-5) acts like an extra zero-mean prior of
    precision ``eps`` and guards coordinates no client has information about.

    Args:
      stacked: ``DiagGaussian`` with leaves ``[C, ...]``.
      weights: ``[C]`` powers pi_c.
    Returns:
      ``DiagGaussian`` with leaves ``[...]``.
    """
    stats = jax.vmap(gaussian_product_stats)(stacked)
    return gaussian_product_from_stats(weighted_sum(stats, weights), eps)


def moment_matched_mixture(stacked: DiagGaussian, weights: jax.Array) -> DiagGaussian:
    """Moment-matched collapse of the mixture ``sum_c w_c N(mean_c, 1/precision_c)`` (FOLA Eqs. 5-7, diagonal).

    mean = sum_c w_c mean_c
    var  = sum_c w_c (1/precision_c + mean_c^2) - mean^2
    Weights are normalised to sum to one first.
    """
    w = weights / jnp.sum(weights)
    mean = weighted_sum(stacked.mean, w)
    second = jax.tree.map(lambda m, p: 1.0 / p + jnp.square(m), stacked.mean, stacked.precision)
    var = jax.tree.map(lambda s, m: weighted_sum(s, w) - jnp.square(m), second, mean)
    return DiagGaussian(mean, jax.tree.map(lambda v: 1.0 / v, var))
