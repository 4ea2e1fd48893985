"""Byzantine-robust aggregation rules over stacked client parameters and posteriors.

Like the rules of ``aggregation``, each is a pure function of client values
stacked on a leading axis ``[C, ...]`` (a pytree) and the cohort mask ``[C]``
(1 real client, 0 padding or a client left out, e.g. for non-finite values):
masked slots never count, whatever they hold, as long as it is finite.

* ``coordinate_median`` (Yin et al. 2018): per coordinate, the median over the real clients.
* ``trimmed_mean`` (Yin et al. 2018): per coordinate, drop the ``floor(trim k)`` largest and
  smallest of the ``k`` real values and average the rest.
* ``krum_selection`` (Blanchard et al. 2017): score every real client by the summed squared
  distances to its ``k - f - 2`` nearest real neighbours and keep the ``m`` lowest scores
  (``m = 1``: Krum; ``m = k - f``: multi-Krum).
* ``bound_update_norms`` (Sun et al. 2019): scale each client's update ``theta_c - theta_g``
  to L2 norm at most ``max_norm`` (norm over the whole pytree).
* ``robust_product``: a trimmed and capped Gaussian product for posterior methods (FOLA,
  HBFL, the Fischer et al. product). The product is a precision-weighted mean, so one client
  moves it as far as it likes by a far-off mean (sign-flipped, scaled or noise updates) and
  weighs as much as it likes by a large precision. Per coordinate the rule therefore (1) drops
  the clients whose means are among the ``floor(trim k)`` largest or smallest, as the trimmed
  mean does, and (2) caps every precision at ``precision_cap`` times the median precision over
  the real clients, so no client speaks for more than that many typical clients. The rest is
  the ordinary product with the client weights renormalised over the kept clients, so with
  ``trim = 0`` and no cap it equals ``aggregation.gaussian_product``.

Unweighted rules (median, trimmed mean, Krum) treat every real client alike, as in their
papers: a client's data size gives it no extra say when it may be lying about it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.order_statistics import column_kept_ranks, column_median, column_trimmed_mean
from bfedjax.posteriors.gaussian import DiagGaussian
from bfedjax.tree import sum_over_rows


def coordinate_median(stacked, mask: jax.Array):
    """Per-coordinate median over the real clients; leaves ``[C, ...]`` -> ``[...]``
    (the mean of the two middle values for an even count)."""
    mask = jnp.asarray(mask)
    return jax.tree.map(lambda x: column_median(x, mask), stacked)  # no sort (order_statistics)


def trimmed_count(k: jax.Array, trim: float) -> jax.Array:
    """How many values ``trimmed_mean`` drops at each end of ``k``: ``floor(trim k)``, leaving at least one."""
    return jnp.minimum(jnp.floor(trim * k).astype(jnp.int32), (k - 1) // 2)


def trimmed_mean(stacked, mask: jax.Array, trim: float):
    """Per-coordinate mean of the real values after dropping the ``floor(trim k)`` largest and smallest.

    ``trim`` in ``[0, 0.5)``; ``trim = 0`` is the plain mean over real clients. Leaves ``[C, ...]`` -> ``[...]``.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim={trim} must be in [0, 0.5), e.g. 0.2")
    mask = jnp.asarray(mask)
    drop = trimmed_count(jnp.sum(mask > 0).astype(jnp.int32), trim)
    return jax.tree.map(lambda x: column_trimmed_mean(x, mask, drop), stacked)  # no sort (order_statistics)


def pairwise_sq_distances(stacked) -> jax.Array:
    """``[C, C]`` squared L2 distances between the clients' flattened pytrees (through Gram matrices)."""
    total = 0.0
    for x in jax.tree.leaves(stacked):
        flat = jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32)
        norms = jnp.sum(flat * flat, axis=1)
        total = total + norms[:, None] + norms[None, :] - 2.0 * flat @ flat.T
    return jnp.maximum(total, 0.0)


def krum_scores(stacked, mask: jax.Array, num_byzantine: jax.Array | int) -> jax.Array:
    """``[C]`` Krum scores: each real client's summed squared distance to its ``k - f - 2`` nearest
    real neighbours (at least one); masked slots score ``+inf``."""
    mask = jnp.asarray(mask) > 0
    c = mask.shape[0]
    k = jnp.sum(mask).astype(jnp.int32)
    neighbours = jnp.maximum(k - jnp.asarray(num_byzantine, jnp.int32) - 2, 1)
    d = pairwise_sq_distances(stacked)
    d = jnp.where(mask[None, :] & ~jnp.eye(c, dtype=bool), d, jnp.inf)
    closest = jnp.sort(d, axis=1)
    counted = jnp.arange(c)[None, :] < neighbours
    scores = jnp.sum(jnp.where(counted, closest, 0.0), axis=1)
    return jnp.where(mask, scores, jnp.inf)


