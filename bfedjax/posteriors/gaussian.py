"""Diagonal Gaussian posteriors over parameter pytrees.

A ``DiagGaussian`` pairs two pytrees of identical structure: ``mean`` and
``precision`` (inverse variance, elementwise). Stacked posteriors carry a
leading client axis ``[C, ...]`` on every leaf of both.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


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


def quadratic_penalty(theta, center, precision) -> jax.Array:
    """0.5 * sum_i precision_i (theta_i - center_i)^2 over a pytree (the Eq. 15 prior loss).

    ``precision`` may be a pytree like ``theta`` or a scalar (FedProx: 1).
    """
    if jax.tree.structure(precision) != jax.tree.structure(theta):
        precision = jax.tree.map(lambda _: precision, theta)
    terms = jax.tree.map(lambda t, c, p: jnp.sum(p * jnp.square(t - c)), theta, center, precision)
    return 0.5 * sum(jax.tree.leaves(terms))
