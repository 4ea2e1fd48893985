"""FML, Federated Mutual Learning (Shen et al. 2020), HBFL's main baseline.

Each client holds a deterministic **meme** of the server's architecture,
forked from the global model every round with a fresh optimiser, and a
private **local model** of any architecture (``PrivateModels``, one per group,
persisted with its optimiser). On every mini-batch both models predict, then
both learn from each other (Eq. 2.5, two-way):

    L_local = alpha CE(local) + (1 - alpha) KL(q_meme || q_local)
    L_meme  = beta  CE(meme)  + (1 - beta)  KL(q_local || q_meme)

(the FML code: SGD lr 0.01, momentum 0.9, weight decay 5e-4 for both, alpha =
beta = 0.5, no temperature, no learning-rate decay as HBFL runs it). The
global model is the plain average of the memes (FML), or the size-weighted one.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from bfedjax.algorithms.private_models import PrivateModels
from bfedjax.core.types import Algorithm, Batch, ClientContext
from bfedjax.losses import distillation
from bfedjax.posteriors.aggregation import weighted_mean
from bfedjax.tasks import classification

WEIGHTINGS = ("equal", "by_size")


def fml(model, *, input_shape: Sequence[int], local_models: Sequence | None = None, lr: float = 0.01, local_epochs: int = 1,
        batch_size: int = 128, alpha: float = 0.5, beta: float = 0.5, distill_temperature: float = 1.0,
        weight_decay: float = 5e-4, momentum: float = 0.9, reinit_local: bool = False,
        weighting: str = "equal") -> Algorithm:
    """FML with meme (and global) architecture ``model`` and one local architecture per group.

    Args:
      model: the meme's Flax classifier; input_shape: one example's shape.
      local_models: one Flax classifier per architecture group (``simulate(..., client_groups=...)``);
        ``None``: the meme's architecture on every client (the common setting).
      lr, weight_decay, momentum: SGD of both models (hyper-parameter ``lr`` is traced).
      alpha, beta: CE weights of the local and the meme loss (0.5, 0.5); ``beta = 1`` makes the
        meme's loss plain CE. distill_temperature: of both KL terms (1).
      reinit_local: a fresh local model every round (default: persisted, as FML).
      weighting: ``"equal"`` (FML's plain average of the memes) or ``"by_size"`` (n_k / n).
    Per-client test metrics: ``accuracy`` (best of meme and local model), ``meme_accuracy``,
    ``local_model_accuracy``.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"fml: weighting={weighting!r}; choose one of {WEIGHTINGS}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"fml: beta={beta} must be in [0, 1]")
    meme_task = classification(model)
    private = PrivateModels((model,) if local_models is None else tuple(local_models), input_shape, alpha=alpha, temperature=distill_temperature,
                            weight_decay=weight_decay, momentum=momentum, reinit=reinit_local)
    meme_tx = optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))

    def client_init(ctx: ClientContext, key):
        meme = ctx.server["params"]
        return {"meme": meme, "meme_opt": meme_tx.init(meme),
                "local": private.start(ctx.persistent["local"], key, ctx.group)}

    def client_step(state, batch: Batch, ctx: ClientContext, key):
        del key
        local_logits = private.logits(state["local"], batch.x, ctx.group)
        meme_logits = meme_task.apply_fn(state["meme"], batch.x)

        def meme_loss(meme):
            return distillation(meme_task.apply_fn(meme, batch.x), local_logits, batch.y, batch.mask, beta,
                                distill_temperature)

        grad = jax.grad(meme_loss)(state["meme"])
        direction, meme_opt = meme_tx.update(grad, state["meme_opt"], state["meme"])
        meme = jax.tree.map(lambda w, d: w - ctx.hparams["lr"] * d, state["meme"], direction)
        local = private.step(state["local"], batch, meme_logits, ctx.hparams["lr"], ctx.group)
        return {"meme": meme, "meme_opt": meme_opt, "local": local}

    def client_final(state, ctx: ClientContext):
        del ctx
        return {"params": state["meme"]}, {"local": state["local"]}, {}

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        q = weights if weighting == "by_size" else mask / jnp.maximum(jnp.sum(mask), 1.0)
        return {"params": weighted_mean(messages["params"], q)}, {}

    def evaluate_client(message, persistent, x, y, mask, group):
        meme = meme_task.evaluate(message["params"], x, y, mask)
        local = private.evaluate(persistent["local"], x, y, mask, group)
        return {"accuracy": jnp.maximum(meme["accuracy"], local["accuracy"]), "meme_accuracy": meme["accuracy"],
                "local_model_accuracy": local["accuracy"]}

    return Algorithm(
        name="fml", server_init=lambda params: {"params": params}, client_init=client_init,
        client_step=client_step, client_final=client_final, server_update=server_update,
        persistent_init=lambda params, key, group: {"local": private.init(key, group)},
        evaluate_client=evaluate_client, hparams={"lr": lr}, local_epochs=local_epochs, batch_size=batch_size,
        num_groups=private.num_groups, **meme_task.hooks())


__all__ = ["WEIGHTINGS", "fml"]
