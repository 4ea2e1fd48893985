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
"""
from bfedjax import algorithms, core, data, laplace, metrics, models, posteriors, privacy, vi
from bfedjax.core import Algorithm, simulate

__version__ = "0.1.0"
__all__ = ["Algorithm", "algorithms", "core", "data", "laplace", "metrics", "models", "posteriors", "privacy", "simulate",
           "vi"]
