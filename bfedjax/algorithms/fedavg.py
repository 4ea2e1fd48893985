"""FedAvg (McMahan et al.): local SGD, server takes the pi-weighted mean (FOLA Eq. 6); and FedSGD."""
from __future__ import annotations

from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.types import Algorithm
from bfedjax.tasks import classification


def params_server_init(params):
    return {"params": params}


def params_message(local, ctx):
    """Send the local weights; no persistent state, no client metrics."""
    del ctx
    return {"params": local.params}, (), {}


def params_stats(message):
    """FedAvg's statistic: the local weights (their weighted sum is Eq. 6)."""
    return message["params"]


def mean_from_stats(server, summed_params, mask, hparams, key):
    del server, mask, hparams, key
    return {"params": summed_params}, {}


def fedavg(model, *, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 32,
           clip_norm: float | None = 10.0, momentum: float = 0.0, optimizer: str = "sgd",
           dp_clip: float | None = None, dp_noise: float = 0.0, weight_decay: float = 0.0, task=None) -> Algorithm:
    """FedAvg with local SGD (FOLA authors' baseline: clip 10, no momentum) or local Adam.

    With a dropout model (``models.get_model(..., dropout_rate=0.2)``) this is
    the MC-dropout baseline of Fischer et al.; ResNet-20's BatchNorm statistics
    are averaged with the weights. ``dp_clip``/``dp_noise`` make the local
    steps DP-SGD (``privacy.dp``). ``weight_decay`` adds L2 on the kernels (Fischer et al.'s
    deterministic and MC-dropout baselines use 1e-4). ``task``: a ``tasks.Task`` whose loss the clients
    train on and whose metrics the engine reports (default ``classification(model)``; e.g.
    ``tasks.segmentation(model)``).
    """
    client_init, client_step = make_sgd_client(model, clip_norm=clip_norm, momentum=momentum, optimizer=optimizer,
                                               dp_clip=dp_clip, dp_noise=dp_noise, weight_decay=weight_decay,
                                               loss_fn=None if task is None else task.loss)
    return Algorithm(
        name="fedavg", server_init=params_server_init, client_init=client_init, client_step=client_step,
        client_final=params_message, client_stats=params_stats, server_from_stats=mean_from_stats,
        hparams={"lr": lr}, local_epochs=local_epochs, batch_size=batch_size, **(task or classification(model)).hooks())


def fedsgd(model, *, client_size: int, lr: float = 0.1, dp_clip: float | None = None,
           dp_noise: float = 0.0) -> Algorithm:
    """FedSGD, the FedReg paper's "SGD" baseline: each sampled client takes one step on all its data.

    FedAvg with one local epoch of one batch of ``client_size`` (>= the largest
    client, e.g. ``FederatedData.max_n``) and no clipping; the server mean is
    then one step along the mean of the clients' mean gradients.
    """
    return fedavg(model, lr=lr, local_epochs=1, batch_size=client_size, clip_norm=None, dp_clip=dp_clip,
                  dp_noise=dp_noise).replace(name="fedsgd")
