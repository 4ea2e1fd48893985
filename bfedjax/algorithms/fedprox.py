"""FedProx (Li et al.): FedAvg plus the proximal term ``mu/2 ||theta - theta_S||^2``.

``mu`` is a traced hyper-parameter. The FOLA authors ran FedProx without
gradient clipping, which is the default here. ``scaling="full"`` gives the
FedReg authors' ``mu ||theta - theta_S||^2`` (their code drops the 1/2).
``detached=True`` is FedProx as the FedRef authors ran it: their proximal term
is computed on detached arrays, so it has no gradient and the clients train
exactly like FedAvg's (FedRef spec 2.5).
"""
from __future__ import annotations

from bfedjax.algorithms.fedavg import mean_from_stats, params_message, params_server_init, params_stats
from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.types import Algorithm
from bfedjax.tasks import classification

SCALINGS = {"half": 1.0, "full": 2.0}  # precision of the quadratic mu/2 * p * ||theta - theta_S||^2


def fedprox(model, *, mu: float = 0.01, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 32,
            clip_norm: float | None = None, momentum: float = 0.0, scaling: str = "half",
            dp_clip: float | None = None, dp_noise: float = 0.0, detached: bool = False, task=None) -> Algorithm:
    if scaling not in SCALINGS:
        raise ValueError(f"FedProx scaling={scaling!r}; choose one of {tuple(SCALINGS)}")
    precision = SCALINGS[scaling]

    def proximal_prior(ctx):
        """Isotropic prior centred on the global model."""
        return ctx.server["params"], precision

    client_init, client_step = make_sgd_client(model, prior_fn=proximal_prior, prior_weight="mu", clip_norm=clip_norm,
                                               momentum=momentum, dp_clip=dp_clip, dp_noise=dp_noise,
                                               prior_grad=not detached, loss_fn=None if task is None else task.loss)
    return Algorithm(
        name="fedprox", server_init=params_server_init, client_init=client_init, client_step=client_step,
        client_final=params_message, client_stats=params_stats, server_from_stats=mean_from_stats,
        hparams={"lr": lr, "mu": mu}, local_epochs=local_epochs, batch_size=batch_size,
        **(task or classification(model)).hooks())
