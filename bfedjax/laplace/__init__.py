"""Laplace approximations (jax only): diagonal Fisher estimators and exact Hessians of small models."""
from bfedjax.laplace.fisher import FISHER_ESTIMATORS, grad_and_fisher, offline_fisher, per_example_grads
from bfedjax.laplace.hessian import EIGEN_ORDERS, batch_hessian, eigenvalue_diagonal, offline_hessian

__all__ = ["EIGEN_ORDERS", "FISHER_ESTIMATORS", "batch_hessian", "eigenvalue_diagonal", "grad_and_fisher",
           "offline_fisher", "offline_hessian", "per_example_grads"]
