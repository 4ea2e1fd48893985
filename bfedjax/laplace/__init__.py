"""Diagonal Fisher / Laplace estimators (jax only)."""
from bfedjax.laplace.fisher import FISHER_ESTIMATORS, grad_and_fisher, offline_fisher, per_example_grads

__all__ = ["FISHER_ESTIMATORS", "grad_and_fisher", "offline_fisher", "per_example_grads"]
