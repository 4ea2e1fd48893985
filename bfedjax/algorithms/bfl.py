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
and ``scale_floor_hits`` (scales raised to the floor ``scale_min``, ``SCALE_MIN`` by default).

GA and LA (the evaluate hook, every evaluated round) score the posterior's MC predictive, ``eval_samples``
weight samples averaged (Eq. 7): accuracy of its argmax and NLL -log p_bar[y] as ``loss`` (spec D9), the
quantities of the paper's curves. Every evaluation draws from the same key, so rounds and clients are compared
on common random numbers; ``eval_samples=0`` scores the posterior mean in one pass instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from bfedjax.core.types import Algorithm
from bfedjax.metrics.classification import MC_EVAL_SAMPLES, MC_EVAL_SEED, predictive_evaluate
from bfedjax.posteriors import aggregation
from bfedjax.posteriors import weighting as weightings
from bfedjax.posteriors.gaussian import DiagGaussian
from bfedjax.tasks import PREDICT_BATCH_SIZE, classification, in_batches
from bfedjax.vi.meanfield import MeanFieldConfig, MeanFieldVI

RULES = tuple(sorted(aggregation.RULES)) + ("dwc",)
UNWEIGHTED_RULES = ("conflation", "iv", "dwc")  # fuse the variational leaves whatever the client weights
SCALE_MIN = 1e-6  # floor of the aggregated posterior scale (the spec's recommendation)
KL_DIVISORS = ("client", "federation")  # the KL per mini-batch over |D_k| or over |D| (spec D5)


