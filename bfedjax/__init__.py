"""bfedjax: Bayesian federated learning in JAX.

Clients are an array axis: local training of a whole cohort runs under
``jax.vmap`` and ``lax.scan``, and aggregation happens in the same jitted
round step.

    import jax, bfedjax as bf
    data = bf.data.load("digits")
    parts = bf.data.partition(data.y_train, "dirichlet_per_class", 10, seed=0, alpha=0.1)
    fed = bf.data.from_partition(data, parts)
    algo = bf.algorithms.fola(bf.models.get_model("mlp", 10), lr=0.05, lam=100.0)
    result = bf.simulate(algo, fed, rounds=5, key=jax.random.PRNGKey(0))
    result.metrics["global_accuracy"]

Subpackages load on first use, so ``import bfedjax.posteriors`` (or
``bfedjax.laplace``, ``bfedjax.core``) costs jax and nothing else; Flax,
NumPyro and optax load with the models, the variational clients and the
algorithms that use them.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("algorithms", "core", "data", "laplace", "losses", "metrics", "models", "order_statistics", "plots",
                "posteriors", "privacy", "tasks", "tree", "vi")
_FROM_CORE = ("Algorithm", "simulate")

__all__ = list(_FROM_CORE) + list(_SUBPACKAGES)


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"bfedjax.{name}")
    if name in _FROM_CORE:
        return getattr(importlib.import_module("bfedjax.core"), name)
    raise AttributeError(f"module 'bfedjax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
