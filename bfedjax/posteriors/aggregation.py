"""Aggregation rules over stacked diagonal-Gaussian posteriors.

Every rule is a pure function of client posteriors stacked on a leading axis
``[C, ...]``, client weights ``[C]`` (non-negative; the engine passes weights
summing to one over the cohort's real clients) and an optional cohort mask
``[C]`` (1 for a real client, 0 for a padding slot; ``None``: all real).
Padding slots never count. The rules that ignore weights (conflation) or count
clients (DWC's K) read the mask and never infer it from the weights: a real
client may weigh zero. A padding slot may hold any finite values, a zero
precision included; non-finite values are the engine's to keep out (it zeroes
the message of a client it leaves out for NaN or Inf). Algorithms call these rules; they never re-implement
them.

FOLA (Liu et al.): ``gaussian_product`` (Eq. 12), ``moment_matched_mixture``
(Eqs. 5-7), ``weighted_mean`` (Eq. 6).
Fischer et al. section 2.5, elementwise on (mean, variance), all in
``RULES``: ``nwa`` (Eq. 10, = CLP), ``weighted_sum_of_normals`` (WS, Eq. 11),
``linear_pool`` (LP, Eqs. 12-14), ``conflation`` (IV, Eq. 15),
``weighted_conflation`` (WC, Eq. 16), ``log_linear_pool`` (LLP),
``centered_linear_pool`` (CLP) and ``distributed_weight_consolidation`` (DWC,
Eq. 17, with a guard where its precision is not positive).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.posteriors.gaussian import DiagGaussian, softplus_inverse
from bfedjax.tree import weighted_sum


def _real(weights, mask):
    """The cohort mask as float32 ``[C]`` (all ones when ``mask`` is None)."""
    return jnp.ones_like(weights, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)


def _masked(weights, mask):
    """Weights with padding slots zeroed."""
    return weights if mask is None else jnp.where(jnp.asarray(mask) > 0, weights, 0.0)


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


def gaussian_product_full_stats(mean: jax.Array, precision: jax.Array):
    """One client's sufficient statistics of the full-covariance product: ``(precision @ mean [d], precision [d, d])``."""
    return precision @ mean, precision


def gaussian_product_full_from_stats(summed_stats, eps: float = 0.0):
    """``(mean [d], precision [d, d])``: the product from ``sum_k w_k * gaussian_product_full_stats(mean_k,
    precision_k)``, ``mean = (precision + eps I)^{-1} sum_k w_k precision_k mean_k``; ``eps`` guards the
    directions no client has information about, as in the diagonal ``gaussian_product_from_stats``."""
    eta, precision = summed_stats
    guarded = precision + eps * jnp.eye(precision.shape[0], dtype=precision.dtype) if eps else precision
    return jnp.linalg.solve(guarded, eta), precision


def gaussian_product_full(means: jax.Array, precisions: jax.Array, weights: jax.Array, eps: float = 0.0):
    """The product of full-covariance Gaussians raised to powers ``w_k`` (HBFL Eqs. 3.11-3.12; FOLA Eq. 12
    with full matrices, its Sec. IV-E "full" Laplace).

    ``Lambda_g = sum_k w_k Lambda_k``, ``mu_g = Lambda_g^{-1} sum_k w_k Lambda_k mu_k``: with the
    local least-squares solutions and ``Lambda_k = X_k^T X_k / sigma^2`` (Appendix A) and
    ``w_k = 1`` it is the global least-squares solution. Small ``d`` only (a ``d x d`` solve).

    Args:
      means: ``[K, d]``; precisions: ``[K, d, d]`` symmetric positive definite (positive semi-definite
        with ``eps > 0``); weights: ``[K]``.
    Returns:
      ``(mean [d], precision [d, d])``.
    """
    eta, precision = jax.vmap(gaussian_product_full_stats)(means, precisions)
    summed = (jnp.einsum("k,ki->i", weights, eta), jnp.einsum("k,kij->ij", weights, precision))
    return gaussian_product_full_from_stats(summed, eps)


