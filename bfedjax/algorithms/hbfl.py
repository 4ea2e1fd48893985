"""HBFL (Yang, Yan and Ren 2023): Bayesian "meme" models aggregated by a precision-weighted product,
each client's private local model of any architecture distilled from its meme.

Every client holds two models. The **meme** has the server's architecture and is
a mean-field Gaussian network ``N(mu, diag softplus(rho)^2)`` over every weight
and bias. Each round it starts from the global mean ``mu_g`` and minimises the
tempered objective of Eq. 4.1 in the spec's form (spec section 2.4)

    L_meme(mu, rho) = E_eps[ NLL_k(mu + sigma * eps) ] - T * sum_j log sigma_j,

``NLL_k`` the client's *summed* cross-entropy (a mini-batch estimates it as
``n_k / B`` times the batch sum), one reparameterised sample per step, ``T =
1e-4``, by Adam. At a quadratic optimum ``sigma_j^2 = T / h_j``: the uploaded
precision ``1 / sigma^2`` is the client's curvature over ``T``. The **local
model** (``PrivateModels``: any architecture, per group; never sent) learns
``alpha CE + (1 - alpha) KL(q_meme || q_local)`` from the meme's predictions at
its mean, right after the meme's step on the same mini-batch (Algorithm 1).

The server takes the ``q_k``-weighted product of the uploaded Gaussians
(Eq. 3.12, ``posteriors.gaussian_product``): per coordinate
``mu_g = sum_k q_k lambda_k mu_k / sum_k q_k lambda_k`` with ``lambda_k =
1 / sigma_k^2``, ``q_k = n_k / n`` (or equal weights). Upload: ``mu`` and
``sigma`` (2d floats); download: ``mu_g`` (d floats).

Every row of the spec's decisions table that concerns the method is an
option, with the spec's default (see ``hbfl``'s arguments).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
import optax

from bfedjax import flat_random
from bfedjax.algorithms.private_models import PrivateModels, output_shape
from bfedjax.core.types import Algorithm, Batch, ClientContext
from bfedjax.losses import cross_entropy
from bfedjax.posteriors.aggregation import gaussian_product
from bfedjax.posteriors.gaussian import DiagGaussian, softplus_inverse
from bfedjax.metrics.classification import evaluate as classification_metrics
from bfedjax.tasks import EVAL_BATCH_SIZE, classification
from bfedjax.vi.flat_normal import FlatDrawNormal

SIGMA_MODES = ("reinit", "persist", "broadcast")
TEACHERS = ("mean", "sample", "mc")
WEIGHTINGS = ("by_size", "equal")
NLL_FORMS = ("sum", "mean")


def entropy_penalty(rho, temperature: float) -> jax.Array:
    """``-T * sum_j log softplus(rho_j)``: the tempered negative entropy of ``N(mu, softplus(rho)^2)`` up to a
    constant (the meme loss's second term; its gradient is ``-T sigmoid(rho) / softplus(rho)``)."""
    return -temperature * sum(jnp.sum(jnp.log(jax.nn.softplus(r))) for r in jax.tree.leaves(rho))


def _leaf_keys(key, tree):
    """One key per leaf of ``tree``, in its structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(list(jax.random.split(key, len(leaves))))


def sample_weights(meme: dict, key) -> dict:
    """One reparameterised draw of the meme's weights, ``mu + softplus(rho) * eps`` per leaf
    (NumPyro's ``Normal(mu, sigma).rsample``: gradients flow to ``mu`` and ``rho``)."""
    return jax.tree.map(lambda m, r, k: FlatDrawNormal(m, jax.nn.softplus(r)).rsample(k), meme["mu"], meme["rho"],
                        _leaf_keys(key, meme["mu"]))


def hbfl(model, *, input_shape: Sequence[int], local_models: Sequence | None = None, lr: float = 0.01,
         meme_lr: float = 1e-3, local_epochs: int = 5, batch_size: int = 128, temperature: float = 1e-4,
         alpha: float = 0.5, distill_temperature: float = 1.0, rho_init: float = -5.0, rho_init_std: float = 0.0,
         sigma: str = "reinit", reinit_local: bool = False, teacher: str = "mean", teacher_samples: int = 4,
         weight_decay: float = 5e-4, momentum: float = 0.9, meme_weight_decay: float = 5e-4,
         decay_rho: bool = False, weighting: str = "by_size", mc_samples: int = 1, nll: str = "sum",
         prior_scale: float | None = None, scale_floor: float = 1e-8,
         head_models: Sequence | None = None) -> Algorithm:
    """HBFL with meme architecture ``model`` and one local architecture per group.

    The options are the spec's section 3 decisions, with the spec's defaults.

    Args:
      model: the meme's (and the global model's) Flax classifier, e.g. ``models.CNN2``.
      input_shape: one example's shape (``build`` fills it from the data).
      local_models: one Flax classifier per architecture group (clients are mapped to
        groups by ``simulate(..., client_groups=...)``); ``None``: every client's local model
        has the meme's architecture (the common setting); ``()``: no local model, the
        "Bayesian aggregation only" ablation (meme and product, nothing distilled).
      lr: the local models' SGD step (0.01, momentum ``momentum`` 0.9, ``weight_decay`` 5e-4).
      local_epochs, batch_size: E and B of both models (the spec's section 4: 5 and 128).
      meme_lr: the meme's Adam step (1e-3); ``meme_weight_decay`` 5e-4 on ``mu`` only, or on
        ``mu`` and ``rho`` with ``decay_rho`` (Decision 8).
      temperature: the likelihood temperature T of Eq. 4.1 (1e-4).
      alpha, distill_temperature: Eq. 4.2's weight (0.5) and the distillation temperature
        (1; ``T^2`` factor above 1) (Decisions 5, 6).
      rho_init, rho_init_std: every ``rho`` starts at ``rho_init`` (-5, sigma ~ 0.0067) plus
        ``N(0, rho_init_std^2)`` noise (0; Bayes-by-Backprop uses 0.1) (Decision 2).
      sigma: ``"reinit"`` rho every round (Algorithm 1), ``"persist"`` each client's rho across
        rounds, or ``"broadcast"`` the global sigma and start from it (Decision 3).
      reinit_local: a fresh local model every round instead of the persisted one (Decision 4).
      teacher: the meme's predictions the local model learns from: at its ``"mean"`` weights,
        one ``"sample"``, or the ``"mc"`` average of ``teacher_samples`` (Decision 7).
      weighting: ``"by_size"`` q_k = n_k / n (the engine's client weights) or ``"equal"``
        q_k = 1, the exact product of Eq. 3.10 (Decision 9): the same mean as any equal weights, and
        the global variance of N equal clients sigma^2 / N.
      mc_samples: reparameterised samples per meme step (1).
      nll: ``"sum"`` (the n_k / B scaled summed NLL, entropy weight T) or ``"mean"`` (batch-mean
        CE, entropy weight T / n_k) (Decision 1).
      prior_scale: ``None`` (no prior term, Eq. 4.1) or sigma_p: the ``elbo_prior`` variant adds
        ``T KL(q || N(0, sigma_p^2))`` and uploads the likelihood precision
        ``1/sigma^2 - 1/sigma_p^2`` (clipped at 1e-12) as Eq. 3.8.
      scale_floor: sigma is floored here before inverting (1e-8).
      head_models: objective heterogeneity (Decision 13): ``model`` is then a shared trunk
        (``x -> features``) and the clients of group g keep a deterministic head
        ``head_models[g]`` (``features -> group g's labels``, its own label space) in their
        persistent state, trained by SGD (``lr``) on the features of the meme's mean and never
        sent; only the Bayesian trunk is aggregated. The global trunk has no classifier of its
        own, so there are no ``global_*`` metrics: clients are scored on their own test splits.
    Hyper-parameters (traced): ``lr``, ``meme_lr``.
    Server state: ``{"params": mu_g, "scale": Sigma_g^(1/2)}``; client metric ``mean_meme_scale``,
    server metric ``mean_global_scale``; per-client test metrics (with per-client test splits):
    ``accuracy`` = the best of meme and local model (as the paper reports), ``meme_accuracy``,
    ``local_model_accuracy``.
    """
    for name, value, choices in (("sigma", sigma, SIGMA_MODES), ("teacher", teacher, TEACHERS),
                                 ("weighting", weighting, WEIGHTINGS), ("nll", nll, NLL_FORMS)):
        if value not in choices:
            raise ValueError(f"hbfl: {name}={value!r}; choose one of {choices}")
    if temperature <= 0 or mc_samples < 1 or teacher_samples < 1:
        raise ValueError("hbfl: temperature must be > 0 and mc_samples, teacher_samples >= 1")
    if prior_scale is not None and prior_scale <= 0:
        raise ValueError(f"hbfl: prior_scale={prior_scale} must be > 0 (or None for no prior term)")
    meme_task = classification(model, eval_samples=0)  # one pass, as the heads' scores below
    apply_fn = meme_task.apply_fn
    heads = None
    if head_models is not None:
        heads = PrivateModels(head_models, output_shape(model, input_shape), weight_decay=weight_decay,
                              momentum=momentum)
        if local_models is None:
            raise ValueError("hbfl: with head_models give local_models too (one per group, with the group's "
                             "labels), or () for none")
    local_models = (model,) if local_models is None else tuple(local_models)
    private = PrivateModels(local_models, input_shape, alpha=alpha, temperature=distill_temperature,
                            weight_decay=weight_decay, momentum=momentum, reinit=reinit_local) if local_models else None
    adam = optax.scale_by_adam()

    def network(theta, x, head, group: int):
        """Logits of the meme with weights ``theta`` (through the client's head with ``head_models``)."""
        out = apply_fn(theta, x)
        return out if heads is None else heads.logits(head, out, group)

    def initial_rho(mu, key):
        rho = jax.tree.map(lambda m: jnp.full(jnp.shape(m), rho_init, jnp.result_type(m)), mu)
        if rho_init_std:
            rho = jax.tree.map(lambda r, k: r + rho_init_std * flat_random.normal(k, r.shape, r.dtype), rho,
                               _leaf_keys(key, mu))
        return rho

    def server_init(params):
        scale = jax.tree.map(jax.nn.softplus, initial_rho(params, jax.random.PRNGKey(0)))
        return {"params": params, "scale": scale}

    def persistent_init(params, key, group):
        k_local, k_rho = jax.random.split(key)
        state = {}
        if private is not None:
            state["local"] = private.init(k_local, group)
        if sigma == "persist":
            state["rho"] = initial_rho(params, k_rho)
        if heads is not None:
            state["head"] = heads.init(jax.random.fold_in(key, 1), group)
        return state

    def meme_loss(meme, batch: Batch, count, key, head, group):
        n_batch = jnp.maximum(jnp.sum(batch.mask), 1.0)
        scale = (count / n_batch) if nll == "sum" else 1.0 / n_batch

        def data_term(k):
            ce = cross_entropy(network(sample_weights(meme, k), batch.x, head, group), batch.y)
            return scale * jnp.sum(ce * batch.mask)

        expected_nll = jnp.mean(jax.vmap(data_term)(jax.random.split(key, mc_samples)))
        weight = temperature if nll == "sum" else temperature / jnp.maximum(count, 1)
        if prior_scale is None:
            return expected_nll + entropy_penalty(meme["rho"], weight)
        sigmas = jax.tree.map(jax.nn.softplus, meme["rho"])
        kl = sum(jnp.sum(dist.kl_divergence(dist.Normal(m, s), dist.Normal(0.0, prior_scale)))
                 for m, s in zip(jax.tree.leaves(meme["mu"]), jax.tree.leaves(sigmas)))
        return expected_nll + weight * kl

    def client_init(ctx: ClientContext, key):
        k_rho, k_local = jax.random.split(key)
        mu = ctx.server["params"]
        if sigma == "reinit":
            rho = initial_rho(mu, k_rho)
        elif sigma == "persist":
            rho = ctx.persistent["rho"]
        else:
            rho = jax.tree.map(softplus_inverse, ctx.server["scale"])
        meme = {"mu": mu, "rho": rho}
        state = {"meme": meme, "meme_opt": adam.init(meme)}
        if private is not None:
            state["local"] = private.start(ctx.persistent["local"], k_local, ctx.group)
        if heads is not None:
            state["head"] = ctx.persistent["head"]
        return state

    def teacher_logits(meme, x, key, head, group):
        if teacher == "mean":
            return network(meme["mu"], x, head, group)
        if teacher == "sample":
            return network(sample_weights(meme, key), x, head, group)
        probs = jax.vmap(lambda k: jax.nn.softmax(network(sample_weights(meme, k), x, head, group)))(
            jax.random.split(key, teacher_samples))
        return jnp.log(jnp.mean(probs, axis=0) + 1e-30)

    def client_step(state, batch: Batch, ctx: ClientContext, key):
        k_meme, k_teacher = jax.random.split(key)
        meme, head = state["meme"], state.get("head")
        grad = jax.grad(meme_loss)(meme, batch, ctx.data.count, k_meme, head, ctx.group)
        decayed = ("mu", "rho") if decay_rho else ("mu",)
        grad = {name: jax.tree.map(lambda g, w: g + meme_weight_decay * w, grad[name], meme[name])
                if name in decayed else grad[name] for name in grad}
        updates, meme_opt = adam.update(grad, state["meme_opt"], meme)
        meme = jax.tree.map(lambda w, u: w - ctx.hparams["meme_lr"] * u, meme, updates)
        new = {"meme": meme, "meme_opt": meme_opt}
        if heads is not None:  # the head: plain CE on the features of the updated meme's mean
            features = jax.lax.stop_gradient(apply_fn(meme["mu"], batch.x))
            new["head"] = head = heads.step(head, batch._replace(x=features), None, ctx.hparams["lr"], ctx.group)
        if private is not None:  # after the meme's step, on the same mini-batch (Algorithm 1)
            new["local"] = private.step(state["local"], batch, teacher_logits(meme, batch.x, k_teacher, head,
                                                                              ctx.group),
                                        ctx.hparams["lr"], ctx.group)
        return new

    def client_final(state, ctx: ClientContext):
        meme = state["meme"]
        scale = jax.tree.map(jax.nn.softplus, meme["rho"])
        persistent = {}
        if private is not None:
            persistent["local"] = state["local"]
        if sigma == "persist":
            persistent["rho"] = meme["rho"]
        if heads is not None:
            persistent["head"] = state["head"]
        leaves = jax.tree.leaves(scale)
        mean_scale = sum(jnp.sum(s) for s in leaves) / sum(s.size for s in leaves)
        return {"params": meme["mu"], "scale": scale}, persistent or (), {"mean_meme_scale": mean_scale}

    def precision_of(scale):
        precision = 1.0 / jnp.square(jnp.maximum(scale, scale_floor))
        if prior_scale is not None:  # the likelihood's precision: posterior minus prior (Eq. 3.8)
            precision = jnp.maximum(precision - 1.0 / prior_scale ** 2, 1e-12)
        return precision

    def server_update(server, messages, weights, mask, hparams, key):
        del server, hparams, key
        q = weights if weighting == "by_size" else mask  # equal: q_k = 1 for every real client
        product = gaussian_product(DiagGaussian(messages["params"], jax.tree.map(precision_of, messages["scale"])), q)
        scale = product.scale
        leaves = jax.tree.leaves(scale)
        mean_scale = sum(jnp.sum(s) for s in leaves) / sum(s.size for s in leaves)
        return {"params": product.mean, "scale": scale}, {"mean_global_scale": mean_scale}

    def evaluate_client(message, persistent, x, y, mask, group):
        if heads is None:
            meme = meme_task.evaluate(message["params"], x, y, mask)
        else:
            meme = classification_metrics(lambda p, xb: network(p, xb, persistent["head"], group), message["params"],
                                          x, y, EVAL_BATCH_SIZE, mask)
        if private is None:
            return {"accuracy": meme["accuracy"], "meme_accuracy": meme["accuracy"]}
        local = private.evaluate(persistent["local"], x, y, mask, group)
        return {"accuracy": jnp.maximum(meme["accuracy"], local["accuracy"]), "meme_accuracy": meme["accuracy"],
                "local_model_accuracy": local["accuracy"]}

    needs_persistent = private is not None or sigma == "persist" or heads is not None
    hooks = meme_task.hooks() if heads is None else {"init_params": meme_task.init_params}
    return Algorithm(
        name="hbfl", server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, server_update=server_update,
        persistent_init=persistent_init if needs_persistent else None, evaluate_client=evaluate_client,
        hparams={"lr": lr, "meme_lr": meme_lr}, local_epochs=local_epochs, batch_size=batch_size,
        num_groups=max(private.num_groups if private is not None else 1, heads.num_groups if heads else 1), **hooks)


__all__ = ["NLL_FORMS", "SIGMA_MODES", "TEACHERS", "WEIGHTINGS", "entropy_penalty", "hbfl", "sample_weights"]
