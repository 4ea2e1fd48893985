"""FedCurv (Shoham et al. 2019), in two forms.

``variant="authors"`` (default; as the FOLA authors ran it): local loss
CE + lam/2 * sum (omega_S / r) (theta - theta_S)^2 with clip 10; after local
training a one-pass offline Fisher omega_n at the final weights; the server
sends theta_S = sum pi_n theta_n and omega_S = sum pi_n omega_n.

``variant="leave_one_out"`` (Shoham et al.): client n is pulled towards every
*other* client's last model with that client's Fisher,
lam/2 * sum_{k != n} omega_k (theta - theta_k)^2, which equals a quadratic with
precision U - u_n and centre (V - v_n) / (U - u_n), where the server keeps
U = sum_k omega_k and V = sum_k omega_k * theta_k over every client's latest
upload and each client remembers its own (u_n, v_n) as persistent state.

``variant="previous_round"`` (the FedReg authors' baseline, FedReg spec §2.9):
after local training each client sends its per-sample empirical Fisher F_i
at its trained theta_i; the server keeps the sums A = sum_i F_i and
B = sum_i F_i * theta_i over the *previous round's* cohort only (own term
included, nothing accumulated), and the next round's local loss adds
lam * sum (theta^2 A - 2 theta B), i.e. lam * sum_i F_i (theta - theta_i)^2 up to
a constant: a quadratic with precision 2A and centre B / A. Round 1 has A = 0.
Run it with ``estimator="per_sample_sq"`` and ``clip_norm=None`` as they did.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.models.apply import apply_fn_of
from bfedjax.core.tree import tree_sub, tree_zeros_like, weighted_sum
from bfedjax.core.types import Algorithm, server_update_from_stats
from bfedjax.laplace.fisher import offline_fisher
from bfedjax.posteriors.aggregation import weighted_mean

VARIANTS = ("authors", "leave_one_out", "previous_round")


def fedcurv(model, *, lam: float = 100.0, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 32,
            variant: str = "authors", estimator: str = "batch_mean_sq", clip_norm: float | None = 10.0,
            eps: float = 1e-8, momentum: float = 0.0, dp_clip: float | None = None,
            dp_noise: float = 0.0) -> Algorithm:
    if variant not in VARIANTS:
        raise ValueError(f"FedCurv variant={variant!r}; choose one of {VARIANTS}")
    if variant == "previous_round":
        return _previous_round_fedcurv(model, lam=lam, lr=lr, local_epochs=local_epochs, batch_size=batch_size,
                                       estimator=estimator, clip_norm=clip_norm, momentum=momentum,
                                       dp_clip=dp_clip, dp_noise=dp_noise)
    apply_fn = apply_fn_of(model)
    loo = variant == "leave_one_out"

    def prior(ctx):
        server = ctx.server
        if not loo:
            r = ctx.hparams["round"].astype(jnp.float32)
            return server["params"], jax.tree.map(lambda w: w / r, server["precision"])
        own_u, own_v = ctx.persistent["u"], ctx.persistent["v"]
        precision = jax.tree.map(lambda u, o: jnp.maximum(u - o, 0.0), server["u_sum"], own_u)
        center = jax.tree.map(lambda v, o, p: (v - o) / (p + eps), server["v_sum"], own_v, precision)
        return center, precision

    client_init, client_step = make_sgd_client(model, prior_fn=prior, clip_norm=clip_norm, momentum=momentum,
                                               dp_clip=dp_clip, dp_noise=dp_noise)

    def client_final(local, ctx):
        fisher = offline_fisher(apply_fn, local.params, ctx.data, batch_size, estimator)
        if not loo:
            return {"params": local.params, "precision": fisher}, ()
        v = jax.tree.map(jnp.multiply, fisher, local.params)
        message = {"params": local.params,
                   "delta_u": tree_sub(fisher, ctx.persistent["u"]),
                   "delta_v": tree_sub(v, ctx.persistent["v"])}
        return message, {"u": fisher, "v": v}

    def server_init(params):
        if not loo:
            return {"params": params, "precision": tree_zeros_like(params)}
        return {"params": params, "u_sum": tree_zeros_like(params), "v_sum": tree_zeros_like(params)}

    def client_stats(message):  # authors' variant: weighted means of weights and Fishers
        return {"params": message["params"], "precision": message["precision"]}

    def server_from_stats(server, stats, hparams):
        del server, hparams
        return stats

    def loo_server_update(server, messages, weights, hparams):
        del hparams
        params = weighted_mean(messages["params"], weights)
        real = (weights > 0).astype(jnp.float32)
        add = lambda total, delta: jax.tree.map(jnp.add, total, weighted_sum(delta, real))
        return {"params": params, "u_sum": add(server["u_sum"], messages["delta_u"]),
                "v_sum": add(server["v_sum"], messages["delta_v"])}

    persistent_init = (lambda params: {"u": tree_zeros_like(params), "v": tree_zeros_like(params)}) if loo else None
    return Algorithm(
        name="fedcurv", model=model,
        server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final,
        server_update=loo_server_update if loo else server_update_from_stats(client_stats, server_from_stats),
        global_params=lambda server: server["params"],
        local_epochs=local_epochs, batch_size=batch_size, hparams={"lr": lr, "lam": lam},
        persistent_init=persistent_init,
        client_stats=None if loo else client_stats, server_from_stats=None if loo else server_from_stats)


def _previous_round_fedcurv(model, *, lam, lr, local_epochs, batch_size, estimator, clip_norm, momentum,
                            dp_clip, dp_noise) -> Algorithm:
    """FedCurv as the FedReg authors ran it (see the module docstring)."""
    apply_fn = apply_fn_of(model)

    def prior(ctx):
        a, b = ctx.server["fisher_sum"], ctx.server["weighted_sum"]
        center = jax.tree.map(lambda a_, b_: jnp.where(a_ > 0, b_ / jnp.where(a_ > 0, a_, 1.0), 0.0), a, b)
        return center, jax.tree.map(lambda a_: 2.0 * a_, a)

    client_init, client_step = make_sgd_client(model, prior_fn=prior, clip_norm=clip_norm, momentum=momentum,
                                               dp_clip=dp_clip, dp_noise=dp_noise)

    def client_final(local, ctx):
        fisher = offline_fisher(apply_fn, local.params, ctx.data, batch_size, estimator)
        return {"params": local.params, "fisher": fisher}, ()

    def server_init(params):
        return {"params": params, "fisher_sum": tree_zeros_like(params), "weighted_sum": tree_zeros_like(params)}

    def server_update(server, messages, weights, hparams):
        del server, hparams
        real = (weights > 0).astype(jnp.float32)
        weighted = jax.tree.map(jnp.multiply, messages["fisher"], messages["params"])
        return {"params": weighted_mean(messages["params"], weights),
                "fisher_sum": weighted_sum(messages["fisher"], real), "weighted_sum": weighted_sum(weighted, real)}

    return Algorithm(
        name="fedcurv", model=model, server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update, global_params=lambda server: server["params"],
        local_epochs=local_epochs, batch_size=batch_size, hparams={"lr": lr, "lam": lam})
