"""ABAVG, accuracy-based averaging (Xiao et al. 2021), an HBFL baseline.

Clients train as FedAvg (local SGD); the server scores every returned model
on a validation split it holds and averages them with weights
``w_k = acc_k / sum_j acc_j`` (HBFL spec Decision 15: an IID split of 10% of
the training data, ``data.holdout``), or ``w_k`` proportional to ``n_k acc_k``.
The spec's alternative has each client report its trained model's accuracy on
its own test split instead (``accuracy_source="client_test"``; with
``weighting="accuracy_by_size"``, ``w_k`` proportional to ``n_k acc_k``): no
server data, but the server must trust the reported numbers.
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
ACCURACY_SOURCES = ("server_validation", "client_test")


def abavg(model, *, validation=None, lr: float = 0.01, local_epochs: int = 5, batch_size: int = 128,
          momentum: float = 0.9, weight_decay: float = 5e-4, clip_norm: float | None = None,
          weighting: str = "accuracy", accuracy_source: str = "server_validation") -> Algorithm:
    """ABAVG for ``model``.

    Args:
      validation: ``(x [V, ...], y [V])``, the server's validation split (held in the compiled round);
        required with ``accuracy_source="server_validation"``.
      lr, momentum, weight_decay, clip_norm: local SGD (the paper's 0.01, 0.9, 5e-4 on kernels, no clipping).
      local_epochs, batch_size: E and B (HBFL's baseline at the HBFL spec's section 4 setting: 5 and 128).
      weighting: ``"accuracy"`` (w_k = acc_k / sum acc) or ``"accuracy_by_size"`` (w_k prop. to n_k acc_k).
      accuracy_source: ``"server_validation"`` (the server scores each model on ``validation``) or
        ``"client_test"`` (each client reports its model's accuracy on its own test split, sent as
        ``reported_accuracy``; needs per-client test splits, e.g. ``data.dirichlet_train_test``).
    Server metric: ``mean_validation_accuracy`` of the cohort's models (the reported ones with
    ``"client_test"``).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"abavg: weighting={weighting!r}; choose one of {WEIGHTINGS}")
    if accuracy_source not in ACCURACY_SOURCES:
        raise ValueError(f"abavg: accuracy_source={accuracy_source!r}; choose one of {ACCURACY_SOURCES}")
    task = classification(model)
    scorer = classification(model, eval_samples=0)  # the weights' accuracies: one pass (dropout off)
    client_init, client_step = make_sgd_client(model, clip_norm=clip_norm, momentum=momentum,
                                               weight_decay=weight_decay)
    if accuracy_source == "server_validation":
        if validation is None:
            raise ValueError("abavg: the server scores the models on a validation split; fix: pass "
                             "validation=data.holdout(...)[1], or accuracy_source='client_test'")
        x_val, y_val = (jnp.asarray(a) for a in validation)
        if x_val.shape[0] == 0 or x_val.shape[0] != y_val.shape[0]:
            raise ValueError("abavg: validation must be a non-empty (x, y) pair of equal length; fix: data.holdout(...)")
        client_final = params_message
        accuracy_of = lambda messages: jax.lax.map(lambda p: scorer.evaluate(p, x_val, y_val)["accuracy"],
                                                   messages["params"])
    else:
        def client_final(local, ctx):
            if ctx.test is None:
                raise ValueError("abavg(accuracy_source='client_test') needs each client's own test split; fix: "
                                 "build the federation with test_parts (data.dirichlet_train_test, "
                                 "--client_test_splits)")
            mask = (jnp.arange(ctx.test.y.shape[0]) < ctx.test.count).astype(jnp.float32)
            accuracy = scorer.evaluate(local.params, ctx.test.x, ctx.test.y, mask)["accuracy"]
            return {"params": local.params, "reported_accuracy": accuracy}, (), {}

        accuracy_of = lambda messages: messages["reported_accuracy"]

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        accuracy = accuracy_of(messages)
        raw = accuracy * mask * (weights if weighting == "accuracy_by_size" else 1.0)
        share = jnp.where(jnp.sum(raw) > 0, raw / jnp.maximum(jnp.sum(raw), 1e-30), weights)
        mean_accuracy = jnp.sum(accuracy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return {"params": weighted_mean(messages["params"], share)}, {"mean_validation_accuracy": mean_accuracy}

    return Algorithm(
        name="abavg", server_init=params_server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update, hparams={"lr": lr},
        local_epochs=local_epochs, batch_size=batch_size, **task.hooks())


__all__ = ["ACCURACY_SOURCES", "WEIGHTINGS", "abavg"]