def krum_selection(stacked, mask: jax.Array, num_byzantine: jax.Array | int,
                   num_selected: jax.Array | int = 1) -> jax.Array:
    """``[C]`` float mask of the ``num_selected`` real clients with the lowest Krum scores
    (ties broken by slot order); ``num_selected`` is clipped to the real count."""
    scores = krum_scores(stacked, mask, num_byzantine)
    k = jnp.sum(jnp.asarray(mask) > 0).astype(jnp.int32)
    rank = jnp.argsort(jnp.argsort(scores, stable=True), stable=True)
    return ((rank < jnp.minimum(jnp.asarray(num_selected, jnp.int32), k)) & (jnp.asarray(mask) > 0)).astype(
        jnp.float32)


def bound_update_norms(stacked, reference, mask: jax.Array, max_norm: float):
    """Clients' values with each update ``theta_c - reference`` scaled to L2 norm ``<= max_norm``.

    ``stacked`` leaves ``[C, ...]``, ``reference`` leaves ``[...]`` (the global model). Returns
    ``(bounded stacked values, [C] norms before bounding)``; masked slots pass through unchanged.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be > 0")
    updates = jax.tree.map(lambda x, r: x - r[None], stacked, reference)
    norms = jnp.sqrt(sum(jnp.sum(jnp.reshape(u, (u.shape[0], -1)) ** 2, axis=1) for u in jax.tree.leaves(updates)))
    factor = jnp.where(jnp.asarray(mask) > 0, jnp.minimum(1.0, max_norm / jnp.maximum(norms, 1e-30)), 1.0)
    bounded = jax.tree.map(lambda u, r: r[None] + u * factor.reshape((-1,) + (1,) * (u.ndim - 1)), updates, reference)
    return bounded, norms


def robust_product(stacked: DiagGaussian, weights: jax.Array, mask: jax.Array, *, trim: float = 0.2,
                   precision_cap: float | None = None, eps: float = 0.0) -> DiagGaussian:
    """The trimmed, capped product of client Gaussians (see the module docstring).

    Per coordinate: clients whose means rank among the ``floor(trim k)`` largest or smallest of the
    ``k`` real ones are left out; each precision is capped at ``precision_cap *`` the median real
    precision (``None``: no cap); the kept clients' weights ``w_c`` are renormalised to sum to one, and

        precision = sum_kept w_c lambda_c,    mean = sum_kept w_c lambda_c mu_c / (precision + eps)

    (where ``precision + eps`` is 0, no kept client knows the coordinate: ``mean = sum_kept w_c mu_c``).

    ``stacked``: means and precisions with leaves ``[C, ...]``; ``weights``, ``mask``: ``[C]``.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim={trim} must be in [0, 0.5), e.g. 0.2")
    if precision_cap is not None and precision_cap <= 0:
        raise ValueError(f"precision_cap={precision_cap} must be > 0 (or None for no cap)")
    mask = jnp.asarray(mask)
    real = mask > 0
    k = jnp.sum(real).astype(jnp.int32)
    b = trimmed_count(k, trim)
    w = jnp.where(real, weights, 0.0)

    def leaf(mu, lam):
        kept = column_kept_ranks(mu, mask, b)  # stable ranks without a sort (order_statistics)
        cap = None if precision_cap is None else precision_cap * coordinate_median(lam, mask)

        def weighed(c):  # client c's terms of sum_kept w_c (1, lambda_c, lambda_c mu_c, mu_c), per coordinate
            weight = jnp.where(kept[c], w[c], 0.0)
            capped = lam[c] if cap is None else jnp.minimum(lam[c], cap)
            return weight, weight * capped, weight * capped * mu[c], weight * mu[c]

        total, lam_sum, lam_mu_sum, mu_sum = sum_over_rows(weighed, mu.shape[0])  # one streaming pass
        total = jnp.maximum(total, 1e-30)
        precision = lam_sum / total
        informed = precision + eps > 0  # elsewhere no kept client has information: the kept clients' mean
        mean = jnp.where(informed, lam_mu_sum / total / jnp.where(informed, precision + eps, 1.0), mu_sum / total)
        return mean, precision

    pairs = jax.tree.map(leaf, stacked.mean, stacked.precision)
    treedef = jax.tree.structure(stacked.mean)
    leaves = treedef.flatten_up_to(pairs)
    return DiagGaussian(treedef.unflatten([m for m, _ in leaves]), treedef.unflatten([p for _, p in leaves]))


__all__ = ["bound_update_norms", "coordinate_median", "krum_scores", "krum_selection", "pairwise_sq_distances",
           "robust_product", "trimmed_count", "trimmed_mean"]
