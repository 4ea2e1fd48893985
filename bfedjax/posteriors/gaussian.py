"""Diagonal Gaussian posteriors over parameter pytrees.

A ``DiagGaussian`` pairs two pytrees of identical structure: ``mean`` and
``precision`` (inverse variance, elementwise). Stacked posteriors carry a
leading client axis ``[C, ...]`` on every leaf of both.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


class DiagGaussian(NamedTuple):
    """N(mean, diag(1 / precision)) over a parameter pytree."""

    mean: Any
    precision: Any

    @property
    def variance(self):
        return jax.tree.map(lambda p: 1.0 / p, self.precision)

    @property
    def scale(self):
        return jax.tree.map(lambda p: jax.lax.rsqrt(p), self.precision)


def from_scale(mean, scale) -> DiagGaussian:
    """Builds a ``DiagGaussian`` from standard deviations (``scale > 0``)."""
    return DiagGaussian(mean, jax.tree.map(lambda s: 1.0 / jnp.square(s), scale))


def log_density(posterior: DiagGaussian, theta) -> jax.Array:
    """Log N(theta; mean, diag(1/precision)) summed over all coordinates (a scalar)."""

    def leaf(mu, lam, x):
        return 0.5 * jnp.sum(jnp.log(lam) - jnp.log(2 * jnp.pi) - lam * jnp.square(x - mu))

    return sum(jax.tree.leaves(jax.tree.map(leaf, posterior.mean, posterior.precision, theta)))


class DensePrecision(NamedTuple):
    """The full precision ``scale * matrix + diagonal * I`` (``matrix [d, d]``, ``scale`` and ``diagonal``
    scalars, may be traced) over a parameter pytree raveled by ``jax.flatten_util.ravel_pytree`` (FOLA's "full"
    Laplace prior), where the other precisions are pytrees or scalars. The scalars stay apart so that a
    scaled prior (FOLA's running sum over ``r``, its ``gamma``) never writes a second ``d x d`` matrix."""

    matrix: jax.Array
    scale: Any = 1.0
    diagonal: Any = 0.0

    def times(self, vector):
        """``(scale * matrix + diagonal * I) @ vector`` for ``vector [d]``."""
        return self.scale * (self.matrix @ vector) + self.diagonal * vector

    def pull(self, theta, center):
        """The gradient of ``0.5 (theta - center)^T P (theta - center)``: a pytree like ``theta``."""
        flat_theta, unravel = ravel_pytree(theta)
        return unravel(self.times(flat_theta - ravel_pytree(center)[0]))


def broadcast_precision(precision, like):
    """A scalar precision becomes a pytree shaped like ``like``; a pytree passes through."""
    if jax.tree.structure(precision) == jax.tree.structure(like):
        return precision
    return jax.tree.map(lambda _: precision, like)


def quadratic_penalty(theta, center, precision) -> jax.Array:
    """0.5 * sum_i precision_i (theta_i - center_i)^2 over a pytree (the Eq. 15 prior loss).

    ``precision`` may be a pytree like ``theta``, a scalar (FedProx: 1) or a ``DensePrecision``
    (``0.5 (theta - center)^T matrix (theta - center)``).
    """
    if isinstance(precision, DensePrecision):
        diff = ravel_pytree(theta)[0] - ravel_pytree(center)[0]
        return 0.5 * diff @ precision.times(diff)
    precision = broadcast_precision(precision, theta)
    terms = jax.tree.map(lambda t, c, p: jnp.sum(p * jnp.square(t - c)), theta, center, precision)
    return 0.5 * sum(jax.tree.leaves(terms))


# --- scale parameterisation (NumPyro / TFP mean-field layers store rho, sigma = softplus(rho) + eps) ---

FLOAT32_EPS = float(jnp.finfo(jnp.float32).eps)


def rho_to_scale(rho, eps: float = FLOAT32_EPS):
    """sigma = softplus(rho) + eps (TFP's Flipout convention, Fischer et al. 2.2)."""
    return jax.nn.softplus(rho) + eps


def softplus_inverse(x):
    """log(expm1(x)) computed stably: x + log(-expm1(-x)) (exact for large x, no overflow)."""
    x = jnp.asarray(x)
    return x + jnp.log(-jnp.expm1(-x))


def scale_to_rho(scale, eps: float = FLOAT32_EPS, scale_min: float = 1e-6):
    """Inverse of ``rho_to_scale`` with sigma floored at ``scale_min`` (an aggregated scale can underflow).

    Returns ``(rho, floor_hits)``; ``floor_hits`` counts the coordinates that were floored.
    """
    floored = jnp.maximum(scale, scale_min)
    hits = jnp.sum(scale < scale_min)
    return softplus_inverse(jnp.maximum(floored - eps, scale_min * 1e-3)), hits


def from_variance(mean, variance) -> DiagGaussian:
    return DiagGaussian(mean, jax.tree.map(lambda v: 1.0 / v, variance))


def kl_divergence(q: DiagGaussian, p: DiagGaussian) -> jax.Array:
    """KL[q || p] summed over every coordinate of the pytrees (a scalar).

    sum_i log(sigma_p / sigma_q) + (sigma_q^2 + (mu_q - mu_p)^2) / (2 sigma_p^2) - 1/2
    """

    def leaf(mq, lq, mp, lp):
        return jnp.sum(0.5 * (jnp.log(lq) - jnp.log(lp)) + 0.5 * lp * (1.0 / lq + jnp.square(mq - mp)) - 0.5)

    return sum(jax.tree.leaves(jax.tree.map(leaf, q.mean, q.precision, p.mean, p.precision)))
