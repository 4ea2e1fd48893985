"""Diagonal Fisher / Laplace estimators."""
from bfedjax.laplace.fisher import ESTIMATORS, grad_and_fisher, masked_mean_cross_entropy, offline_fisher

__all__ = ["ESTIMATORS", "grad_and_fisher", "masked_mean_cross_entropy", "offline_fisher"]
