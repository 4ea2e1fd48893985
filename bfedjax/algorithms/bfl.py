"""Federated mean-field BNNs with statistical aggregation (Fischer et al. 2024).

Clients run SVI steps of a NumPyro mean-field model (``vi.MeanFieldVI``) inside
the vmapped, scanned round; the server fuses the client Gaussians weight by
weight with one of the rules of ``posteriors.aggregation`` (NWA, WS, LP,
conflation/IV, WC, LLP, CLP, DWC) under one of the weightings of
``posteriors.weighting``. Deterministic leaves (biases by default) are
averaged with the same weights. With ``prior_update`` (and always for DWC)
each client's ELBO prior is the global posterior it received.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import traverse_util

from bfedjax.core.types import Algorithm
from bfedjax.posteriors import aggregation, weighting
from bfedjax.posteriors.gaussian import DiagGaussian
from bfedjax.vi.meanfield import MeanFieldConfig, MeanFieldVI

RULES = tuple(sorted(aggregation.RULES)) + ("dwc",)
SCALE_MIN = 1e-6  # spec D2


def _split(tree, variational):
    flat = traverse_util.flatten_dict(tree)
    var = {p: v for p, v in flat.items() if ".".join(p) in variational}
    det = {p: v for p, v in flat.items() if ".".join(p) not in variational}
    return var, det


def _variational_posterior(loc_tree, scale_tree, variational) -> DiagGaussian:
    """The variational leaves of ``{"params", "scale"}`` trees as a flat-keyed ``DiagGaussian``."""
    loc, _ = _split(loc_tree, variational)
    scale, _ = _split(scale_tree, variational)
    return DiagGaussian(loc, {p: 1.0 / jnp.square(s) for p, s in scale.items()})


def bfl(model, input_shape, *, rule: str = "wc", weighting_scheme: str = "train_size", prior_update: bool = False,
        lr: float = 1e-3, local_epochs: int = 1, batch_size: int = 32, dwc_guard: str = "conflation",
        dwc_floor_ratio: float = 1.0, **vi_options) -> Algorithm:
    """Builds the algorithm. ``vi_options`` are ``MeanFieldConfig`` fields (prior_scale, init_scale, ...).

    ``dwc_guard`` / ``dwc_floor_ratio``: how DWC treats weights whose Eq. 17
    precision is not positive (``aggregation.distributed_weight_consolidation``).

    The server state is ``{"params": loc, "scale": scale, ...}``; GA evaluates the
    posterior mean, and ``vi.MeanFieldVI(model, input_shape).predict_proba``
    gives the MC predictive for the uncertainty metrics.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; choose one of {RULES}")
    if dwc_guard not in aggregation.DWC_GUARDS:
        raise ValueError(f"dwc_guard={dwc_guard!r}; choose one of {aggregation.DWC_GUARDS}")
    if weighting_scheme not in weighting.WEIGHTINGS:
        raise ValueError(f"weighting_scheme={weighting_scheme!r}; choose one of {weighting.WEIGHTINGS}")
    vi = MeanFieldVI(model, input_shape, dataclasses.replace(MeanFieldConfig(learning_rate=lr), **vi_options))
    use_prior = prior_update or rule == "dwc"

    def prior_args(server):
        if not use_prior:
            return ()
        return server["params"], jax.tree.map(lambda s: jnp.maximum(s, SCALE_MIN), _scale_or_one(server["scale"]))

    def server_init(params):
        return {**vi.posterior_from_params(params),
                "guard_hits": jnp.zeros((), jnp.int32), "scale_floor_hits": jnp.zeros((), jnp.int32)}

    def client_init(ctx, key):
        d = ctx.data
        rows = min(batch_size, d.y.shape[0])
        state = vi.init_svi_state(key, d.x[:rows], d.y[:rows], d.count.astype(jnp.float32), ctx.server,
                                  *prior_args(ctx.server))
        return vi.with_learning_rate(state, ctx.hparams["lr"])  # traced: a schedule never recompiles

    def client_step(state, batch, ctx, key):
        del key  # SVI carries its own per-client key
        state, _ = vi.svi.update(state, batch.x, batch.y, batch.mask, ctx.data.count.astype(jnp.float32),
                                 *prior_args(ctx.server))
        return state

    def client_final(state, ctx):
        del ctx
        return vi.posterior(vi.svi.get_params(state), state.mutable_state), ()

    def client_weights(messages, weights, server):
        mask = (weights > 0).astype(jnp.float32)
        if weighting_scheme == "equal":
            return weighting.equal(mask.shape[0], mask)
        if weighting_scheme == "train_size":
            return weights
        stacked = _variational_posterior(messages["params"], messages["scale"], vi.variational)
        if weighting_scheme == "max_discrepancy":
            return weighting.max_discrepancy(stacked, mask)
        return weighting.distance(stacked, _variational_posterior(server["params"], server["scale"], vi.variational),
                                  mask)

    def server_update(server, messages, weights, hparams):
        del hparams
        w = client_weights(messages, weights, server)
        _, det = _split(messages["params"], vi.variational)
        stacked = _variational_posterior(messages["params"], messages["scale"], vi.variational)
        hits = jnp.zeros((), jnp.int32)
        if rule == "dwc":
            prior = _variational_posterior(server["params"], server["scale"], vi.variational)
            fused, hits = aggregation.distributed_weight_consolidation(stacked, w, prior, dwc_guard, dwc_floor_ratio)
        else:
            fused = aggregation.aggregate(rule, stacked, w)
        scale = {p: jax.lax.rsqrt(prec) for p, prec in fused.precision.items()}
        floor_hits = sum(jnp.sum(s < SCALE_MIN) for s in scale.values())
        scale = {p: jnp.maximum(s, SCALE_MIN) for p, s in scale.items()}
        det_mean = {p: jnp.tensordot(w, v, 1) for p, v in det.items()}
        params = traverse_util.unflatten_dict({**fused.mean, **det_mean})
        scales = traverse_util.unflatten_dict({**scale, **{p: jnp.zeros_like(v) for p, v in det_mean.items()}})
        return {"params": params, "scale": scales, "guard_hits": jnp.asarray(hits, jnp.int32),
                "scale_floor_hits": jnp.asarray(floor_hits, jnp.int32)}

    def diagnostics(server):
        var_scale, _ = _split(server["scale"], vi.variational)
        flat = jnp.concatenate([s.ravel() for s in var_scale.values()])
        return {"mean_posterior_scale": jnp.mean(flat), "dwc_guard_hits": server["guard_hits"],
                "scale_floor_hits": server["scale_floor_hits"]}

    return Algorithm(
        name=f"bfl_{rule}", model=model,
        server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update,
        global_params=lambda server: server["params"],
        local_epochs=local_epochs, batch_size=batch_size, hparams={"lr": lr, "lam": 0.0},
        diagnostics=diagnostics)


def _scale_or_one(scale_tree):
    """Deterministic leaves carry scale 0; the prior only reads variational leaves, so any value works."""
    return jax.tree.map(lambda s: jnp.where(s > 0, s, 1.0), scale_tree)
