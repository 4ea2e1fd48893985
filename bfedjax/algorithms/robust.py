"""Robust aggregation as a layer on any algorithm (``with_robust_aggregation``).

The layer works on the clients' ``message["params"]`` (the local model, or a
posterior's mean) and then hands the messages to the algorithm's own
aggregation, so it composes with every method whose aggregation leaves a
cohort of identical models unchanged (FedAvg, FedProx, FOLA's product, SCAFFOLD,
HBFL's product, ...):

* ``"median"`` / ``"trimmed_mean"``: every real client's ``params`` is replaced by the
  coordinate-wise median / trimmed mean of the cohort's (``posteriors.robust``); the
  algorithm then aggregates identical models, so the result is that statistic
  (a posterior method keeps its own precisions).
* ``"krum"`` / ``"multi_krum"``: the cohort mask keeps only the selected client (Krum) or
  the ``k - f`` selected ones (multi-Krum), with the weights renormalised over them.
* ``"robust_product"`` (posterior methods whose message holds ``"params"`` and
  ``"precision"``, e.g. FOLA): every real client's message becomes the trimmed, capped
  product of the cohort's Gaussians, so the algorithm's own product returns it.
* ``"mean"``: the algorithm's aggregation unchanged (with ``max_update_norm`` alone).

``max_update_norm`` first bounds every client's update ``params - global`` in L2
norm (norm bounding, Sun et al. 2019), before any rule. The layer needs the
whole cohort, so a streamed aggregation becomes a stacked one (chunks still
train in chunks). Server metrics: ``robust_kept`` (clients that count after
Krum) and ``robust_bounded`` (clients whose update was shortened).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.core.types import COHORT_WEIGHT, Algorithm, require_message_keys
from bfedjax.posteriors.gaussian import DiagGaussian
from bfedjax.posteriors.robust import (bound_update_norms, coordinate_median, krum_selection, robust_product,
                                       trimmed_mean)

ROBUST_RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "robust_product")


def _broadcast_to_real(value, stacked, mask):
    """``stacked`` with every real slot replaced by ``value`` (leaves ``[...]`` into ``[C, ...]``)."""
    real = jnp.asarray(mask) > 0
    return jax.tree.map(lambda v, s: jnp.where(real.reshape((-1,) + (1,) * v.ndim), v[None], s), value, stacked)


def with_robust_aggregation(algorithm: Algorithm, rule: str = "median", *, trim: float = 0.2,
                            byzantine_fraction: float = 0.2, max_update_norm: float | None = None,
                            precision_cap: float | None = None) -> Algorithm:
    """``algorithm`` with a robust aggregation ``rule`` (see the module docstring).

    Args:
      rule: one of ``ROBUST_RULES``.
      trim: fraction dropped at each end by ``trimmed_mean`` and ``robust_product`` (``[0, 0.5)``).
      byzantine_fraction: the share ``f / k`` of attackers Krum assumes (``f = floor(fraction k)``).
      max_update_norm: bound on each client's update norm (``None``: no bound).
      precision_cap: ``robust_product``'s cap on a precision, in multiples of the median one.
    """
    if rule not in ROBUST_RULES:
        raise ValueError(f"robust aggregation rule {rule!r}; choose one of {', '.join(ROBUST_RULES)}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim={trim} must be in [0, 0.5), e.g. 0.2")
    if not 0.0 <= byzantine_fraction < 1.0:
        raise ValueError(f"byzantine_fraction={byzantine_fraction} must be in [0, 1), e.g. 0.2")
    if max_update_norm is not None and max_update_norm <= 0:
        raise ValueError(f"max_update_norm={max_update_norm} must be > 0 (or None for no bound)")

    def server_update(server, messages, weights, mask, hparams, key):
        if not isinstance(messages, dict) or "params" not in messages:
            raise ValueError(f"robust aggregation works on messages with a 'params' entry; {algorithm.name} sends "
                             f"{type(messages).__name__}; fix: use it with an algorithm that sends its model")
        params, metrics = messages["params"], {}
        if max_update_norm is not None:
            params, norms = bound_update_norms(params, algorithm.global_params(server), mask, max_update_norm)
            metrics["robust_bounded"] = jnp.sum((norms > max_update_norm) & (mask > 0)).astype(jnp.float32)
        k = jnp.sum(mask > 0)
        if rule == "median":
            params = _broadcast_to_real(coordinate_median(params, mask), params, mask)
        elif rule == "trimmed_mean":
            params = _broadcast_to_real(trimmed_mean(params, mask, trim), params, mask)
        elif rule in ("krum", "multi_krum"):
            f = jnp.floor(byzantine_fraction * k).astype(jnp.int32)
            selected = krum_selection(params, mask, f, 1 if rule == "krum" else k.astype(jnp.int32) - f)
            mask = mask * selected
            weights = jnp.where(selected > 0, weights, 0.0)
            total = jnp.sum(weights)
            weights = jnp.where(total > 0, weights / jnp.maximum(total, 1e-30), selected / jnp.maximum(
                jnp.sum(selected), 1.0))
            metrics["robust_kept"] = jnp.sum(selected)
            if COHORT_WEIGHT in hparams:  # the clients Krum leaves out count as absent (FOLA's fixed_pi)
                hparams = {**hparams, COHORT_WEIGHT: hparams[COHORT_WEIGHT] * total}
        messages = {**messages, "params": params}
        if rule == "robust_product":
            require_message_keys(messages, ("params", "precision"), "robust_product",
                                 "Gaussian messages ('params' and 'precision')", algorithm.name,
                                 "use median or trimmed_mean")
            product = robust_product(DiagGaussian(params, messages["precision"]), weights, mask, trim=trim,
                                     precision_cap=precision_cap)
            messages = {**messages, "params": _broadcast_to_real(product.mean, params, mask),
                        "precision": _broadcast_to_real(product.precision, messages["precision"], mask)}
        server, inner_metrics = algorithm.aggregate(server, messages, weights, mask, hparams, key)
        return server, {**inner_metrics, **metrics}

    return algorithm.replace(name=f"{algorithm.name}+{rule}", server_update=server_update, client_stats=None,
                             server_from_stats=None)


__all__ = ["ROBUST_RULES", "with_robust_aggregation"]
