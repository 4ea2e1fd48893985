"""Client-kept local models of any architecture, one per architecture group (HBFL's and FML's "local model").

A client of group ``g`` keeps ``{"params": local model of architecture g,
"opt": its SGD-with-momentum state}`` in its persistent state (the engine
holds it as the group's ``[N_group, ...]`` arrays). The model never leaves the
client: each mini-batch it learns ``alpha CE + (1 - alpha) KL(q_teacher ||
q_local)`` from a teacher's logits (the meme's), by SGD with momentum and L2
weight decay on every leaf (PyTorch ``SGD(momentum, weight_decay)``, as the FML code).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from bfedjax.core.types import Batch
from bfedjax.losses import cross_entropy, distillation, masked_mean
from bfedjax.tasks import classification


def output_shape(model, input_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of one example's output of ``model`` on inputs of ``input_shape`` (e.g. a trunk's features,
    ``(576,)`` for CNN2's on 28x28x1), without running it."""
    task = classification(model)
    example = jnp.zeros((1,) + tuple(input_shape), jnp.float32)
    out = jax.eval_shape(lambda: task.apply_fn(task.init_params(jax.random.PRNGKey(0), input_shape), example))
    return tuple(out.shape[1:])


class PrivateModels:
    """Local models ``models[g]`` for the clients of group ``g``.

    Args:
      models: one Flax classifier per architecture group.
      input_shape: one example's shape, e.g. ``(28, 28, 1)``.
      alpha: weight of the cross-entropy in the distillation loss (HBFL/FML default 0.5).
      temperature: distillation temperature (1: the FML code).
      weight_decay, momentum: of the local SGD (5e-4, 0.9: the paper's).
      reinit: start every round from a fresh model and optimiser (Algorithm 1 read literally)
        instead of the persisted ones (the default, as FML).
    """

    def __init__(self, models: Sequence, input_shape: Sequence[int], *, alpha: float = 0.5,
                 temperature: float = 1.0, weight_decay: float = 5e-4, momentum: float = 0.9, reinit: bool = False):
        if not models:
            raise ValueError("PrivateModels needs at least one model (one per architecture group)")
        if not 0.0 <= alpha <= 1.0 or temperature <= 0:
            raise ValueError(f"alpha={alpha} must be in [0, 1] and temperature={temperature} > 0")
        self.tasks = tuple(classification(model) for model in models)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.alpha, self.temperature, self.reinit = alpha, temperature, reinit
        self.tx = optax.chain(optax.add_decayed_weights(weight_decay), optax.trace(decay=momentum))

    @property
    def num_groups(self) -> int:
        return len(self.tasks)

    def init(self, key: jax.Array, group: int) -> dict:
        """A fresh local model of ``group``'s architecture and its optimiser state."""
        params = self.tasks[group].init_params(key, self.input_shape)
        return {"params": params, "opt": self.tx.init(params)}

    def start(self, persistent: dict, key: jax.Array, group: int) -> dict:
        """The local model a round starts from: the persisted one, or a fresh one with ``reinit``."""
        return self.init(key, group) if self.reinit else persistent

    def logits(self, state: dict, x: jax.Array, group: int) -> jax.Array:
        """``[B, K]`` logits of the local model on ``x [B, ...]``."""
        return self.tasks[group].apply_fn(state["params"], x)

    def step(self, state: dict, batch: Batch, teacher_logits: jax.Array | None, lr, group: int) -> dict:
        """One SGD step on ``alpha CE + (1 - alpha) KL(softmax(teacher) || softmax(local))``
        (plain CE when ``teacher_logits`` is None)."""
        apply_fn = self.tasks[group].apply_fn

        def loss(params):
            logits = apply_fn(params, batch.x)
            if teacher_logits is None:
                return masked_mean(cross_entropy(logits, batch.y), batch.mask)
            return distillation(logits, teacher_logits, batch.y, batch.mask, self.alpha, self.temperature)

        grad = jax.grad(loss)(state["params"])
        direction, opt = self.tx.update(grad, state["opt"], state["params"])
        return {"params": jax.tree.map(lambda p, d: p - lr * d, state["params"], direction), "opt": opt}

    def evaluate(self, state: dict, x, y, mask, group: int) -> dict:
        """``{"accuracy", "loss"}`` of the local model on ``x [T, ...]``, ``y [T]`` (``mask [T]``)."""
        return self.tasks[group].evaluate(state["params"], x, y, mask)


__all__ = ["PrivateModels", "output_shape"]
