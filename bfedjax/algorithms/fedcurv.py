"""FedCurv (Shoham et al. 2019), in three forms.

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

``variant="previous_round"`` (the FedReg authors' baseline, as their code runs it):
after local training each client sends its per-sample empirical Fisher F_i
at its trained theta_i; the server keeps the sums A = sum_i F_i and
B = sum_i F_i * theta_i over the *previous round's* cohort only (own term
included, nothing accumulated), and the next round's local loss adds
lam * sum (theta^2 A - 2 theta B), i.e. lam * sum_i F_i (theta - theta_i)^2 up to
a constant: a quadratic with precision 2A and centre B / A. Round 1 has A = 0.
Its defaults are theirs: a per-sample Fisher (``fisher="per_sample_sq"``) and
no clipping; the other forms default to ``batch_mean_sq`` and clip 10.

Sums over "every client" count the cohort's real clients (``mask``), whatever
their aggregation weight: a client weighted zero still trains and updates its
own (u_n, v_n), so U and V must move with it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core.types import Algorithm
from bfedjax.laplace.fisher import FISHER_ESTIMATORS, offline_fisher
from bfedjax.models.apply import apply_fn_of
from bfedjax.posteriors.aggregation import weighted_mean
from bfedjax.tasks import classification
from bfedjax.tree import tree_sub, tree_zeros_like, weighted_sum

VARIANTS = ("authors", "leave_one_out", "previous_round")
VARIANT_DEFAULT = "variant default"  # fisher / clip_norm: per_sample_sq and no clip for previous_round, else
#                                     batch_mean_sq and clip 10


def fedcurv(model, *, lam: float = 100.0, lr: float = 0.01, local_epochs: int = 1, batch_size: int = 32,
            variant: str = "authors", fisher: str = VARIANT_DEFAULT, clip_norm: float | None | str = VARIANT_DEFAULT,
            eps: float = 1e-8, momentum: float = 0.0, dp_clip: float | None = None,
            dp_noise: float = 0.0) -> Algorithm:
    """FedCurv in the form ``variant`` (see the module docstring); ``clip_norm=None`` turns clipping off."""
    if variant not in VARIANTS:
        raise ValueError(f"FedCurv variant={variant!r}; choose one of {VARIANTS}")
    previous = variant == "previous_round"
    if fisher == VARIANT_DEFAULT:
        fisher = "per_sample_sq" if previous else "batch_mean_sq"
    if clip_norm == VARIANT_DEFAULT:
        clip_norm = None if previous else 10.0
    if fisher not in FISHER_ESTIMATORS:
        raise ValueError(f"FedCurv fisher={fisher!r}; choose one of {FISHER_ESTIMATORS}")
    if variant == "previous_round":
        return _previous_round_fedcurv(model, lam=lam, lr=lr, local_epochs=local_epochs, batch_size=batch_size,
                                       fisher=fisher, clip_norm=clip_norm, momentum=momentum,
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
        omega = offline_fisher(apply_fn, local.params, ctx.data, batch_size, fisher)
        if not loo:
            return {"params": local.params, "precision": omega}, (), {}
        v = jax.tree.map(jnp.multiply, omega, local.params)
        message = {"params": local.params,
                   "delta_u": tree_sub(omega, ctx.persistent["u"]),
                   "delta_v": tree_sub(v, ctx.persistent["v"])}
        return message, {"u": omega, "v": v}, {}

    def server_init(params):
        if not loo:
            return {"params": params, "precision": tree_zeros_like(params)}
        return {"params": params, "u_sum": tree_zeros_like(params), "v_sum": tree_zeros_like(params)}

    def client_stats(message):  # authors' variant: weighted means of weights and Fishers
        return {"params": message["params"], "precision": message["precision"]}

    def server_from_stats(server, stats, mask, hparams, key):
        del server, mask, hparams, key
        return stats, {}

    def loo_server_update(server, messages, weights, mask, hparams, key):
        del hparams, key
        params = weighted_mean(messages["params"], weights)
        add = lambda total, delta: jax.tree.map(jnp.add, total, weighted_sum(delta, mask))
        return {"params": params, "u_sum": add(server["u_sum"], messages["delta_u"]),
                "v_sum": add(server["v_sum"], messages["delta_v"])}, {}

    common = dict(name="fedcurv", server_init=server_init, client_init=client_init, client_step=client_step,
                  client_final=client_final, hparams={"lr": lr, "lam": lam}, local_epochs=local_epochs,
                  batch_size=batch_size, **classification(model).hooks())
    if loo:
        return Algorithm(server_update=loo_server_update,
                         persistent_init=lambda params, key, group: {"u": tree_zeros_like(params), "v": tree_zeros_like(params)},
                         **common)
    return Algorithm(client_stats=client_stats, server_from_stats=server_from_stats, **common)


def _previous_round_fedcurv(model, *, lam, lr, local_epochs, batch_size, fisher, clip_norm, momentum,
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
        return {"params": local.params, "fisher": offline_fisher(apply_fn, local.params, ctx.data, batch_size, fisher)}, (), {}

    def server_init(params):
        return {"params": params, "fisher_sum": tree_zeros_like(params), "weighted_sum": tree_zeros_like(params)}

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        weighted = jax.tree.map(jnp.multiply, messages["fisher"], messages["params"])
        return {"params": weighted_mean(messages["params"], weights),
                "fisher_sum": weighted_sum(messages["fisher"], mask),
                "weighted_sum": weighted_sum(weighted, mask)}, {}

    return Algorithm(
        name="fedcurv", server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update, hparams={"lr": lr, "lam": lam},
        local_epochs=local_epochs, batch_size=batch_size, **classification(model).hooks())
