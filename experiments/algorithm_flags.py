"""The flags that pick and configure an algorithm, shared by ``experiments.run`` and the paper scripts.

Every option flag maps onto a keyword option of a factory in
``bfedjax.algorithms.ALGORITHMS``; ``build(flag_values, model, fed)`` turns
the parsed flags into ``bfedjax.algorithms.build(name, model, fed, **options)``.
Option flags default to None ("the algorithm's default"); one that is set but
does not apply to the chosen algorithm is reported in one line and ignored
(a flagfile describes a setting shared by several algorithms), except the
DP-SGD flags, whose privacy must never be dropped silently.

A paper's preset is a flagfile (``experiments/configs``): scripts that run
several methods parse one flagfile per method into a fresh ``FlagValues``
(``parse_flagfile``).
"""
from __future__ import annotations

import sys
from typing import Sequence

from absl import app, flags

from bfedjax.algorithms.bfl import KL_DIVISORS, RULES
from bfedjax.algorithms.fedcurv import VARIANTS as FEDCURV_VARIANTS
from bfedjax.algorithms.fedref import LOSS_REPORTS, LOSS_TERMS, REFERENCES
from bfedjax.algorithms.fedref import VARIANTS as FEDREF_VARIANTS
from bfedjax.algorithms.fedprox import SCALINGS
from bfedjax.algorithms.fedreg import CLAMPS, GRANULARITIES
from bfedjax.algorithms.abavg import ACCURACY_SOURCES
from bfedjax.algorithms.abavg import WEIGHTINGS as ABAVG_WEIGHTINGS
from bfedjax.algorithms.fml import WEIGHTINGS as FML_WEIGHTINGS
from bfedjax.algorithms.hbfl import NLL_FORMS, SIGMA_MODES, TEACHERS
from bfedjax.algorithms.hbfl import WEIGHTINGS as HBFL_WEIGHTINGS
from bfedjax.algorithms.fola import FISHER_MODES, LAPLACE_VARIANTS, NORMALISATIONS, PRECISION_MODES, PROFILES
from bfedjax.algorithms.local_sgd import OPTIMIZERS
from bfedjax.laplace.hessian import EIGEN_ORDERS
from bfedjax.algorithms.registry import ALGORITHMS
from bfedjax.algorithms.robust import ROBUST_RULES
from bfedjax.algorithms.scaffold import OPTIONS as SCAFFOLD_OPTIONS
from bfedjax.algorithms.server_opt import SERVER_OPTIMIZERS
from bfedjax.posteriors import DWC_GUARDS
from bfedjax.posteriors.weighting import WEIGHTINGS
from bfedjax.vi import GRADIENT_ESTIMATORS, INIT_LOCS

# Options every algorithm takes when its factory has them (always passed).
COMMON = {"lr": "lr", "local_epochs": "local_epochs", "batch_size": "batch_size"}

