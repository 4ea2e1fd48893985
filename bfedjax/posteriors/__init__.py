"""Diagonal-Gaussian posteriors and the statistical aggregation rules."""
from bfedjax.posteriors.aggregation import (gaussian_product, gaussian_product_from_stats, gaussian_product_stats,
                                            moment_matched_mixture, weighted_mean)
from bfedjax.posteriors.gaussian import DiagGaussian, from_scale, log_density, quadratic_penalty

__all__ = [
    "DiagGaussian", "from_scale", "log_density", "quadratic_penalty",
    "gaussian_product", "gaussian_product_from_stats", "gaussian_product_stats", "moment_matched_mixture",
    "weighted_mean",
]
