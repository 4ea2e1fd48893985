"""FOLA: Bayesian FL with online Laplace approximation (Liu et al., TPAMI 2023).

Each client trains with the global posterior N(mu_S, Lambda_S^-1) as a prior
(loss CE + lam/2 sum prior_precision (theta - mu_S)^2, Eq. 16), accumulates a
diagonal Fisher along its local SGD trajectory (Eq. 22) and sends
``(theta_n, precision_n)``; the server takes the product of client Gaussians
raised to pi_n = m_n / m (Eq. 12) via ``posteriors.gaussian_product``.

Options (spec ``shared/specs/fola.md`` section 3; defaults are the spec's):

fisher                 which Fisher: "batch_mean_sq" (authors' code) | "per_sample_sq"
                       (Eq. 21/22) | "alg1_raw" (Algorithm 1) | "offline" (one pass at the
                       final weights, reset every round: the Fig. 9a ablation)
laplace                the Laplace approximation of Sec. IV-E: "diagonal_fisher" (the method's, with the
                       ``fisher`` estimator) | "full" (the exact Hessian of the mean cross-entropy, a
                       ``[d, d]`` precision over the raveled parameters: full-matrix prior, message,
                       product and solve; small models only) | "e_full" (that Hessian's eigenvalues on a
                       diagonal, then the diagonal method). Both Hessian variants are online unless
                       ``fisher="offline"``: the batches' exact Hessians at the weights of each step,
                       summed over an epoch (divided by the client's count) and averaged over the
                       epochs (spec D24); offline is the mean-loss Hessian at the final weights. The
                       Fisher's settings (the ``fisher`` estimator, ``offline_fisher_estimator``,
                       ``normalisation``) do not apply to them
offline_accumulates    with ``fisher="offline"``: True combines the offline curvature with the
                       global precision as ``precision_mode`` says (Eq. 23 or 24, as online does),
                       False sends it alone and resets it every round (the authors' offline code, the
                       Fig. 9a ablation). None (default): True for "full" and "e_full" (spec D24: the
                       Hessian "plus the prior precision"), False for the diagonal Fisher
eigen_order            e_full: which eigenvalue goes where (``laplace.hessian.eigenvalue_diagonal``):
                       "diagonal_rank" (D24: the k-th largest to the k-th largest diag(H)) | "solver"
normalisation          "sum_over_epochs" (code) | "mean_over_steps" (Eq. 22, 1/T)
precision_mode         "running_sum": omega_n = omega_S + F, prior precision omega_S / r
                       "running_average": Lambda_n = F / r + (r-1)/r Lambda_S (Eq. 24),
                       prior precision Lambda_S (Eq. 25)
offline_fisher_estimator  the estimator of the "offline" Fisher pass
damping                delta added to F (Eq. 20; to the Hessian's diagonal for "full")
eps                    product denominator guard (code 1e-5; paper 0: a coordinate whose
                       aggregated precision is 0 then keeps the server's mean)
gamma                  extra prior precision added every round (gamma I for "full")
prior_grad             False reproduces the released code (prior detached)
clip_norm              global-norm clip of the total gradient (code 10)
lam                    traced hyper-parameter; 0 gives "aggregation only"; by default 1e3
                       (1 with profile "paper": ``PROFILE_LAM``)

prune_p                parameter compression (the authors' ``--pruing_p``, off by default): each
                       client keeps the top ``prune_p`` fraction of every tensor's precision and
                       replaces the rest by their mean (``prune_precision``)

fixed_pi               weights under partial participation (spec D23): False (the code's)
                       renormalises pi over the active clients A, pi_n / sum_{k in A} pi_k;
                       True keeps pi_n = m_n / m, so omega_S = sum_{n in A} pi_n omega_n is
                       smaller by the cohort's share sum_{n in A} pi_n (the engine's
                       ``hparams["cohort_weight"]``) and mu_S = sum pi_n omega_n theta_n /
                       (omega_S + eps). With full participation at the base weights (no
                       stragglers weighted by epochs, nobody dropped) both are the same

precision_diagnostics  report the spec's precision diagnostics (section 7) as server
                       metrics every round: ``precision_below_eps``, the share of
                       coordinates with Lambda_S < eps (Lambda_S = omega_S / r with the
                       running sum), and ``precision_median`` (one
                       counting pass over every parameter per key bit, ``order_statistics.median``;
                       False skips both)

``profile`` picks a consistent set: "default" (the spec's recommendation),
"authors_code" (the released code's choices: detached prior) or "paper"
(per-sample Fisher, 1/T, running average, eps 0, no clipping); explicit
keyword arguments override the profile.

``reference_posterior(server, rounds, profile, **options)`` turns a run's server state into the global
posterior N(theta_S, Lambda_S^-1) that Sec. IV-E's distance measures against (``posteriors.distance``,
``algorithms.posterior_analysis``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from bfedjax.algorithms.local_sgd import HESSIAN, make_sgd_client
from bfedjax.core.types import COHORT_WEIGHT, Algorithm, engine_hparam
from bfedjax.laplace.fisher import FISHER_ESTIMATORS, offline_fisher
from bfedjax.laplace.hessian import EIGEN_ORDERS, eigenvalue_diagonal, offline_hessian
from bfedjax.models.apply import apply_fn_of
from bfedjax.order_statistics import kth_smallest, median
from bfedjax.posteriors.aggregation import (gaussian_product_from_stats, gaussian_product_full_from_stats,
                                            gaussian_product_full_stats, gaussian_product_stats)
from bfedjax.posteriors.distance import ReferencePosterior
from bfedjax.posteriors.gaussian import DensePrecision, DiagGaussian
from bfedjax.tasks import classification
from bfedjax.tree import tree_zeros_like

FISHER_MODES = FISHER_ESTIMATORS + ("offline",)
NORMALISATIONS = ("sum_over_epochs", "mean_over_steps")
PRECISION_MODES = ("running_sum", "running_average")
LAPLACE_VARIANTS = ("diagonal_fisher", "full", "e_full")


@dataclasses.dataclass(frozen=True)
class FolaConfig:
    fisher: str = "batch_mean_sq"
    laplace: str = "diagonal_fisher"
    eigen_order: str = "diagonal_rank"
    offline_accumulates: bool | None = None
    normalisation: str = "sum_over_epochs"
    precision_mode: str = "running_sum"
    offline_fisher_estimator: str = "batch_mean_sq"
    damping: float = 0.0
    eps: float = 1e-5
    gamma: float = 0.0
    prior_grad: bool = True
    clip_norm: float | None = 10.0
    momentum: float = 0.0
    prune_p: float | None = None
    fixed_pi: bool = False
    precision_diagnostics: bool = True

    def __post_init__(self):
        _check("fisher", self.fisher, FISHER_MODES)
        _check("laplace", self.laplace, LAPLACE_VARIANTS)
        _check("eigen_order", self.eigen_order, EIGEN_ORDERS)
        if self.laplace == "full" and self.prune_p is not None:
            raise ValueError("FOLA prune_p compresses a diagonal precision; fix: drop prune_p with laplace='full'")
        if self.laplace == "full" and self.eps <= 0:
            raise ValueError("FOLA laplace='full' needs eps > 0: the Hessian is singular (a softmax's logits shift "
                             "together; pixels that are never lit), so the product's solve is too; fix: eps=1e-5 "
                             "(the authors' code)")
        _check("normalisation", self.normalisation, NORMALISATIONS)
        _check("precision_mode", self.precision_mode, PRECISION_MODES)
        _check("offline_fisher_estimator", self.offline_fisher_estimator, FISHER_ESTIMATORS)
        for name in ("damping", "eps", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"FOLA {name}={getattr(self, name)} must be >= 0")
        if self.prune_p is not None and not 0.0 < self.prune_p < 1.0:
            raise ValueError(f"FOLA prune_p={self.prune_p} must be in (0, 1), e.g. 0.1 (None: no compression)")
        if not isinstance(self.fixed_pi, bool):
            raise ValueError(f"FOLA fixed_pi={self.fixed_pi!r} must be a bool; fix: fixed_pi=True keeps pi_n = m_n/m "
                             "under partial participation, False (default) renormalises over the active clients")


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"FOLA {name}={value!r}; choose one of {allowed}")


PROFILES = {
    "default": FolaConfig(),
    "authors_code": FolaConfig(prior_grad=False),
    "paper": FolaConfig(fisher="per_sample_sq", normalisation="mean_over_steps",
                        precision_mode="running_average", offline_fisher_estimator="per_sample_sq",
                        eps=0.0, clip_norm=None),
}


def prune_precision(precision, p: float):
    """FOLA's parameter compression, leaf by leaf: the authors' threshold is the ``floor(p n)``-th largest of
    the leaf's ``n`` precisions (0-based); entries below it are replaced by their mean, so a client sends
    about ``p n`` values and one scalar per tensor, and each leaf's sum is kept."""
    def leaf(w):
        flat = w.ravel()
        threshold = kth_smallest(flat, flat.size - 1 - int(p * flat.size))  # no sort: one pass per bit
        below = flat < threshold
        mean_below = jnp.sum(jnp.where(below, flat, 0.0)) / jnp.maximum(jnp.sum(below), 1)
        return jnp.where(below, mean_below, flat).reshape(w.shape)
    return jax.tree.map(leaf, precision)