# flag -> (factory option, algorithms it applies to)
OPTION_FLAGS = {
    "lam": ("lam", ("fola", "fedcurv")),
    "mu": ("mu", ("fedprox",)),
    "clip_norm": ("clip_norm", ("fedavg", "fedprox", "fedcurv", "fola", "scaffold", "fednova", "fedref")),
    "momentum": ("momentum", ("fedavg", "fedprox", "fedcurv", "fola", "fednova", "hbfl", "fml", "abavg", "fedref",
                              "bfl")),
    "optimizer": ("optimizer", ("fedavg", "bfl")),
    "weight_decay": ("weight_decay", ("fedavg", "hbfl", "fml", "abavg")),
    "dp_clip": ("dp_clip", ("fedavg", "fedsgd", "fedprox", "fedcurv")),
    "dp_noise": ("dp_noise", ("fedavg", "fedsgd", "fedprox", "fedcurv")),
    "fola_profile": ("profile", ("fola",)),
    "fisher": ("fisher", ("fola", "fedcurv")),
    "laplace": ("laplace", ("fola",)),
    "eigen_order": ("eigen_order", ("fola",)),
    "offline_accumulates": ("offline_accumulates", ("fola",)),
    "normalisation": ("normalisation", ("fola",)),
    "precision_mode": ("precision_mode", ("fola",)),
    "damping": ("damping", ("fola",)),
    "eps": ("eps", ("fola",)),
    "gamma": ("gamma", ("fola",)),
    "prior_grad": ("prior_grad", ("fola",)),
    "prune_p": ("prune_p", ("fola",)),
    "fixed_pi": ("fixed_pi", ("fola",)),
    "rule": ("rule", ("bfl",)),
    "weighting": ("weighting", ("bfl",)),
    "dwc_guard": ("dwc_guard", ("bfl",)),
    "dwc_floor_ratio": ("dwc_floor_ratio", ("bfl",)),
    "prior_update": ("prior_update", ("bfl",)),
    "prior_scale": ("prior_scale", ("bfl",)),
    "variational_biases": ("variational_biases", ("bfl",)),
    "train_samples": ("train_samples", ("bfl",)),
    "eval_samples": ("eval_samples", ("bfl",)),
    "gradient_estimator": ("gradient_estimator", ("bfl",)),
    "init_loc": ("init_loc", ("bfl",)),
    "init_loc_std": ("init_loc_std", ("bfl",)),
    "kl_divisor": ("kl_divisor", ("bfl",)),
    "kl_beta": ("kl_beta", ("bfl",)),
    "kl_anneal_rounds": ("kl_anneal_rounds", ("bfl",)),
    "scale_min": ("scale_min", ("bfl",)),
    "prior_temperature": ("prior_temperature", ("bfl",)),
    "fedcurv_variant": ("variant", ("fedcurv",)),
    "fedprox_scaling": ("scaling", ("fedprox",)),
    "fedprox_detached": ("detached", ("fedprox",)),
    "fedref_variant": ("variant", ("fedref",)),
    "fedref_lambda": ("lam", ("fedref",)),
    "fedref_p": ("p", ("fedref",)),
    "fedref_server_lr": ("server_lr", ("fedref",)),
    "fedref_fix_ref_delta": ("fix_ref_delta", ("fedref",)),
    "fedref_ref_through_a": ("ref_through_A", ("fedref",)),
    "fedref_reference": ("reference", ("fedref",)),
    "fedref_warmup": ("warmup", ("fedref",)),
    "fedref_loss_report": ("loss_report", ("fedref",)),
    "fedref_loss_term": ("loss_term", ("fedref",)),
    "fedref_lambda_ref": ("lam_ref", ("fedref",)),
    "fedref_lambda_ref_growth": ("lam_ref_growth", ("fedref",)),
    "fedref_lambda_ref_every": ("lam_ref_every", ("fedref",)),
    "fedref_lambda_ref_cap": ("lam_ref_cap", ("fedref",)),
    "fedreg_gamma": ("gamma", ("fedreg",)),
    "eta_s": ("eta_s", ("fedreg",)),
    "eta_p": ("eta_p", ("fedreg",)),
    "mg": ("mg", ("fedreg",)),
    "fedreg_granularity": ("granularity", ("fedreg",)),
    "fedreg_clamp": ("clamp", ("fedreg",)),
    "fedreg_per_layer": ("per_layer", ("fedreg",)),
    "fedreg_pseudo_temperature": ("pseudo_temperature", ("fedreg",)),
    "fedreg_projections": ("projections", ("fedreg",)),
    "fedreg_equality": ("equality", ("fedreg",)),
    "fedreg_hard_pseudo": ("hard_pseudo", ("fedreg",)),
    "scaffold_option": ("option", ("scaffold",)),
    "likelihood_temperature": ("temperature", ("hbfl",)),
    "meme_lr": ("meme_lr", ("hbfl",)),
    "meme_weight_decay": ("meme_weight_decay", ("hbfl",)),
    "decay_rho": ("decay_rho", ("hbfl",)),
    "rho_init": ("rho_init", ("hbfl",)),
    "rho_init_std": ("rho_init_std", ("hbfl",)),
    "sigma_mode": ("sigma", ("hbfl",)),
    "teacher": ("teacher", ("hbfl",)),
    "teacher_samples": ("teacher_samples", ("hbfl",)),
    "mc_samples": ("mc_samples", ("hbfl",)),
    "nll": ("nll", ("hbfl",)),
    "meme_prior_scale": ("prior_scale", ("hbfl",)),
    "hbfl_weighting": ("weighting", ("hbfl",)),
    "distill_alpha": ("alpha", ("hbfl", "fml")),
    "distill_beta": ("beta", ("fml",)),
    "distill_temperature": ("distill_temperature", ("hbfl", "fml")),
    "reinit_local": ("reinit_local", ("hbfl", "fml")),
    "fml_weighting": ("weighting", ("fml",)),
    "abavg_weighting": ("weighting", ("abavg",)),
    "abavg_accuracy_source": ("accuracy_source", ("abavg",)),
}
MUST_APPLY = ("dp_clip", "dp_noise")  # a privacy guarantee is never dropped silently
RENAMED = {("lam", "fedprox"): "--mu"}  # FedProx's coefficient was --lam before engine API v1


