"""The predictive distribution of a trained global model, whatever kind it is."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.core.types import Algorithm
from bfedjax.metrics.classification import padded_batches
from bfedjax.models.apply import apply_fn_of, has_dropout, mc_predict_proba


def predict_proba(algorithm: Algorithm, server, x, key, num_samples: int = 10, batch_size: int = 500):
    """Class probabilities ``[M, T, K]`` of the global model on ``x [T, ...]``.

    * variational server state (``bfl``: ``{"params", "scale", ...}``): ``M = num_samples``
      weight samples of the posterior;
    * a model with dropout: ``M = num_samples`` MC-dropout passes;
    * otherwise the softmax of the global model (``M = 1``).

    The test set is processed in batches of ``batch_size`` to bound memory.
    """
    model, params = algorithm.model, algorithm.global_params(server)
    if "scale" in server:
        from bfedjax.vi.meanfield import MeanFieldVI
        vi = MeanFieldVI(model, x.shape[1:])
        one = lambda xb: vi.predict_proba(server, xb, key, num_samples)
    elif has_dropout(model):
        one = lambda xb: mc_predict_proba(model, params, xb, key, num_samples)
    else:
        one = lambda xb: jax.nn.softmax(apply_fn_of(model)(params, xb), -1)[None]
    xb, _, _ = padded_batches(x, jnp.zeros(x.shape[0], jnp.int32), batch_size)
    probs = jax.lax.map(one, xb)  # [nb, M, b, K]
    probs = jnp.moveaxis(probs, 0, 1)
    return probs.reshape(probs.shape[0], -1, probs.shape[-1])[:, : x.shape[0]]