def accumulates(cfg: FolaConfig) -> bool:
    """Whether a client's precision combines its round's curvature with the global precision (online, or
    offline with ``offline_accumulates``) rather than sending the curvature alone."""
    if cfg.fisher != "offline":
        return True
    return cfg.laplace != "diagonal_fisher" if cfg.offline_accumulates is None else cfg.offline_accumulates


def fola_config(profile: str = "default", other_arguments: tuple = ("profile",), **options) -> FolaConfig:
    """``PROFILES[profile]`` with ``options`` (``FolaConfig`` fields) replaced; a one-line error naming the valid
    choices for an unknown profile or option (``other_arguments``: the caller's own, listed as valid too)."""
    if profile not in PROFILES:
        raise ValueError(f"FOLA profile={profile!r}; choose one of {tuple(PROFILES)}")
    fields = [f.name for f in dataclasses.fields(FolaConfig)]
    unknown = set(options) - set(fields)
    if unknown:
        raise ValueError(f"unknown FOLA options {sorted(unknown)}; valid: {list(other_arguments) + fields}")
    return dataclasses.replace(PROFILES[profile], **options)


def running_sum_of_rounds(cfg: FolaConfig) -> bool:
    """Whether the server's precision is the running sum omega_S = r Lambda_S after round r (Eq. 25) rather than
    Lambda_S itself (the running average of Eq. 24, or offline curvature sent alone)."""
    return accumulates(cfg) and cfg.precision_mode == "running_sum"


