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

from bfedjax.algorithms.private_models import PrivateModels, output_shape
from bfedjax.core.types import Algorithm, Batch, ClientContext
from bfedjax.losses import distillation
from bfedjax.posteriors.aggregation import weighted_mean
from bfedjax.metrics.classification import evaluate as classification_metrics
from bfedjax.tasks import EVAL_BATCH_SIZE, classification

WEIGHTINGS = ("equal", "by_size")


def fml(model, *, input_shape: Sequence[int], local_models: Sequence | None = None, lr: float = 0.01, local_epochs: int = 5,
        batch_size: int = 128, alpha: float = 0.5, beta: float = 0.5, distill_temperature: float = 1.0,
        weight_decay: float = 5e-4, momentum: float = 0.9, reinit_local: bool = False,
        weighting: str = "equal", head_models: Sequence | None = None) -> Algorithm:
    """FML with meme (and global) architecture ``model`` and one local architecture per group.

    Args:
      model: the meme's Flax classifier; input_shape: one example's shape.
      local_models: one Flax classifier per architecture group (``simulate(..., client_groups=...)``);
        ``None``: the meme's architecture on every client (the common setting).
      lr, weight_decay, momentum: SGD of both models (hyper-parameter ``lr`` is traced).
      local_epochs, batch_size: E and B (HBFL's baseline at the HBFL spec's section 4 setting: 5 and 128).
      alpha, beta: CE weights of the local and the meme loss (0.5, 0.5); ``beta = 1`` makes the
        meme's loss plain CE. distill_temperature: of both KL terms (1).
      reinit_local: a fresh local model every round (default: persisted, as FML).
      weighting: ``"equal"`` (FML's plain average of the memes) or ``"by_size"`` (n_k / n).
      head_models: objective heterogeneity (HBFL spec Decision 13, FML as its baseline): ``model``
        is then a shared trunk (``x -> features``) and the clients of group ``g`` put
        ``head_models[g]`` (``features -> group g's labels``) on it. The meme is trunk + head and
        learns as a whole; only the trunk is averaged, the head stays on the client (persisted;
        its momentum restarts every round with the meme's). Requires ``local_models``, one per
        group with the group's labels. There is no global model to score then.
    Per-client test metrics: ``accuracy`` (best of meme and local model), ``meme_accuracy``,
    ``local_model_accuracy``.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"fml: weighting={weighting!r}; choose one of {WEIGHTINGS}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"fml: beta={beta} must be in [0, 1]")
    if head_models is not None and local_models is None:
        raise ValueError("fml: with head_models give local_models too (one per group, with the group's labels)")
    trunk_task = classification(model)
    heads = None if head_models is None else PrivateModels(head_models, output_shape(model, input_shape))
    private = PrivateModels((model,) if local_models is None else tuple(local_models), input_shape, alpha=alpha, temperature=distill_temperature,
                            weight_decay=weight_decay, momentum=momentum, reinit=reinit_local)
    meme_tx = optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))

    def meme_logits(meme, x, group: int):
        """``[B, K_group]`` logits of the meme (the trunk, then the group's head with ``head_models``)."""
        if heads is None:
            return trunk_task.apply_fn(meme, x)
        return heads.logits({"params": meme["head"]}, trunk_task.apply_fn(meme["trunk"], x), group)

    def client_init(ctx: ClientContext, key):
        trunk = ctx.server["params"]
        meme = trunk if heads is None else {"trunk": trunk, "head": ctx.persistent["head"]}
        return {"meme": meme, "meme_opt": meme_tx.init(meme),
                "local": private.start(ctx.persistent["local"], key, ctx.group)}

    def client_step(state, batch: Batch, ctx: ClientContext, key):
        del key
        local_logits = private.logits(state["local"], batch.x, ctx.group)
        before = meme_logits(state["meme"], batch.x, ctx.group)

        def meme_loss(meme):
            return distillation(meme_logits(meme, batch.x, ctx.group), local_logits, batch.y, batch.mask, beta,
                                distill_temperature)

        grad = jax.grad(meme_loss)(state["meme"])
        direction, meme_opt = meme_tx.update(grad, state["meme_opt"], state["meme"])
        meme = jax.tree.map(lambda w, d: w - ctx.hparams["lr"] * d, state["meme"], direction)
        local = private.step(state["local"], batch, before, ctx.hparams["lr"], ctx.group)
        return {"meme": meme, "meme_opt": meme_opt, "local": local}

    def client_final(state, ctx: ClientContext):
        del ctx
        if heads is None:
            return {"params": state["meme"]}, {"local": state["local"]}, {}
        return {"params": state["meme"]["trunk"]}, {"local": state["local"], "head": state["meme"]["head"]}, {}

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        q = weights if weighting == "by_size" else mask / jnp.maximum(jnp.sum(mask), 1.0)
        return {"params": weighted_mean(messages["params"], q)}, {}

    def evaluate_client(message, persistent, x, y, mask, group):
        meme = message["params"] if heads is None else {"trunk": message["params"], "head": persistent["head"]}
        meme_scores = classification_metrics(lambda p, xb: meme_logits(p, xb, group), meme, x, y, EVAL_BATCH_SIZE,
                                             mask)
        local = private.evaluate(persistent["local"], x, y, mask, group)
        return {"accuracy": jnp.maximum(meme_scores["accuracy"], local["accuracy"]),
                "meme_accuracy": meme_scores["accuracy"], "local_model_accuracy": local["accuracy"]}

    def persistent_init(params, key, group):
        state = {"local": private.init(key, group)}
        if heads is not None:
            state["head"] = heads.init(jax.random.fold_in(key, 1), group)["params"]
        return state

    hooks = trunk_task.hooks() if heads is None else {"init_params": trunk_task.init_params}
    return Algorithm(
        name="fml", server_init=lambda params: {"params": params}, client_init=client_init,
        client_step=client_step, client_final=client_final, server_update=server_update,
        persistent_init=persistent_init, evaluate_client=evaluate_client, hparams={"lr": lr},
        local_epochs=local_epochs, batch_size=batch_size,
        num_groups=max(private.num_groups, heads.num_groups if heads else 1), **hooks)


__all__ = ["WEIGHTINGS", "fml"]
