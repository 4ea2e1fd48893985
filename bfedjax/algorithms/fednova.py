"""FedNova (Wang et al. 2020): normalised averaging of heterogeneous local progress.

Client i runs ``tau_i`` local SGD steps (its data size decides how many) and
sends its normalised direction ``d_i = (theta - theta_i) / a_i``, where
``a_i = tau_i`` for plain SGD and, with heavy-ball momentum ``rho``,
``a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)``. The server
steps ``theta <- theta - tau_eff * sum_i w_i d_i`` with ``tau_eff = sum_i w_i a_i``:
every client contributes in proportion to its weight, not to its step count
(FedAvg's objective inconsistency). With equal ``tau_i`` it equals FedAvg.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.algorithms.fedavg import params_server_init
from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.types import Algorithm
from bfedjax.tasks import classification


def fednova(model, *, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 32, momentum: float = 0.0,
            clip_norm: float | None = None) -> Algorithm:
    """FedNova with local SGD (optionally heavy-ball momentum ``momentum``)."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum} must be in [0, 1)")
    client_init, client_step = make_sgd_client(model, clip_norm=clip_norm, momentum=momentum)

    def normaliser(steps):
        tau = steps.astype(jnp.float32)
        if not momentum:
            return tau
        rho = momentum
        return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)

    def client_final(local, ctx):
        a = normaliser(local.steps)
        inv = jnp.where(a > 0, 1.0 / jnp.where(a > 0, a, 1.0), 0.0)
        direction = jax.tree.map(lambda t, p: (t - p) * inv, ctx.server["params"], local.params)
        return {"params": local.params, "direction": direction, "tau": a}, (), {}

    def client_stats(message):
        return {"direction": message["direction"], "tau": message["tau"]}

    def server_from_stats(server, stats, mask, hparams, key):
        del mask, hparams, key
        return {"params": jax.tree.map(lambda t, d: t - stats["tau"] * d, server["params"], stats["direction"])}, {}

    return Algorithm(
        name="fednova", server_init=params_server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, client_stats=client_stats, server_from_stats=server_from_stats,
        hparams={"lr": lr}, local_epochs=local_epochs, batch_size=batch_size, **classification(model).hooks())