def global_precision(precision, rounds, cfg: FolaConfig):
    """Lambda_S, the global posterior's precision, from the server's ``precision`` after ``rounds`` rounds (a
    pytree of the model's shapes, or ``[d, d]`` for ``laplace="full"``)."""
    if not running_sum_of_rounds(cfg):
        return precision
    return jax.tree.map(lambda w: w / jnp.asarray(rounds).astype(w.dtype), precision)


def reference_posterior(server, rounds: int, profile: str = "default", **options) -> ReferencePosterior:
    """The global posterior ``N(theta_S, Lambda_S^-1)`` of a FOLA server state after ``rounds`` rounds, as the
    known posterior of Sec. IV-E's distance (``posteriors.distance``; the paper takes it from a converged
    full-Laplace run). ``profile`` and ``options`` are the ``fola`` run's (``FolaConfig`` fields), which say how
    its precision accumulated. The mean is the model's parameter pytree; the precision a pytree like it, or a
    ``DensePrecision`` over the raveled parameters for ``laplace="full"``."""
    cfg = fola_config(profile, ("server", "rounds", "profile"), **options)
    precision = global_precision(server["precision"], rounds, cfg)
    return ReferencePosterior(server["params"], DensePrecision(precision) if cfg.laplace == "full" else precision)


def prior_precision(server, round_index, cfg: FolaConfig):
    """Precision of the client prior in round ``round_index`` (1-based) from the server state (for
    ``laplace="full"`` a ``DensePrecision``)."""
    precision = server["precision"]
    running_sum = running_sum_of_rounds(cfg)
    if cfg.laplace == "full":  # the server's matrix as it is, scaled where it meets a vector
        return DensePrecision(precision, 1.0 / round_index if running_sum else 1.0, cfg.gamma)
    if running_sum:
        precision = jax.tree.map(lambda w: w * (1.0 / round_index), precision)  # a product XLA fuses into each use
    if cfg.gamma:
        precision = with_diagonal_added(precision, cfg.gamma, cfg)
    return precision