def kl_weight(count, round_index, *, divisor: str = "client", total_size: int | None = None, beta=1.0,
              anneal_rounds: int = 0):
    """The factor on a client's KL term (spec D5), relative to the paper's loss ``CE + KL / |D_k|``.

    ``count``: the client's ``|D_k|`` (``[]``); ``round_index``: the round, from 1 (``[]``, may be
    traced). ``divisor="federation"`` gives ``CE + KL / |D|`` with ``|D| = total_size``, i.e. the
    factor ``|D_k| / |D|``; ``beta`` multiplies the KL (an explicit beta); ``anneal_rounds > 0``
    ramps it linearly, ``beta * min(1, r / anneal_rounds)`` (KL annealing over rounds).
    """
    weight = jnp.asarray(beta, jnp.float32)
    if divisor == "federation":
        weight = weight * count / total_size
    if anneal_rounds > 0:
        weight = weight * jnp.minimum(1.0, jnp.asarray(round_index, jnp.float32) / anneal_rounds)
    return weight


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
        variational_biases: bool = False, train_samples: int = 1, test_samples: int = 50,
        eval_samples: int = MC_EVAL_SAMPLES,
        gradient_estimator: str = "flipout", init_loc: str = MeanFieldConfig.init_loc,
        init_loc_std: float = MeanFieldConfig.init_loc_std, kl_divisor: str = "client",
        total_size: int | None = None, kl_beta: float = 1.0, kl_anneal_rounds: int = 0,
        scale_min: float = SCALE_MIN, optimizer: str = "adam", momentum: float = 0.0,
        prior_temperature: float = 1.0) -> Algorithm:
    """Builds the algorithm.

    Args:
      model: a Flax classifier from the zoo; input_shape: one example's shape.
      rule: the aggregation rule (``RULES``). weighting: client weights (``posteriors.weighting.WEIGHTINGS``;
        ``"by_size"`` uses the engine's weights, pi_n = m_n / m unless the run sets ``client_weights``).
      prior_update: each client's ELBO prior is the global posterior it received (always on for DWC).
      prior_temperature: tau in (0, 1]: with ``prior_update``, the prior is the global posterior tempered
        toward N(0, ``prior_scale``^2), the product ``q_g^tau N(0, prior_scale^2)^(1 - tau)`` per weight
        (spec D18's option; 1: ``q_g`` itself).
      dwc_guard, dwc_floor_ratio: how DWC treats weights whose Eq. 17 precision is not positive
        (``aggregation.distributed_weight_consolidation``).
      prior_scale, init_scale, variational_biases, train_samples, test_samples, gradient_estimator: the
        variational clients' ``vi.MeanFieldConfig``; ``lr`` is their optimiser's step.
      eval_samples: M of the per-round GA / LA MC predictive (spec D9: 50); 0 scores the posterior mean
        (one pass, M times cheaper).
      optimizer, momentum: the clients' optimiser (spec D7): ``"adam"`` (default) or ``"sgd"`` with
        heavy-ball ``momentum``; its state starts afresh every round. Both step on spec D5's per-sample
        loss, ``mean CE + KL / |D_k|`` (SGD: ``lr / |D_k|`` on SVI's whole-data negative ELBO).
      scale_min: the floor of the aggregated posterior scale (spec D2; ``SCALE_MIN`` = 1e-6); the
        ``scale_floor_hits`` metric counts the weights raised to it.
      init_loc, init_loc_std: the initial posterior mean (``vi.MeanFieldConfig``, spec D4), which the
        ``init_params`` hook draws.
      kl_divisor, total_size, kl_beta, kl_anneal_rounds: the KL weight per mini-batch (spec D5,
        ``kl_weight``): the loss is ``CE + KL / |D_k|`` by default; ``kl_divisor="federation"`` divides
        by the federation's ``total_size`` ``|D|`` instead (``build(..., fed=...)`` fills it);
        ``kl_beta`` multiplies the KL (a round hyper-parameter, so ``simulate(hparams_fn=...)`` can
        schedule it); ``kl_anneal_rounds`` ramps it linearly from ``kl_beta / kl_anneal_rounds``
        in round 1 to ``kl_beta`` from round ``kl_anneal_rounds`` on.

    The server state and every message are ``{"params": loc, "scale": scale}``; GA and LA score their MC
    predictive (``eval_samples``), and ``predict`` is the global posterior's MC predictive.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; choose one of {RULES}")
    if dwc_guard not in aggregation.DWC_GUARDS:
        raise ValueError(f"dwc_guard={dwc_guard!r}; choose one of {aggregation.DWC_GUARDS}")
    if weighting not in weightings.WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}; choose one of {weightings.WEIGHTINGS}")
    if kl_divisor not in KL_DIVISORS:
        raise ValueError(f"kl_divisor={kl_divisor!r}; choose one of {KL_DIVISORS}")
    if kl_divisor == "federation" and not (total_size or 0) > 0:
        raise ValueError("kl_divisor='federation' needs the federation's size; fix: pass total_size=|D| "
                         "or build the algorithm with fed=...")
    if not kl_beta > 0:
        raise ValueError(f"kl_beta={kl_beta} must be > 0, e.g. 1.0 (the paper's KL / |D_k|)")
    if not scale_min > 0:
        raise ValueError(f"scale_min={scale_min} must be > 0, e.g. {SCALE_MIN}")
    if not 0 < prior_temperature <= 1:
        raise ValueError(f"prior_temperature={prior_temperature} must be in (0, 1] (1: the global posterior itself)")
    if prior_temperature < 1 and not (prior_update or rule == "dwc"):
        raise ValueError(f"prior_temperature={prior_temperature} tempers the updated prior; fix: add prior_update=True")
    if eval_samples < 0:
        raise ValueError(f"eval_samples={eval_samples} must be >= 0 (0: score the posterior mean; spec D9: 50)")
    if kl_anneal_rounds < 0:
        raise ValueError(f"kl_anneal_rounds={kl_anneal_rounds} must be >= 0 (0: no annealing)")
    config = MeanFieldConfig(prior_scale=prior_scale, init_scale=init_scale, variational_biases=variational_biases,
                             train_samples=train_samples, test_samples=test_samples, learning_rate=lr,
                             gradient_estimator=gradient_estimator, init_loc=init_loc, init_loc_std=init_loc_std,
                             optimizer=optimizer, momentum=momentum)
    vi = MeanFieldVI(model, input_shape, config)
    use_prior = prior_update or rule == "dwc"

    def prior_args(server):
        if not use_prior:
            return ()
        scale = jax.tree.map(lambda s: jnp.maximum(s, scale_min), _scale_or_one(server["scale"]))
        if prior_temperature == 1:
            return server["params"], scale
        return tempered_prior(server["params"], scale, prior_temperature, prior_scale)

    def client_kl_weight(ctx):
        return kl_weight(ctx.data.count.astype(jnp.float32), ctx.hparams["round"], divisor=kl_divisor,
                         total_size=total_size, beta=ctx.hparams["kl_beta"], anneal_rounds=kl_anneal_rounds)

    def client_init(ctx, key):
        d = ctx.data
        rows = min(batch_size, d.y.shape[0])
        count = d.count.astype(jnp.float32)
        # SVI's init traces the model on a batch for its shapes; the values do not enter the state, and zeros keep
        # data.augmented's pass over the client's data (for initial passes that read it, FedReg's) out of the round
        state = vi.init_svi_state(key, jnp.zeros_like(d.x[:rows]), d.y[:rows], count, ctx.server,
                                  *prior_args(ctx.server), kl_weight=client_kl_weight(ctx))
        # SVI's loss is the negative ELBO of the client's whole data, |D_k| times spec D5's per-sample loss (mean CE
        # + KL / |D_k|): Adam's steps do not see the factor, SGD's step is lr / |D_k| on it
        lr = ctx.hparams["lr"] / jnp.maximum(count, 1.0) if optimizer == "sgd" else ctx.hparams["lr"]
        return vi.with_learning_rate(state, lr)  # traced: a schedule never recompiles

    def client_step(state, batch, ctx, key):
        del key  # SVI carries its own per-client key
        state, _ = vi.svi.update(state, batch.x, batch.y, batch.mask, ctx.data.count.astype(jnp.float32),
                                 *prior_args(ctx.server), kl_weight=client_kl_weight(ctx))
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
            prior = _variational_posterior(*prior_args(server), vi.variational)  # the clients' ELBO prior
            fused, hits = aggregation.distributed_weight_consolidation(stacked, w, prior, dwc_guard, dwc_floor_ratio,
                                                                       mask=mask)
        else:
            fused = aggregation.aggregate(rule, stacked, w, mask=mask)
        scale = {p: jax.lax.rsqrt(prec) for p, prec in fused.precision.items()}
        floor_hits = sum(jnp.sum(s < scale_min) for s in scale.values())
        scale = {p: jnp.maximum(s, scale_min) for p, s in scale.items()}
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

    eval_key = jax.random.PRNGKey(MC_EVAL_SEED)

    def evaluate_predictive(posterior, x, y, mask=None):
        return predictive_evaluate(lambda xb: vi.predict_proba(posterior, xb, eval_key, eval_samples), x, y, mask=mask)

    def posterior_of(state):
        return {"params": state["params"], "scale": state["scale"]}

    task = classification(model)
    mc = eval_samples > 0
    return Algorithm(
        name=f"bfl_{rule}", server_init=vi.posterior_from_params, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update, evaluated_model=posterior_of if mc else None,
        evaluate=evaluate_predictive if mc else task.evaluate, predict=predict,
        init_params=init_params, hparams={"lr": lr, "kl_beta": kl_beta}, local_epochs=local_epochs,
        batch_size=batch_size)


def tempered_prior(loc, scale, temperature: float, prior_scale: float):
    """``(loc, scale)`` trees of ``N(loc, scale^2)^t N(0, prior_scale^2)^(1 - t)``, normalised, per weight.

    Precision ``t / scale^2 + (1 - t) / prior_scale^2``, mean ``(t loc / scale^2) / precision``.
    """
    def one(m, s):
        precision = temperature / jnp.square(s) + (1.0 - temperature) / prior_scale ** 2
        return temperature * m / jnp.square(s) / precision, jax.lax.rsqrt(precision)
    pairs = jax.tree.map(one, loc, scale)
    is_pair = lambda x: isinstance(x, tuple)
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair), jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))


def _scale_or_one(scale_tree):
    """Deterministic leaves carry scale 0; the prior only reads variational leaves, so any value works."""
    return jax.tree.map(lambda s: jnp.where(s > 0, s, 1.0), scale_tree)
