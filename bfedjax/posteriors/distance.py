"""A model's distance to a known global posterior: FOLA's measure of aggregation error and local forgetting.

FOLA (Sec. IV-E, "Correlations between Measures and Problems") takes a Gaussian global posterior
``N(mu*, Sigma*)`` as known (from a converged full-Laplace run) and scores any model ``theta`` by its negative
log density up to a constant,

    D(theta, theta*) = 1/2 (theta - mu*)^T Lambda* (theta - mu*),      Lambda* = Sigma*^-1.

The aggregation error (AE) of a round is ``D`` of the server's aggregate, its local forgetting (LF) the
``pi_n``-weighted sum of ``D`` over the clients' trained models (``algorithms.posterior_analysis``). FOLA's
``algorithms.reference_posterior`` makes the ``ReferencePosterior`` of a run's server state.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax

from bfedjax.posteriors.gaussian import DensePrecision, quadratic_penalty


class ReferencePosterior(NamedTuple):
    """The known global posterior ``N(mean, precision^-1)`` of FOLA's distance.

    ``mean`` is a parameter pytree (the model's shapes), theta*; ``precision`` a pytree like ``mean`` (a
    diagonal Laplace) or a ``DensePrecision`` whose ``[d, d]`` matrix is over the parameters raveled by
    ``jax.flatten_util.ravel_pytree`` (a full Laplace).
    """

    mean: Any
    precision: Any


def posterior_distance(params, reference: ReferencePosterior) -> jax.Array:
    """``[]``: ``D(params, theta*) = 1/2 (theta - mean)^T precision (theta - mean)`` for a parameter pytree
    ``params`` of the reference model's structure (``gaussian.quadratic_penalty``)."""
    if jax.tree.structure(params) != jax.tree.structure(reference.mean):
        raise ValueError("the model's parameters and the reference posterior's mean differ in structure; fix: a "
                         "reference of the same model (e.g. algorithms.reference_posterior of its run)")
    precision = reference.precision
    if not isinstance(precision, DensePrecision) and jax.tree.structure(precision) != jax.tree.structure(params):
        raise ValueError("the reference precision is neither a pytree like the parameters nor a DensePrecision; "
                         "fix: ReferencePosterior(mean, precision) with precision of the mean's structure")
    return quadratic_penalty(params, reference.mean, precision)


__all__ = ["ReferencePosterior", "posterior_distance"]
