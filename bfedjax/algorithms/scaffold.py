"""SCAFFOLD (Karimireddy et al. 2020) with per-client control variates.

Client i keeps a control variate ``c_i`` (persistent state: the engine holds
all of them as ``[N, ...]`` arrays and gathers/scatters the cohort's rows);
the server keeps ``c``. Local steps correct the gradient by ``c - c_i``:

    y <- y - lr * (grad L_i(y) - c_i + c)

After ``K_i`` real steps (option II, the default and the FedReg authors'):

    c_i+ = c_i - c + (theta - y_i) / (K_i * lr)

(option I: ``c_i+ = grad L_i(theta)``, the client's full-data gradient at the
global model). The server moves ``theta`` by ``global_lr`` times the weighted
mean of ``y_i - theta`` and ``c <- c + (1/N) sum_{i in cohort} (c_i+ - c_i)``
with ``N`` the number of clients in the federation. The sum runs over the
cohort's real clients (``mask``) whatever their aggregation weight, so
``c = (1/N) sum_i c_i`` holds at every round.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.batching import ordered_pass
from bfedjax.core.types import Algorithm
from bfedjax.losses import masked_mean_cross_entropy
from bfedjax.models.apply import apply_fn_of
from bfedjax.tasks import classification
from bfedjax.tree import tree_sub, tree_zeros_like, weighted_sum

OPTIONS = ("II", "I")


def scaffold(model, *, num_clients: int, lr: float = 0.1, local_epochs: int = 1, batch_size: int = 32,
             option: str = "II", global_lr: float = 1.0, clip_norm: float | None = None) -> Algorithm:
    """SCAFFOLD; ``num_clients`` is the federation's N (the 1/N of the server's ``c`` update).

    Messages hold ``params`` (``y_i``) and ``control_delta`` (``c_i+ - c_i``);
    hyper-parameter ``lr`` is traced.
    """
    if option not in OPTIONS:
        raise ValueError(f"SCAFFOLD option={option!r}; choose one of {OPTIONS}")
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be the federation's client count (>= 1)")
    apply_fn = apply_fn_of(model)

    def correction(ctx):
        return tree_sub(ctx.server["control"], ctx.persistent)

    client_init, client_step = make_sgd_client(model, clip_norm=clip_norm, correction_fn=correction)

    def full_gradient(params, data):
        """Mean cross-entropy gradient over the client's real samples at ``params``."""
        def add(total, batch):
            g = jax.grad(masked_mean_cross_entropy, argnums=1)(apply_fn, params, batch)
            return jax.tree.map(lambda t, x: t + jnp.sum(batch.mask) * x, total, g)
        total = ordered_pass(add, tree_zeros_like(params), data, batch_size)
        return jax.tree.map(lambda t: t / jnp.maximum(data.count.astype(jnp.float32), 1.0), total)

    def client_final(local, ctx):
        theta, own = ctx.server["params"], ctx.persistent
        if option == "II":
            scale = 1.0 / (jnp.maximum(local.steps, 1).astype(jnp.float32) * ctx.hparams["lr"])
            new = jax.tree.map(lambda ci, c, t, y: ci - c + scale * (t - y), own, ctx.server["control"], theta,
                               local.params)
        else:
            new = full_gradient(theta, ctx.data)
        new = jax.tree.map(lambda n, o: jnp.where(local.steps > 0, n, o), new, own)  # empty slot: unchanged
        return {"params": local.params, "control_delta": tree_sub(new, own)}, new, {}

    def server_update(server, messages, weights, mask, hparams, key):
        del hparams, key
        mean = weighted_sum(messages["params"], weights)
        params = jax.tree.map(lambda t, m: t + global_lr * (m - t), server["params"], mean)
        control = jax.tree.map(lambda c, d: c + d / num_clients, server["control"],
                               weighted_sum(messages["control_delta"], mask))
        return {"params": params, "control": control}, {}

    return Algorithm(
        name="scaffold", server_init=lambda params: {"params": params, "control": tree_zeros_like(params)},
        client_init=client_init, client_step=client_step, client_final=client_final, server_update=server_update,
        persistent_init=lambda params, key, group: tree_zeros_like(params), hparams={"lr": lr}, local_epochs=local_epochs, batch_size=batch_size,
        **classification(model).hooks())