def with_diagonal_added(precision, value: float, cfg: FolaConfig):
    """``precision`` plus ``value`` on every coordinate's own precision (``value I`` for a full matrix)."""
    if cfg.laplace == "full":
        return precision + value * jnp.eye(precision.shape[0], dtype=precision.dtype)
    return jax.tree.map(lambda w: w + value, precision)


# lambda of Eq. 16 when not given (spec D9): the code's 1e3 with its batch-mean Fisher; the paper's per-sample
# Fisher is about B times larger, and the spec's grid for it is {1, 10, 100} (1e3 diverges there).
PROFILE_LAM = {"default": 1e3, "authors_code": 1e3, "paper": 1.0}


def fola(model, *, lr: float = 0.01, lam: float | None = None, local_epochs: int = 1, batch_size: int = 32,
         profile: str = "default", **options) -> Algorithm:
    """Builds FOLA (module docstring: the equations and every option).

    Args:
      model: a Flax classifier (``bfedjax.models.get_model``).
      lr: local SGD learning rate (traced: ``hparams["lr"]``).
      lam: lambda, the weight of the global-posterior prior in the local loss (Eq. 16; traced; 0 gives
        "aggregation only"); ``None``: ``PROFILE_LAM[profile]`` (1e3; 1 for ``"paper"``).
      local_epochs, batch_size: E and B of local training.
      profile: ``"default"``, ``"authors_code"`` or ``"paper"`` (``PROFILES``).
      **options: ``FolaConfig`` fields (``fisher``, ``laplace``, ``eps``, ``clip_norm``, ...) overriding the profile.
    Returns:
      an ``Algorithm``; its message is ``{"params", "precision"}`` (pytrees of the model's shapes; ``[d, d]``
      precision for ``laplace="full"``), and so is its server state.
    """
    cfg = fola_config(profile, ("lr", "lam", "local_epochs", "batch_size", "profile"), **options)
    lam = PROFILE_LAM[profile] if lam is None else lam
    hessian_based, dense = cfg.laplace != "diagonal_fisher", cfg.laplace == "full"
    online = None if cfg.fisher == "offline" else HESSIAN if hessian_based else cfg.fisher
    apply_fn = apply_fn_of(model)

    def prior(ctx):
        r = ctx.hparams["round"].astype(jnp.float32)
        return ctx.server["params"], prior_precision(ctx.server, r, cfg)

    # Default path: the message's precision S + F (running sum, Fisher summed over the epochs) accumulates
    # in place from S, rather than F from zeros and then a sum over the model: a pass fewer per client.
    summed_onto_server = (cfg.fisher != "offline" and cfg.precision_mode == "running_sum"
                          and cfg.normalisation == "sum_over_epochs" and not hessian_based)
    client_init, client_step = make_sgd_client(
        model, prior_fn=prior, fisher=online, clip_norm=cfg.clip_norm, momentum=cfg.momentum,
        prior_grad=cfg.prior_grad, fisher_init=(lambda ctx: ctx.server["precision"]) if summed_onto_server else None)

    def round_fisher(local, ctx):
        """The client's Fisher F for this round (before combining with the global precision): with
        ``laplace="full"`` the round's Hessian ``[d, d]``, with ``"e_full"`` its eigenvalues as a pytree."""
        if hessian_based:
            hessian = (offline_hessian(apply_fn, local.params, ctx.data, batch_size) if cfg.fisher == "offline"
                       else local.fisher / local_epochs)  # the mean of the epochs' Hessians (spec D24)
            if not dense:
                hessian = ravel_pytree(local.params)[1](eigenvalue_diagonal(hessian, cfg.eigen_order))
            return with_diagonal_added(hessian, cfg.damping, cfg) if cfg.damping else hessian
        if cfg.fisher == "offline":
            fisher = offline_fisher(apply_fn, local.params, ctx.data, batch_size, cfg.offline_fisher_estimator)
        elif cfg.normalisation == "sum_over_epochs":
            fisher = local.fisher
        else:  # mean over steps: per epoch for normalised estimators, per step for raw squares
            steps = local_epochs if cfg.fisher != "alg1_raw" else jnp.maximum(local.steps, 1)
            fisher = jax.tree.map(lambda f: f / steps, local.fisher)
        return jax.tree.map(lambda f: f + cfg.damping, fisher)

    def client_final(local, ctx):
        if summed_onto_server:  # local.fisher already holds S + F
            precision = jax.tree.map(lambda a: a + cfg.damping, local.fisher)
        elif not accumulates(cfg):
            precision = round_fisher(local, ctx)
        elif cfg.precision_mode == "running_sum":
            precision = jax.tree.map(jnp.add, ctx.server["precision"], round_fisher(local, ctx))
        else:  # Eq. 24
            r = ctx.hparams["round"].astype(jnp.float32)
            precision = jax.tree.map(lambda f, s: f / r + (r - 1.0) / r * s, round_fisher(local, ctx),
                                     ctx.server["precision"])
        if cfg.prune_p is not None:
            precision = prune_precision(precision, cfg.prune_p)
        return {"params": local.params, "precision": precision}, (), {}

    def server_init(params):
        if dense:
            flat = ravel_pytree(params)[0]
            return {"params": params, "precision": jnp.zeros((flat.size, flat.size), flat.dtype)}
        return {"params": params, "precision": tree_zeros_like(params)}

    def client_stats(message):
        if dense:
            return gaussian_product_full_stats(ravel_pytree(message["params"])[0], message["precision"])
        return gaussian_product_stats(DiagGaussian(message["params"], message["precision"]))

    def server_from_stats(server, stats, mask, hparams, key):
        """``stats = (sum_c w_c omega_c theta_c, sum_c w_c omega_c)`` with ``w [C]`` summing to 1; ``fixed_pi``
        scales both by ``hparams["cohort_weight"]`` (``[]``), making the weights the un-renormalised pi_n."""
        del mask, key
        if cfg.fixed_pi:
            stats = scaled_to_fixed_pi(stats, hparams)
        if dense:
            mean, precision = gaussian_product_full_from_stats(stats, cfg.eps)
            params = ravel_pytree(server["params"])[1](mean)
        else:
            posterior = gaussian_product_from_stats(stats, cfg.eps)
            precision = posterior.precision
            # With eps = 0 (the paper) a coordinate no client has curvature for is 0 / 0: it keeps its mean.
            params = jax.tree.map(lambda m, p, old: jnp.where(p + cfg.eps > 0, m, old), posterior.mean, precision,
                                  server["params"])
        metrics = precision_diagnostics(diagnosed_precision(precision, hparams)) if cfg.precision_diagnostics else {}
        return {"params": params, "precision": precision}, metrics

    def diagnosed_precision(precision, hparams):
        """Lambda_S of the spec's diagnostics (``global_precision``) from the round's aggregated precision."""
        if not running_sum_of_rounds(cfg):
            return precision
        return global_precision(precision, engine_hparam(hparams, "round", "FOLA's precision diagnostics",
                                                         "Lambda_S = omega_S / r",
                                                         " or fola(..., precision_diagnostics=False)"), cfg)

    def scaled_to_fixed_pi(stats, hparams):
        share = engine_hparam(hparams, COHORT_WEIGHT, "FOLA fixed_pi", "the cohort's sum of pi_n")
        return jax.tree.map(lambda s: s * jnp.asarray(share, s.dtype), stats)

    def precision_diagnostics(precision):
        """Spec section 7: share of coordinates with ``precision`` (Lambda_S) < eps and its median (for a full
        matrix, of its diagonal: each coordinate's own precision)."""
        flat = jnp.diagonal(precision) if dense else jnp.concatenate([p.ravel() for p in jax.tree.leaves(precision)])
        return {"precision_below_eps": jnp.mean(flat < max(cfg.eps, 1e-30)),
                "precision_median": median(flat)}  # jnp.median's value without XLA:CPU's slow sort

    return Algorithm(
        name="fola", server_init=server_init, client_init=client_init, client_step=client_step,
        client_final=client_final, client_stats=client_stats, server_from_stats=server_from_stats,
        hparams={"lr": lr, "lam": lam}, local_epochs=local_epochs, batch_size=batch_size,
        **classification(model).hooks())