def define(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines ``--algorithm``, ``--lr``, ``--local_epochs``, ``--batch_size`` and every option flag."""
    def enum(name, values, help_):
        flags.DEFINE_enum(name, None, values, help_, flag_values=flag_values)

    def number(define_fn, name, help_):
        define_fn(name, None, help_, flag_values=flag_values)

    def boolean(name, help_):
        flags.DEFINE_bool(name, None, help_, flag_values=flag_values)

    flags.DEFINE_enum("algorithm", "fola", list(ALGORITHMS), "Federated algorithm.", flag_values=flag_values)
    flags.DEFINE_float("lr", 0.01, "Local learning rate.", flag_values=flag_values)
    flags.DEFINE_integer("local_epochs", 1, "Local epochs E.", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 32, "Local batch size B (fedsgd: the whole client).", flag_values=flag_values)
    # Local training.
    number(flags.DEFINE_float, "lam", "fola, fedcurv: prior weight lambda (default per algorithm).")
    number(flags.DEFINE_float, "mu", "fedprox: proximal weight mu (default 0.01).")
    number(flags.DEFINE_float, "clip_norm", "Global-norm gradient clip; 0 disables; default per algorithm "
           "(10; fedprox, scaffold, fednova none).")
    number(flags.DEFINE_float, "momentum", "Local heavy-ball momentum (default 0; hbfl, fml, abavg 0.9).")
    enum("optimizer", OPTIMIZERS, "fedavg, bfl: local optimiser (default sgd for fedavg, adam for bfl; Fischer et "
         "al.'s baselines: adam, lr 1e-3).")
    number(flags.DEFINE_float, "weight_decay", "fedavg, abavg: L2 penalty on dense/conv kernels (Fischer et al.'s "
           "deterministic and MC-dropout baselines: 1e-4; the KL regularises the variational clients); hbfl, fml: "
           "of the local models' SGD, every leaf (default 5e-4).")
    number(flags.DEFINE_float, "dp_clip", "DP-SGD per-example clip norm C (fedavg, fedsgd, fedprox, fedcurv); "
           "unset: no DP.")
    number(flags.DEFINE_float, "dp_noise", "DP-SGD noise multiplier sigma (std sigma*C on the clipped sum).")
    # FOLA (spec section 3).
    enum("fola_profile", tuple(PROFILES), "fola: preset of the options below.")
    enum("fisher", FISHER_MODES,
         "fola, fedcurv: Fisher estimator (fedcurv: not offline; its FedReg-authors form uses per_sample_sq).")
    enum("laplace", LAPLACE_VARIANTS, "fola: Laplace approximation (Sec. IV-E): diagonal_fisher (default), full (the "
         "exact Hessian as a [d, d] precision; small models such as --model=logistic) or e_full (its eigenvalues on a "
         "diagonal); online unless --fisher=offline.")
    enum("eigen_order", EIGEN_ORDERS, "fola --laplace=e_full: diagonal_rank (default: the k-th largest eigenvalue "
         "to the k-th largest Hessian diagonal entry) or solver (ascending).")
    boolean("offline_accumulates", "fola --fisher=offline: combine the offline curvature with the global precision "
            "as --precision_mode says (default for --laplace=full/e_full, spec D24) or send it alone, reset every round "
            "(--nooffline_accumulates; default for the diagonal Fisher, the authors' offline code).")
    enum("normalisation", NORMALISATIONS, "fola: Fisher normalisation.")
    enum("precision_mode", PRECISION_MODES, "fola: precision state (Eq. 24/25).")
    number(flags.DEFINE_float, "damping", "fola: Fisher damping delta.")
    number(flags.DEFINE_float, "eps", "fola: product denominator guard.")
    number(flags.DEFINE_float, "gamma", "fola: extra prior precision.")
    boolean("prior_grad", "fola: False detaches the prior as in the released code.")
    number(flags.DEFINE_float, "prune_p", "fola: parameter compression, each client keeps the top prune_p fraction "
           "of every tensor's precision and sends the mean of the rest (the authors' --pruing_p; default off).")
    boolean("fixed_pi", "fola: under partial participation keep pi_n = m_n/m (the aggregated precision shrinks by the "
            "cohort's sum of pi_n; spec D23) instead of renormalising over the active clients (default).")
    # Fischer et al.
    enum("rule", RULES,
         "bfl: aggregation rule (default wc).")
    enum("weighting", WEIGHTINGS,
         "bfl: client weighting (default by_size: the run's client weights, pi_n = m_n/m).")
    enum("dwc_guard", DWC_GUARDS,
         "bfl --rule=dwc: where Eq. 17's precision is not positive fall back to conflation (default), or clip "
         "it at --dwc_floor_ratio x the clients' mean precision, or no guard.")
    number(flags.DEFINE_float, "dwc_floor_ratio", "bfl: floor of --dwc_guard=floor relative to the clients' mean "
           "precision (default 1).")
    boolean("prior_update", "bfl: clients use the global posterior as their ELBO prior.")
    number(flags.DEFINE_float, "prior_scale", "bfl: std of the N(0, s^2) weight prior (default 10).")
    boolean("variational_biases", "bfl: biases variational too (default: point estimates).")
    number(flags.DEFINE_integer, "train_samples", "bfl: MC samples of the ELBO per step (default 1).")
    number(flags.DEFINE_integer, "eval_samples", "bfl: MC samples of the per-round GA / LA predictive (default 50, "
           "spec D9; 0: score the posterior mean, one pass).")
    enum("gradient_estimator", GRADIENT_ESTIMATORS,
         "bfl: gradient estimator of the expected log-likelihood (default flipout: per-example sign-flipped "
         "kernel noise; local_reparameterization: each output unit drawn from its Gaussian given the input; "
         "reparameterization: one weight sample per batch).")
    enum("init_loc", INIT_LOCS, "bfl: initial posterior mean of the variational kernels (default normal: "
         "N(0, --init_loc_std^2), spec D4; he_normal; model: the zoo model's own initialiser).")
    number(flags.DEFINE_float, "init_loc_std", "bfl --init_loc=normal: its std (default 0.1).")
    enum("kl_divisor", KL_DIVISORS, "bfl: the KL per mini-batch over the client's |D_k| (client, default: "
         "CE + KL/|D_k|) or the federation's |D| (federation), spec D5.")
    number(flags.DEFINE_float, "kl_beta", "bfl: an explicit beta on the KL term (default 1).")
    number(flags.DEFINE_integer, "kl_anneal_rounds", "bfl: ramp the KL weight linearly up to --kl_beta over this "
           "many rounds (default 0: no annealing).")
    number(flags.DEFINE_float, "scale_min", "bfl: floor of the aggregated posterior scale (default 1e-6, spec D2).")
    number(flags.DEFINE_float, "prior_temperature", "bfl --prior_update: temper the global-posterior prior toward "
           "N(0, --prior_scale^2), q_g^t N(0, s^2)^(1-t) (default 1: q_g itself; spec D18).")
    # FedCurv, FedProx, SCAFFOLD, FedReg.
    enum("fedcurv_variant", FEDCURV_VARIANTS,
         "fedcurv form (previous_round: the FedReg authors'; run it with --fisher=per_sample_sq --clip_norm=0).")
    enum("fedprox_scaling", tuple(SCALINGS), "fedprox: mu/2||.||^2 (half, default) or mu||.||^2 (full, the "
         "FedReg authors' code).")
    number(flags.DEFINE_float, "fedreg_gamma", "fedreg: gradient taken at gamma*theta + (1-gamma)*theta_global "
           "(default 0.5).")
    number(flags.DEFINE_float, "eta_s", "fedreg: pseudo-data sign-ascent step (default 0.05).")
    number(flags.DEFINE_float, "eta_p", "fedreg: perturbed-data step (default 0.01 * eta_s).")
    boolean("mg", "fedreg with MG (gradient projected off the uniform-label pseudo-data gradient).")
    enum("fedreg_granularity", GRANULARITIES, "fedreg: pseudo-data unit.")
    enum("fedreg_clamp", CLAMPS, "fedreg: generation clamp.")
    boolean("fedreg_per_layer", "fedreg: Eq. 10's projections within each parameter tensor (an ablation; the "
            "paper projects the whole flattened model).")
    number(flags.DEFINE_float, "fedreg_pseudo_temperature", "fedreg: temperature tau of the pseudo labels "
           "softmax(logits / tau) (default 1, the paper's).")
    boolean("fedreg_projections", "fedreg: Eq. 10's projections (default on; --nofedreg_projections is the "
            "ablation, and with --fedreg_gamma=1 FedAvg).")
    boolean("fedreg_equality", "fedreg: the constraints as equalities (w_s, w_p may be negative; spec option).")
    boolean("fedreg_hard_pseudo", "fedreg: argmax pseudo labels instead of the softmax (spec option).")
    enum("scaffold_option", SCAFFOLD_OPTIONS, "scaffold: control-variate update (default II).")
    boolean("fedprox_detached", "fedprox as the FedRef authors ran it: the proximal term has no gradient, so the "
            "clients train like FedAvg's.")
    # FedRef (FedRef spec section 2.4) and the server optimisers (FedOpt), which wrap any algorithm.
    enum("fedref_variant", FEDREF_VARIANTS, "fedref: server step (default code: the authors' per-tensor shift; l2: "
         "the literal gradient of Eq. 12; map_step / map_prox: the MAP pull toward the reference).")
    number(flags.DEFINE_float, "fedref_lambda", "fedref: lambda of Eq. 12 (default 0.01).")
    number(flags.DEFINE_integer, "fedref_p", "fedref: reference window p, the last p aggregates (default 5).")
    number(flags.DEFINE_float, "fedref_server_lr", "fedref: server step eta (default: --lr, as the authors' code).")
    boolean("fedref_fix_ref_delta", "fedref --fedref_variant=code: False keeps the authors' Delta-R bug "
            "(default True: fixed).")
    boolean("fedref_ref_through_a", "fedref --fedref_variant=l2: differentiate the reference through A_r too.")
    enum("fedref_reference", REFERENCES, "fedref: reference model (default mean of the last p aggregates, Eq. 14; "
         "p_plus_one: Eq. 13; broadcast: of the corrected models; weighted: the authors' later static slot "
         "weights 1..p).")
    number(flags.DEFINE_integer, "fedref_warmup", "fedref: rounds that broadcast the plain aggregate (default p+1, "
           "as the authors' code; 0 corrects from round 1).")
    enum("fedref_loss_report", LOSS_REPORTS, "fedref: the loss clients report (code: a pass over their data after "
         "training, default; last_batch: the paper's last training batch).")
    number(flags.DEFINE_float, "fedref_lambda_ref", "fedref: lambda_2, the reference term's weight (the authors' "
           "later --lda2; default --fedref_lambda).")
    number(flags.DEFINE_float, "fedref_lambda_ref_growth", "fedref: multiply lambda_2 by this every "
           "--fedref_lambda_ref_every rounds (the authors' later sigmaw = 10; default 1, constant).")
    number(flags.DEFINE_integer, "fedref_lambda_ref_every", "fedref: rounds between lambda_2's steps (sigmar; "
           "default 10).")
    number(flags.DEFINE_float, "fedref_lambda_ref_cap", "fedref: lambda_2's cap (toplda2 = 0.005; default none).")
    enum("fedref_loss_term", LOSS_TERMS, "fedref --fedref_variant=code: the loss term s (code, default) or only "
         "log the weighted loss sum (weighted_sum).")
    flags.DEFINE_enum("server_optimizer", "none", ("none",) + SERVER_OPTIMIZERS, "Server optimiser on the "
                      "pseudo-gradient theta - aggregate, for any algorithm with server params (FedOpt: adam = "
                      "FedAdam, yogi = FedYogi, adagrad = FedAdagrad).", flag_values=flag_values)
    flags.DEFINE_float("server_lr", 0.01, "--server_optimizer: step size eta.", flag_values=flag_values)
    flags.DEFINE_float("server_b1", 0.9, "--server_optimizer adam/yogi: beta1.", flag_values=flag_values)
    flags.DEFINE_float("server_b2", 0.99, "--server_optimizer adam/yogi: beta2.", flag_values=flag_values)
    flags.DEFINE_float("server_tau", 1e-3, "--server_optimizer: adaptivity tau.", flag_values=flag_values)
    # Robust aggregation, a layer on any algorithm (bfedjax.algorithms.with_robust_aggregation).
    flags.DEFINE_enum("robust_rule", "none", ("none",) + ROBUST_RULES, "Robust aggregation on the clients' models: "
                      "median, trimmed_mean, krum, multi_krum, robust_product (posterior methods: trimmed and capped "
                      "Gaussian product), mean (only --max_update_norm).", flag_values=flag_values)
    flags.DEFINE_float("robust_trim", 0.2, "--robust_rule=trimmed_mean/robust_product: fraction dropped at each end.",
                       flag_values=flag_values)
    flags.DEFINE_float("robust_byzantine_fraction", 0.2, "--robust_rule=krum/multi_krum: share of attackers assumed.",
                       flag_values=flag_values)
    flags.DEFINE_float("max_update_norm", None, "Bound every client's update norm to this (norm bounding; with any "
                       "--robust_rule).", flag_values=flag_values)
    flags.DEFINE_float("robust_precision_cap", None, "--robust_rule=robust_product: cap each precision at this many "
                       "times the median one.", flag_values=flag_values)
    flags.DEFINE_boolean("precision_cosine", False, "Report precision_cosine every round: the mean cosine similarity "
                         "of pairs of the cohort's normalised precision matrices (FOLA Fig. 11a; a layer on fola and "
                         "other methods sending 'precision'; the aggregation then keeps every message).",
                         flag_values=flag_values)
    # HBFL, FML, ABAVG (HBFL spec section 3; the local models come from --client_architectures).
    number(flags.DEFINE_float, "likelihood_temperature", "hbfl: likelihood temperature T of the meme loss "
           "(default 1e-4).")
    number(flags.DEFINE_float, "meme_lr", "hbfl: the meme's Adam step (default 1e-3).")
    number(flags.DEFINE_float, "meme_weight_decay", "hbfl: L2 on the meme's mu under Adam (default 5e-4).")
    boolean("decay_rho", "hbfl: weight decay on the meme's rho too (Decision 8).")
    number(flags.DEFINE_float, "rho_init", "hbfl: initial rho of every meme weight (default -5).")
    number(flags.DEFINE_float, "rho_init_std", "hbfl: N(0, s^2) noise on the initial rho (default 0).")
    enum("sigma_mode", SIGMA_MODES, "hbfl: meme sigma across rounds (default reinit).")
    enum("teacher", TEACHERS, "hbfl: the meme predictions the local model learns from (default mean).")
    number(flags.DEFINE_integer, "teacher_samples", "hbfl --teacher=mc: samples (default 4).")
    number(flags.DEFINE_integer, "mc_samples", "hbfl: reparameterised samples per meme step (default 1).")
    enum("nll", NLL_FORMS, "hbfl: summed (default) or batch-mean NLL in the meme loss.")
    number(flags.DEFINE_float, "meme_prior_scale", "hbfl: add T*KL(q || N(0, s^2)) to the meme loss (the elbo_prior "
           "variant; default: no prior term).")
    enum("hbfl_weighting", HBFL_WEIGHTINGS, "hbfl: q_k = n_k/n (by_size, default) or equal.")
    number(flags.DEFINE_float, "distill_alpha", "hbfl, fml: CE weight alpha of the local model's loss (default 0.5).")
    number(flags.DEFINE_float, "distill_beta", "fml: CE weight beta of the meme's loss (default 0.5).")
    number(flags.DEFINE_float, "distill_temperature", "hbfl, fml: distillation temperature (default 1).")
    boolean("reinit_local", "hbfl, fml: a fresh local model every round (default: persisted).")
    enum("fml_weighting", FML_WEIGHTINGS, "fml: meme average (default equal, as FML).")
    enum("abavg_weighting", ABAVG_WEIGHTINGS, "abavg: accuracy (default) or accuracy_by_size.")
    enum("abavg_accuracy_source", ACCURACY_SOURCES, "abavg: server_validation (default: the server scores each "
         "model on --validation_fraction of the training set) or client_test (each client reports its accuracy on "
         "its own test split; needs --client_test_splits).")

    for name in ("local_epochs", "batch_size"):
        flags.register_validator(name, lambda v: v is not None and v >= 1, message=f"--{name} must be >= 1",
                                 flag_values=flag_values)
    checks = {
        "lr": (lambda v: v > 0, "--lr must be > 0 (e.g. --lr=0.01)"),
        "lam": (lambda v: v is None or v >= 0, "--lam must be >= 0"),
        "mu": (lambda v: v is None or v >= 0, "--mu must be >= 0"),
        "momentum": (lambda v: v is None or 0 <= v < 1, "--momentum must be in [0, 1)"),
        "weight_decay": (lambda v: v is None or v >= 0, "--weight_decay must be >= 0, e.g. 1e-4"),
        "dwc_floor_ratio": (lambda v: v is None or v > 0, "--dwc_floor_ratio must be > 0, e.g. 1.0"),
        "fedreg_gamma": (lambda v: v is None or 0 <= v <= 1, "--fedreg_gamma must be in [0, 1], e.g. 0.4"),
        "dp_noise": (lambda v: v is None or v >= 0, "--dp_noise must be >= 0, e.g. 0.01"),
        "dp_clip": (lambda v: v is None or v > 0, "--dp_clip must be > 0, e.g. 1.0"),
        "likelihood_temperature": (lambda v: v is None or v > 0, "--likelihood_temperature must be > 0, e.g. 1e-4"),
        "distill_alpha": (lambda v: v is None or 0 <= v <= 1, "--distill_alpha must be in [0, 1], e.g. 0.5"),
        "distill_beta": (lambda v: v is None or 0 <= v <= 1, "--distill_beta must be in [0, 1], e.g. 0.5"),
        "distill_temperature": (lambda v: v is None or v > 0, "--distill_temperature must be > 0, e.g. 1"),
        "fedref_lambda": (lambda v: v is None or v >= 0, "--fedref_lambda must be >= 0, e.g. 0.01"),
        "fedref_p": (lambda v: v is None or v >= 1, "--fedref_p must be >= 1, e.g. 5"),
        "fedref_server_lr": (lambda v: v is None or v >= 0, "--fedref_server_lr must be >= 0, e.g. 0.01"),
        "fedref_warmup": (lambda v: v is None or v >= 0, "--fedref_warmup must be >= 0"),
        "server_lr": (lambda v: v > 0, "--server_lr must be > 0, e.g. 0.01"),
        "server_tau": (lambda v: v >= 0, "--server_tau must be >= 0, e.g. 1e-3"),
        "robust_trim": (lambda v: 0 <= v < 0.5, "--robust_trim must be in [0, 0.5), e.g. 0.2"),
        "robust_byzantine_fraction": (lambda v: 0 <= v < 1, "--robust_byzantine_fraction must be in [0, 1), e.g. 0.2"),
        "max_update_norm": (lambda v: v is None or v > 0, "--max_update_norm must be > 0, e.g. 5"),
        "robust_precision_cap": (lambda v: v is None or v > 0, "--robust_precision_cap must be > 0, e.g. 4"),
    }
    for name, (check, message) in checks.items():
        flags.register_validator(name, check, message=message, flag_values=flag_values)


def options(flag_values: flags.FlagValues = flags.FLAGS) -> tuple[dict, list[str]]:
    """``(options, ignored)``: the chosen algorithm's factory options from the flags, and the set
    option flags that do not apply to it.

    Raises:
      app.UsageError: a DP-SGD flag set for an algorithm without DP-SGD.
    """
    from bfedjax.algorithms import options_of
    name = flag_values.algorithm
    accepted = set(options_of(name))
    out = {option: flag_values[flag].value for flag, option in COMMON.items() if option in accepted}
    ignored = []
    for flag, (option, algorithms) in OPTION_FLAGS.items():
        value = flag_values[flag].value
        if value is None:
            continue
        if name not in algorithms:
            if (flag, name) in RENAMED:
                raise app.UsageError(f"--{flag} is not an option of {name}; fix: use {RENAMED[flag, name]}")
            if flag in MUST_APPLY:
                raise app.UsageError(f"--{flag} (DP-SGD) works with --algorithm={', '.join(algorithms)}, not {name}; "
                                     f"fix: drop --{flag} or pick one of those")
            ignored.append(f"--{flag}")
            continue
        out[option] = None if (flag == "clip_norm" and value == 0) else value
    return out, ignored


def build(flag_values: flags.FlagValues, model, fed, setting: dict | None = None, *, quiet: bool = False):
    """The flags' algorithm for ``model`` on ``fed``.

    ``setting``: options an experiment fixes for every method it runs (e.g. ``local_epochs``),
    passed to the factories that take them and replacing the flags' values.
    Prints one line naming option flags that do not apply (``quiet``: not); a bad option value is a
    ``UsageError``.
    """
    import bfedjax as bf
    opts, ignored = options(flag_values)
    accepted = set(bf.algorithms.options_of(flag_values.algorithm))
    opts.update({k: v for k, v in (setting or {}).items() if k in accepted})
    if ignored and not quiet:
        print(f"note: {', '.join(ignored)} do{'es' if len(ignored) == 1 else ''} not apply to "
              f"--algorithm={flag_values.algorithm} (ignored)", file=sys.stderr, flush=True)
    try:
        algorithm = bf.algorithms.build(flag_values.algorithm, model, fed, **opts)
        rule = flag_values.robust_rule
        if rule == "none" and flag_values.max_update_norm is not None:
            rule = "mean"
        if rule != "none":
            algorithm = bf.algorithms.with_robust_aggregation(
                algorithm, rule, trim=flag_values.robust_trim, byzantine_fraction=flag_values.robust_byzantine_fraction,
                max_update_norm=flag_values.max_update_norm, precision_cap=flag_values.robust_precision_cap)
        if flag_values.precision_cosine:  # outside the robust rule: it compares the precisions the clients sent
            algorithm = bf.algorithms.with_precision_similarity(algorithm)
        if flag_values.server_optimizer != "none":
            tx = bf.algorithms.server_optimizer(flag_values.server_optimizer, flag_values.server_lr,
                                                b1=flag_values.server_b1, b2=flag_values.server_b2,
                                                tau=flag_values.server_tau)
            algorithm = bf.algorithms.with_server_optimizer(algorithm, tx,
                                                            f"{algorithm.name}+{flag_values.server_optimizer}")
        return algorithm
    except ValueError as err:
        raise app.UsageError(str(err)) from None


def parse_args(args: Sequence[str]) -> flags.FlagValues:
    """A fresh ``FlagValues`` with the algorithm flags, parsed from the command-line arguments ``args`` (flags of
    other binaries, e.g. ``experiments.run``'s ``--dataset``, are skipped)."""
    flag_values = flags.FlagValues()
    define(flag_values)
    flag_values(["preset", *args], known_only=True)
    return flag_values


def parse_flagfile(path: str) -> flags.FlagValues:
    """A fresh ``FlagValues`` with the algorithm flags, parsed from the flagfile ``path`` (a method preset)."""
    return parse_args([f"--flagfile={path}"])


__all__ = ["COMMON", "MUST_APPLY", "OPTION_FLAGS", "build", "define", "options", "parse_args", "parse_flagfile"]
