"""Forgetting across rounds: FedReg's diagnostic (Xu et al. 2022, App. B.1, Fig. 2).

For a client ``i`` of the previous round's cohort ``C^(t-1)``, with the global model ``theta^(t-1)`` that
round produced and the local models ``theta^(t,j)`` that round ``t``'s clients ``j in C^(t)`` trained from it::

    loss^(t-1)(i) = (1/|D_i|) sum_{d in D_i} L_{theta^(t-1)}(d)
    loss^(t)(i)   = (1/|D_i|) sum_{d in D_i} (1/|C^(t)|) sum_{j in C^(t)} L_{theta^(t,j)}(d)

and the gap ``loss^(t)(i) - loss^(t-1)(i)``: how much round ``t``'s local training raises the loss on the data
that shaped the model it started from. ``L`` is the softmax cross-entropy.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from bfedjax.core.types import ClientData
from bfedjax.metrics.classification import evaluate


def client_losses(apply_fn: Callable, params, clients: ClientData) -> jax.Array:
    """``[P]``: the mean cross-entropy of ``params`` on each client's real rows (``metrics.evaluate``'s loss).

    Args:
      apply_fn: ``(params, x [n, ...]) -> logits [n, K]``.
      params: one model's parameters.
      clients: ``ClientData`` with leaves ``[P, n, ...]`` (``count [P]`` real rows each; a client with none
        gets 0).
    """
    def one(x, y, count):
        mask = (jnp.arange(y.shape[0]) < count).astype(jnp.float32)
        return evaluate(apply_fn, params, x, y, mask=mask)["loss"]

    return jax.vmap(one)(clients.x, clients.y, clients.count)


def forgetting_gap(apply_fn: Callable, global_params, local_params, local_mask: jax.Array,
                   previous: ClientData) -> jax.Array:
    """``[P]``: ``loss^(t)(i) - loss^(t-1)(i)`` for the previous round's clients ``i`` (module docstring).

    Args:
      apply_fn: ``(params, x [n, ...]) -> logits [n, K]``.
      global_params: ``theta^(t-1)``, the model round ``t`` started from.
      local_params: ``theta^(t,j)``, leaves ``[C, ...]``: round ``t``'s local models.
      local_mask: ``[C]``, 1 for a real local model, 0 for a padding slot (left out of the mean).
      previous: the previous cohort's training data, ``ClientData`` with leaves ``[P, n, ...]``; pass only its
        real clients (a client with no rows gets a gap of 0).
    """
    per_model = jax.vmap(lambda p: client_losses(apply_fn, p, previous))(local_params)  # [C, P]
    real = local_mask > 0
    after = (jnp.sum(jnp.where(real[:, None], per_model, 0.0), axis=0)
             / jnp.maximum(jnp.sum(real.astype(per_model.dtype)), 1.0))
    return after - client_losses(apply_fn, global_params, previous)
