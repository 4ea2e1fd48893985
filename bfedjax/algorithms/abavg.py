"""ABAVG, accuracy-based averaging (Xiao et al. 2021), an HBFL baseline.

Clients train as FedAvg (local SGD); the server scores every returned model
on a validation split it holds and averages them with weights
``w_k = acc_k / sum_j acc_j`` (HBFL spec Decision 15: an IID split of 10% of
the training data, ``data.holdout``), or ``w_k`` proportional to ``n_k acc_k``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.algorithms.fedavg import params_message, params_server_init
from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.types import Algorithm
from bfedjax.posteriors.aggregation import weighted_mean
from bfedjax.tasks import classification

WEIGHTINGS = ("accuracy", "accuracy_by_size")


def abavg(model, *, validation, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 128,
          momentum: float = 0.9, weight_decay: float = 5e-4, clip_norm: float | None = None,
          weighting: str = "accuracy") -> Algorithm:
    """ABAVG for ``model``.

    Args:
      validation: ``(x [V, ...], y [V])``, the server's validation split (held in the compiled round).
      lr, momentum, weight_decay, clip_norm: local SGD (the paper's 0.01, 0.9, 5e-4 on kernels, no clipping).
      weighting: ``"accuracy"`` (w_k = acc_k / sum acc) or ``"accuracy_by_size"`` (w_k prop. to n_k acc_k).
    Server metric: ``mean_validation_accuracy`` of the cohort's models.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"abavg: weighting={weighting!r}; choose one of {WEIGHTINGS}")
    x_val, y_val = (jnp.asarray(a) for a in validation)
    if x_val.shape[0] == 0 or x_val.shape[0] != y_val.shape[0]:
        raise ValueError("abavg: validation must be a non-empty (x, y) pair of equal length; fix: data.holdout(...)")
    task = classification(model)
    client_init, client_step = make_sgd_client(model, clip_norm=clip_norm, momentum=momentum,
                                               weight_decay=weight_decay)

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        accuracy = jax.lax.map(lambda p: task.evaluate(p, x_val, y_val)["accuracy"], messages["params"])
        raw = accuracy * mask * (weights if weighting == "accuracy_by_size" else 1.0)
        share = jnp.where(jnp.sum(raw) > 0, raw / jnp.maximum(jnp.sum(raw), 1e-30), weights)
        mean_accuracy = jnp.sum(accuracy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return {"params": weighted_mean(messages["params"], share)}, {"mean_validation_accuracy": mean_accuracy}

    return Algorithm(
        name="abavg", server_init=params_server_init, client_init=client_init, client_step=client_step,
        client_final=params_message, server_update=server_update, hparams={"lr": lr},
        local_epochs=local_epochs, batch_size=batch_size, **task.hooks())


__all__ = ["WEIGHTINGS", "abavg"]