def moment_matched_mixture(stacked: DiagGaussian, weights: jax.Array) -> DiagGaussian:
    """Moment-matched collapse of the mixture ``sum_c w_c N(mean_c, 1/precision_c)`` (FOLA Eqs. 5-7, diagonal).

    mean = sum_c w_c mean_c
    var  = sum_c w_c (1/precision_c + (mean_c - mean)^2)
    Weights are normalised to sum to one first. The spread about ``mean`` rather than the second moment
    minus ``mean^2``: in float32 the difference cancels where the variances are far below ``mean^2`` (10
    clients at mean 0.7 and scale 1e-4 gave a tenth of the coordinates a variance <= 0).
    """
    w = weights / jnp.sum(weights)
    mean = weighted_sum(stacked.mean, w)
    var = jax.tree.map(lambda v, m, g: weighted_sum(v + jnp.square(m - g), w), _variance(stacked, w), stacked.mean, mean)
    return DiagGaussian(mean, jax.tree.map(lambda v: 1.0 / v, var))


# --- Fischer et al. (section 2.5): elementwise rules on (mean, variance) ---


def _normalised(weights, mask=None):
    weights = _masked(weights, mask)
    return weights / jnp.sum(weights)


def _per_counted_client(fn, stacked: DiagGaussian, weights):
    """``fn(precision)`` where a client weighs something, 0 elsewhere (a zero-weight or padding slot's
    precision may be 0 and must not turn the weighted sum into ``0 * inf``)."""
    def leaf(p):
        counts = jnp.reshape(weights > 0, (-1,) + (1,) * (jnp.ndim(p) - 1))
        return jnp.where(counts, fn(jnp.where(counts, p, 1.0)), 0.0)

    return jax.tree.map(leaf, stacked.precision)


def _variance(stacked: DiagGaussian, weights):
    """``1 / precision`` of the clients that weigh something, 0 elsewhere."""
    return _per_counted_client(lambda p: 1.0 / p, stacked, weights)


