"""Diagonal-Gaussian posteriors, every aggregation rule, and client weightings."""
from bfedjax.posteriors import distance, robust, similarity, weighting
from bfedjax.posteriors.aggregation import (DWC_GUARDS, RULES, aggregate, centered_linear_pool, conflation,
                                            distributed_weight_consolidation, gaussian_product,
                                            gaussian_product_from_stats, gaussian_product_full,
                                            gaussian_product_full_from_stats, gaussian_product_full_stats,
                                            gaussian_product_stats, linear_pool,
                                            log_linear_pool, moment_matched_mixture, nwa, weighted_conflation,
                                            weighted_mean, weighted_sum_of_normals)
from bfedjax.posteriors.gaussian import (DensePrecision, DiagGaussian, from_scale, from_variance, kl_divergence,
                                         log_density, quadratic_penalty, rho_to_scale, scale_to_rho, softplus_inverse)
from bfedjax.posteriors.distance import ReferencePosterior, posterior_distance

__all__ = [
    "DWC_GUARDS", "RULES", "DensePrecision", "DiagGaussian", "ReferencePosterior", "aggregate",
    "centered_linear_pool", "conflation", "distance", "distributed_weight_consolidation", "from_scale",
    "from_variance", "gaussian_product", "gaussian_product_from_stats", "gaussian_product_full",
    "gaussian_product_full_from_stats", "gaussian_product_full_stats", "gaussian_product_stats", "kl_divergence",
    "linear_pool", "log_density", "log_linear_pool", "moment_matched_mixture", "nwa", "posterior_distance",
    "quadratic_penalty", "rho_to_scale", "scale_to_rho", "robust", "similarity", "softplus_inverse",
    "weighted_conflation", "weighted_mean", "weighted_sum_of_normals", "weighting"
]
