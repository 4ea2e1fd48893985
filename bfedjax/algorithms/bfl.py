"""Federated mean-field BNNs with statistical aggregation (Fischer et al. 2024).

Clients run SVI steps of a NumPyro mean-field model (``vi.MeanFieldVI``) inside
the vmapped, scanned round; the server fuses the client Gaussians weight by
weight with one of the rules of ``posteriors.aggregation`` (NWA, WS, LP,
conflation/IV, WC, LLP, CLP, DWC) under one of the weightings of
``posteriors.weighting``. Deterministic leaves (biases by default) are
averaged with the same weights. With ``prior_update`` (and always for DWC)
each client's ELBO prior is the global posterior it received.

Server metrics every round: ``mean_posterior_scale`` (of the variational
leaves), ``dwc_guard_hits`` (weights whose DWC precision the guard changed)
and ``scale_floor_hits`` (scales raised to ``SCALE_MIN``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from bfedjax.core.types import Algorithm
from bfedjax.posteriors import aggregation
from bfedjax.posteriors import weighting as weightings
from bfedjax.posteriors.gaussian import DiagGaussian
from bfedjax.tasks import PREDICT_BATCH_SIZE, classification, in_batches
from bfedjax.vi.meanfield import MeanFieldConfig, MeanFieldVI

RULES = tuple(sorted(aggregation.RULES)) + ("dwc",)
SCALE_MIN = 1e-6  # floor of the aggregated posterior scale (the spec's recommendation)


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


def bfl(model, input_shape, *, rule: str = "wc", weighting: str = "by_size", prior_update: bool = False,
        lr: float = 1e-3, local_epochs: int = 1, batch_size: int = 32, dwc_guard: str = "conflation",
        dwc_floor_ratio: float = 1.0, prior_scale: float = 10.0, init_scale: float = MeanFieldConfig.init_scale,
        variational_biases: bool = False, train_samples: int = 1, test_samples: int = 10,
        gradient_estimator: str = "flipout", init_loc: str = MeanFieldConfig.init_loc,
        init_loc_std: float = MeanFieldConfig.init_loc_std) -> Algorithm:
    """Builds the algorithm.

    Args:
      model: a Flax classifier from the zoo; input_shape: one example's shape.
      rule: the aggregation rule (``RULES``). weighting: client weights (``posteriors.weighting.WEIGHTINGS``;
        ``"by_size"`` uses the engine's weights, pi_n = m_n / m unless the run sets ``client_weights``).
      prior_update: each client's ELBO prior is the global posterior it received (always on for DWC).
      dwc_guard, dwc_floor_ratio: how DWC treats weights whose Eq. 17 precision is not positive
        (``aggregation.distributed_weight_consolidation``).
      prior_scale, init_scale, variational_biases, train_samples, test_samples, gradient_estimator: the
        variational clients' ``vi.MeanFieldConfig``; ``lr`` is their Adam step.
      init_loc, init_loc_std: the initial posterior mean (``vi.MeanFieldConfig``, spec D4), which the
        ``init_params`` hook draws.

    The server state is ``{"params": loc, "scale": scale}``; GA evaluates the
    posterior mean, and ``predict`` is the MC predictive of the posterior.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; choose one of {RULES}")
    if dwc_guard not in aggregation.DWC_GUARDS:
        raise ValueError(f"dwc_guard={dwc_guard!r}; choose one of {aggregation.DWC_GUARDS}")
    if weighting not in weightings.WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}; choose one of {weightings.WEIGHTINGS}")
    config = MeanFieldConfig(prior_scale=prior_scale, init_scale=init_scale, variational_biases=variational_biases,
                             train_samples=train_samples, test_samples=test_samples, learning_rate=lr,
                             gradient_estimator=gradient_estimator, init_loc=init_loc, init_loc_std=init_loc_std)
    vi = MeanFieldVI(model, input_shape, config)
    use_prior = prior_update or rule == "dwc"

    def prior_args(server):
        if not use_prior:
            return ()
        return server["params"], jax.tree.map(lambda s: jnp.maximum(s, SCALE_MIN), _scale_or_one(server["scale"]))

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
        return vi.posterior(vi.svi.get_params(state), state.mutable_state), (), {}

    def client_weights(messages, weights, mask, server):
        if weighting == "uniform":
            return weightings.uniform(mask.shape[0], mask)
        if weighting == "by_size":
            return weights
        stacked = _variational_posterior(messages["params"], messages["scale"], vi.variational)
        if weighting.startswith("max_discrepancy"):
            return weightings.max_discrepancy(stacked, mask, literal=weighting.endswith("_literal"),
                                              symmetric=weighting.endswith("_symmetric"))
        global_posterior = _variational_posterior(server["params"], server["scale"], vi.variational)
        return weightings.distance(stacked, global_posterior, mask, reverse=weighting == "distance_reversed")

    def server_update(server, messages, weights, mask, hparams, key):
        del hparams, key
        w = client_weights(messages, weights, mask, server)
        _, det = _split(messages["params"], vi.variational)
        stacked = _variational_posterior(messages["params"], messages["scale"], vi.variational)
        hits = jnp.zeros((), jnp.int32)
        if rule == "dwc":
            prior = _variational_posterior(server["params"], server["scale"], vi.variational)
            fused, hits = aggregation.distributed_weight_consolidation(stacked, w, prior, dwc_guard, dwc_floor_ratio,
                                                                       mask=mask)
        else:
            fused = aggregation.aggregate(rule, stacked, w, mask=mask)
        scale = {p: jax.lax.rsqrt(prec) for p, prec in fused.precision.items()}
        floor_hits = sum(jnp.sum(s < SCALE_MIN) for s in scale.values())
        scale = {p: jnp.maximum(s, SCALE_MIN) for p, s in scale.items()}
        det_mean = {p: jnp.tensordot(w, v, 1) for p, v in det.items()}
        params = traverse_util.unflatten_dict({**fused.mean, **det_mean})
        scales = traverse_util.unflatten_dict({**scale, **{p: jnp.zeros_like(v) for p, v in det_mean.items()}})
        variational_scales, _ = _split(scales, vi.variational)
        mean_scale = jnp.mean(jnp.concatenate([s.ravel() for s in variational_scales.values()]))
        return {"params": params, "scale": scales}, {"mean_posterior_scale": mean_scale,
                                                      "dwc_guard_hits": jnp.asarray(hits, jnp.int32),
                                                      "scale_floor_hits": jnp.asarray(floor_hits, jnp.int32)}

    def predict(server, x, key, num_samples: int):
        return in_batches(lambda xb: vi.predict_proba(server, xb, key, num_samples), x, PREDICT_BATCH_SIZE)

    def init_params(key, shape):
        if tuple(shape) != vi.input_shape:
            raise ValueError(f"bfl was built for inputs of shape {vi.input_shape}, the data's are {tuple(shape)}; "
                             f"fix: bfl(model, input_shape={tuple(shape)})")
        return vi.init_params(key)

    task = classification(model)
    return Algorithm(
        name=f"bfl_{rule}", server_init=vi.posterior_from_params, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update, evaluate=task.evaluate, predict=predict,
        init_params=init_params, hparams={"lr": lr}, local_epochs=local_epochs, batch_size=batch_size)


def _scale_or_one(scale_tree):
    """Deterministic leaves carry scale 0; the prior only reads variational leaves, so any value works."""
    return jax.tree.map(lambda s: jnp.where(s > 0, s, 1.0), scale_tree)