def nwa(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """Naive weighted averaging (Eq. 10): mean and variance both averaged with the weights."""
    w = _normalised(weights, mask)
    mean = weighted_sum(stacked.mean, w)
    variance = weighted_sum(_variance(stacked, w), w)
    return DiagGaussian(mean, jax.tree.map(lambda v: 1.0 / v, variance))


centered_linear_pool = nwa  # the paper: NWA "is equal to the Centered Linear Pool"


def weighted_sum_of_normals(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """WS (Eq. 11): the law of sum_k w_k theta_k for independent theta_k: variance sum_k w_k^2 sigma_k^2."""
    w = _normalised(weights, mask)
    mean = weighted_sum(stacked.mean, w)
    variance = weighted_sum(_variance(stacked, w), jnp.square(w))
    return DiagGaussian(mean, jax.tree.map(lambda v: 1.0 / v, variance))


def linear_pool(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """LP (Eqs. 12-14): the moment-matched mixture sum_k w_k N(mu_k, sigma_k^2)."""
    return moment_matched_mixture(stacked, _masked(weights, mask))


def conflation(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """Conflation / inverse-variance weighting (Eq. 15): the normalised product of every real client.

    Client weights are ignored: each real client (``mask``; ``None``: every stacked client) counts
    once, whatever its weight.
    """
    return gaussian_product(stacked, _real(weights, mask))


def log_linear_pool(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """LLP: normalised weighted geometric mean prod_k q_k^{w_k}; precision sum_k w_k / sigma_k^2."""
    return gaussian_product(stacked, _normalised(weights, mask))


def weighted_conflation(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """WC (Eq. 16): LLP's mean, variance w_max / sum_k (w_k / sigma_k^2)."""
    w = _normalised(weights, mask)
    pooled = gaussian_product(stacked, w)
    return DiagGaussian(pooled.mean, jax.tree.map(lambda p: p / jnp.max(w), pooled.precision))


def raw_param_fedavg(stacked: DiagGaussian, weights, *, mask=None) -> DiagGaussian:
    """FedAvg on the parameters as NumPyro stores them (the spec's D1 alternative to NWA): the weighted
    mean of ``mu`` and of ``rho = softplus^-1(sigma)``, then ``sigma = softplus(rho)``."""
    w = _normalised(weights, mask)
    mean = weighted_sum(stacked.mean, w)

    rho = _per_counted_client(lambda p: softplus_inverse(jax.lax.rsqrt(p)), stacked, w)
    scale = jax.tree.map(jax.nn.softplus, weighted_sum(rho, w))
    return DiagGaussian(mean, jax.tree.map(lambda sd: 1.0 / jnp.square(sd), scale))


DWC_GUARDS = ("conflation", "floor", "none")


def distributed_weight_consolidation(stacked: DiagGaussian, weights, prior: DiagGaussian, guard: str = "conflation",
                                     floor_ratio: float = 1.0, mask=None):
    """DWC (Eq. 17): q_g proportional to prod_k q_k / q_prior^(K-1).

    precision = sum_k 1/sigma_k^2 - (K-1)/sigma_prior^2 and the matching mean.
    K counts the real clients (``mask``; Eq. 17 gives every client the same
    power, so ``weights`` are not used). Guards where that precision is not
    positive (the spec recommends the conflation fallback):

    * ``"conflation"`` (default): where that precision is not positive, the
      coordinate falls back to Conflation.
    * ``"floor"``: the precision is clipped from below at ``floor_ratio`` times
      the clients' mean precision (``sum_k 1/sigma_k^2 / K``) and the mean is
      computed with the clipped precision, which bounds how far it can
      extrapolate where the prior and the clients nearly cancel.
    * ``"none"``: Eq. 17 as printed (non-positive precisions pass through).

    Returns ``(posterior, guard_hits)``: the number of coordinates the guard changed.
    """
    if guard not in DWC_GUARDS:
        raise ValueError(f"DWC guard={guard!r}; choose one of {DWC_GUARDS}")
    real = _real(weights, mask)  # Eq. 17 gives every real client power 1, whatever its weight
    k = jnp.sum(real)
    conf = gaussian_product(stacked, real)
    stats = weighted_sum(jax.vmap(gaussian_product_stats)(stacked), real)

    def leaf(num, prec, prior_mean, prior_prec, conf_mean, conf_prec):
        dwc_prec = prec - (k - 1.0) * prior_prec
        shifted = num - (k - 1.0) * prior_prec * prior_mean
        if guard == "floor":
            floor = floor_ratio * prec / k
            hit = dwc_prec < floor
            clipped = jnp.maximum(dwc_prec, floor)
            return shifted / clipped, clipped, jnp.sum(hit)
        ok = dwc_prec > 0
        if guard == "none":
            return shifted / dwc_prec, dwc_prec, jnp.sum(~ok)
        dwc_mean = shifted / jnp.where(ok, dwc_prec, 1.0)
        return jnp.where(ok, dwc_mean, conf_mean), jnp.where(ok, dwc_prec, conf_prec), jnp.sum(~ok)

    out = jax.tree.map(leaf, stats[0], stats[1], prior.mean, prior.precision, conf.mean, conf.precision)
    is_triple = lambda x: isinstance(x, tuple) and len(x) == 3
    mean = jax.tree.map(lambda t: t[0], out, is_leaf=is_triple)
    precision = jax.tree.map(lambda t: t[1], out, is_leaf=is_triple)
    hits = sum(jax.tree.leaves(jax.tree.map(lambda t: t[2], out, is_leaf=is_triple)))
    return DiagGaussian(mean, precision), hits


RULES = {
    "nwa": nwa,
    "ws": weighted_sum_of_normals,
    "lp": linear_pool,
    "conflation": conflation,
    "iv": conflation,
    "wc": weighted_conflation,
    "llp": log_linear_pool,
    "clp": centered_linear_pool,
    "raw_param_fedavg": raw_param_fedavg,
}
"""Rules taking ``(stacked, weights, mask=None)``; DWC also needs the previous global posterior (see ``aggregate``)."""


def aggregate(rule: str, stacked: DiagGaussian, weights, *, mask=None, prior: DiagGaussian | None = None) -> DiagGaussian:
    """Applies the named rule (``RULES`` or ``"dwc"``, which needs ``prior``) to the real clients ``mask``.

    ``mask=None`` counts every stacked client as real: pass the cohort mask whenever slots are padding.
    """
    if rule == "dwc":
        if prior is None:
            raise ValueError("rule 'dwc' needs the previous global posterior: pass prior=...")
        return distributed_weight_consolidation(stacked, weights, prior, mask=mask)[0]
    if rule not in RULES:
        raise ValueError(f"unknown aggregation rule {rule!r}; choose one of {sorted(RULES) + ['dwc']}")
    return RULES[rule](stacked, weights, mask=mask)
