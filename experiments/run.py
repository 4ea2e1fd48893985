r"""Runs one federated experiment from absl flags.

    python -m experiments.run --algorithm=fola --dataset=fashion_mnist \
        --partition=dirichlet_per_class --alpha=0.01 --num_clients=20 --rounds=10

    python -m experiments.run --flagfile=experiments/configs/fola_fmnist_demo.flags

Prints one progress line per round (round, GA, LA, seconds), writes
``metrics.jsonl`` (one JSON record per round) and ``summary.json`` into
``--output_dir``, and checkpoints every round there so a crashed run resumes
where it stopped (``--noresume`` starts over).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import numpy as np
from absl import app, flags, logging

ALGORITHMS = ("fedavg", "fedprox", "fedcurv", "fola", "bfl", "sgd", "scaffold", "fednova", "fedreg")
DATASETS = ("digits", "mnist", "fashion_mnist", "mnist_5k", "emnist", "cifar10", "cifar100")
PARTITIONS = ("iid", "dirichlet_per_class", "dirichlet_per_client", "shards", "power_law", "single_class",
              "class_groups")
MODELS = ("logistic", "mlp", "mlp_500_300", "mlp_200_200", "fola_cnn", "lenet", "resnet20", "fedreg_cnn")

FLAGS = flags.FLAGS
# What to run.
flags.DEFINE_enum("algorithm", "fola", ALGORITHMS, "Federated algorithm.")
flags.DEFINE_enum("model", "mlp", MODELS, "Model architecture.")
flags.DEFINE_list("hidden", ["200", "200"], "Hidden widths of --model=mlp.")
flags.DEFINE_float("dropout_rate", 0.0, "MC dropout (MLPs, resnet20): dropout layers of this rate, on at test time "
                   "(Fischer et al.'s baseline: --algorithm=fedavg --dropout_rate=0.2).")
# Data.
flags.DEFINE_enum("dataset", "digits", DATASETS, "Data set.")
flags.DEFINE_string("data_dir", None, "Folder with IDX files (else $BFEDJAX_DATA_DIR, Debian's folder, TFDS).")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir with prepared data sets.")
flags.DEFINE_integer("max_train", None, "Subsample the training set to this many samples.")
flags.DEFINE_integer("max_test", None, "Subsample the test set to this many samples.")
flags.DEFINE_bool("fallback_to_digits", False, "If the data set cannot be had, print a notice and use digits.")
flags.DEFINE_enum("partition", "dirichlet_per_class", PARTITIONS, "How the training set is split over clients.")
flags.DEFINE_float("alpha", 0.5, "Dirichlet concentration.")
flags.DEFINE_integer("classes_per_client", 2, "Classes per client for shards / power_law.")
flags.DEFINE_integer("samples_per_client", 24, "Images per client for --partition=single_class (FedReg EMNIST: 24).")
flags.DEFINE_enum("pixels", "standardised", ("standardised", "unit"),
                  "Input scale: standardised, or [0, 1] (FedReg's eta_s is in these units).")
flags.DEFINE_string("class_groups", "0-4;5-9", "For --partition=class_groups: ';'-separated label ranges/lists.")
flags.DEFINE_integer("num_clients", 20, "Clients N.")
flags.DEFINE_list("client_weights", None, "Override pi_n = m_n/m with these N weights (e.g. 0.51,0.49), or "
                  "'uniform' for the unweighted cohort mean (FedReg's experiments).")
# Rounds.
flags.DEFINE_integer("rounds", 10, "Federated rounds R.")
flags.DEFINE_integer("clients_per_round", None, "Cohort size K (default: all clients).")
flags.DEFINE_float("participation", None, "Alternatively, the fraction of clients sampled each round.")
flags.DEFINE_integer("clients_per_chunk", None, "Train the cohort in chunks of this many clients.")
flags.DEFINE_enum("backend", "vmap", ("vmap", "sequential", "stepwise"), "Round engine backend.")
flags.DEFINE_integer("local_epochs", 1, "Local epochs E.")
flags.DEFINE_integer("batch_size", 32, "Local batch size B.")
flags.DEFINE_float("lr", 0.01, "Local SGD learning rate.")
flags.DEFINE_float("lam", None, "Prior weight lambda (FOLA, FedCurv) or mu (FedProx); default per algorithm.")
flags.DEFINE_float("clip_norm", None, "Global-norm gradient clip; 0 disables; default per algorithm (10, FedProx none).")
flags.DEFINE_float("momentum", 0.0, "Local SGD momentum.")
flags.DEFINE_enum("optimizer", "sgd", ("sgd", "adam"), "fedavg: local optimiser (Fischer et al.: adam, lr 1e-3).")
flags.DEFINE_float("weight_decay", 0.0, "fedavg: L2 penalty on dense/conv kernels (Fischer et al. D19: 1e-4 for the "
                   "deterministic and MC-dropout baselines; the KL regularises the variational clients).")
flags.DEFINE_enum("augment", "none", ("none", "shift_flip"), "Augment every local mini-batch inside the jitted "
                  "round: shift_flip = random shifts of up to 10% of the width/height and horizontal flips "
                  "(Fischer et al. D19, for CIFAR-10).")
flags.DEFINE_enum("lr_schedule", "constant", ("constant", "exponential", "geometric", "literal"),
                  "Per-round learning rate: constant, or after --lr_decay_start rounds decayed "
                  "(exponential: lr*exp(-rate*(r-start)), Fischer et al. spec D8).")
flags.DEFINE_integer("lr_decay_start", 50, "Rounds at the full learning rate before the decay.")
flags.DEFINE_float("lr_decay_rate", 0.04, "Decay rate of --lr_schedule.")
flags.DEFINE_integer("test_samples", 10, "MC samples of the final predictive (bfl, MC dropout) for summary.json.")
flags.DEFINE_integer("seed", 0, "Seed of partition, init and training.")
# FOLA options (spec section 3).
flags.DEFINE_enum("fola_profile", "default", ("default", "authors_code", "paper"), "FOLA preset of the options below.")
flags.DEFINE_enum("fisher", None, ("batch_mean_sq", "per_sample_sq", "alg1_raw", "offline"), "FOLA Fisher estimator.")
flags.DEFINE_enum("normalisation", None, ("sum_over_epochs", "mean_over_steps"), "FOLA Fisher normalisation.")
flags.DEFINE_enum("precision_mode", None, ("running_sum", "running_average"), "FOLA precision state (Eq. 24/25).")
flags.DEFINE_float("damping", None, "FOLA Fisher damping delta.")
flags.DEFINE_float("eps", None, "FOLA product denominator guard.")
flags.DEFINE_float("gamma", None, "FOLA extra prior precision.")
flags.DEFINE_bool("prior_grad", None, "FOLA: False detaches the prior as in the released code.")
flags.DEFINE_enum("rule", "wc", ("nwa", "ws", "lp", "conflation", "iv", "wc", "llp", "clp", "dwc"),
                  "bfl: aggregation rule (Fischer et al.).")
flags.DEFINE_enum("weighting", "train_size", ("equal", "train_size", "max_discrepancy", "distance"),
                  "bfl: client weighting.")
flags.DEFINE_enum("dwc_guard", "conflation", ("conflation", "floor", "none"),
                  "bfl --rule=dwc: where Eq. 17's precision is not positive fall back to conflation, or clip it "
                  "at --dwc_floor_ratio x the clients' mean precision, or no guard (spec D17).")
flags.DEFINE_float("dwc_floor_ratio", 1.0, "Floor of --dwc_guard=floor, relative to the clients' mean precision.")
flags.DEFINE_bool("prior_update", False, "bfl: clients use the global posterior as their ELBO prior.")
flags.DEFINE_float("prior_scale", 10.0, "bfl: std of the N(0, s^2) weight prior.")
flags.DEFINE_bool("variational_biases", False, "bfl: biases variational too (default: point estimates).")
flags.DEFINE_integer("train_samples", 1, "bfl: MC samples of the ELBO per step.")
flags.DEFINE_enum("vi_estimator", "flipout", ["flipout", "reparameterization"],
                  "bfl: gradient estimator of the expected log-likelihood (Flipout: per-example sign-flipped "
                  "kernel noise, spec D21; reparameterization: one weight sample per batch).")
flags.DEFINE_float("pretrain_fraction", 0.0, "Pre-train the global model before round 1 on this stratified "
                   "fraction of the training set (Fischer et al.'s DWC protocol, 0.1).")
flags.DEFINE_integer("pretrain_epochs", 5, "Epochs of server pre-training (the most, with early stopping).")
flags.DEFINE_float("pretrain_validation_fraction", 0.0, "Hold out this fraction of the pre-training data and stop "
                   "early on its accuracy (Fischer et al. D17: 0.1); 0 trains --pretrain_epochs epochs.")
flags.DEFINE_integer("pretrain_patience", 10, "Early stopping: epochs without a better validation accuracy.")
flags.DEFINE_bool("pretrain_disjoint", False, "Take the pre-training fraction away from the clients (default: it "
                  "may overlap their data, spec D17).")
flags.DEFINE_enum("fedcurv_variant", "authors", ("authors", "leave_one_out", "previous_round"),
                  "FedCurv form (previous_round: the FedReg authors', per-sample Fisher, no clipping).")
flags.DEFINE_enum("fedprox_scaling", "half", ("half", "full"), "FedProx term mu/2||.||^2 (half) or mu||.||^2 (full, "
                  "the FedReg authors' code).")
# FedReg (and its baselines' options).
flags.DEFINE_float("fedreg_gamma", 0.5, "FedReg: gradient taken at gamma*theta + (1-gamma)*theta_global.")
flags.DEFINE_float("eta_s", 0.05, "FedReg: pseudo-data sign-ascent step.")
flags.DEFINE_float("eta_p", None, "FedReg: perturbed-data step (default 0.01 * eta_s).")
flags.DEFINE_bool("mg", False, "FedReg with MG (gradient projected off the uniform-label pseudo-data gradient).")
flags.DEFINE_enum("fedreg_granularity", "per_batch", ("per_batch", "full_set", "per_step"), "FedReg pseudo-data unit.")
flags.DEFINE_enum("fedreg_clamp", "batch_range", ("batch_range", "valid_range", "none"), "FedReg generation clamp.")
flags.DEFINE_enum("scaffold_option", "II", ("II", "I"), "SCAFFOLD control-variate update.")
flags.DEFINE_float("dp_clip", None, "DP-SGD per-example clip norm C (fedavg, fedprox, fedcurv, sgd); unset: no DP.")
flags.DEFINE_float("dp_noise", 0.0, "DP-SGD noise multiplier sigma (std sigma*C on the clipped sum).")
# Output.
flags.DEFINE_string("output_dir", "/tmp/bfedjax_run", "Where metrics.jsonl, summary.json and checkpoints go.")
flags.DEFINE_bool("resume", True, "Resume from the last checkpoint in --output_dir.")
flags.DEFINE_bool("evaluate_local", True, "Also compute LA (every local model on the test set).")
flags.DEFINE_list("targets", ["0.5", "0.7", "0.8"], "GA thresholds for rounds-to-target in summary.json.")

for _name in ("num_clients", "rounds", "local_epochs", "batch_size"):
    flags.register_validator(_name, lambda v: v is not None and v >= 1, message=f"--{_name} must be >= 1")
flags.register_validator("alpha", lambda v: v > 0, message="--alpha must be > 0 (e.g. --alpha=0.01)")
flags.register_validator("lr", lambda v: v > 0, message="--lr must be > 0 (e.g. --lr=0.01)")
flags.register_validator("lam", lambda v: v is None or v >= 0, message="--lam must be >= 0")
flags.register_validator("clients_per_round", lambda v: v is None or v >= 1, message="--clients_per_round must be >= 1")
flags.register_validator("participation", lambda v: v is None or 0 < v <= 1,
                         message="--participation must be in (0, 1], e.g. --participation=0.1")
flags.register_validator("clients_per_chunk", lambda v: v is None or v >= 1, message="--clients_per_chunk must be >= 1")
flags.register_validator("weight_decay", lambda v: v >= 0, message="--weight_decay must be >= 0, e.g. 1e-4")
flags.register_multi_flags_validator(
    ["weight_decay", "algorithm"], lambda f: not f["weight_decay"] or f["algorithm"] == "fedavg",
    message="--weight_decay is for --algorithm=fedavg (the deterministic and MC-dropout baselines)")
flags.register_validator("pretrain_validation_fraction", lambda v: 0 <= v < 1,
                         message="--pretrain_validation_fraction must be in [0, 1), e.g. 0.1")
flags.register_validator("pretrain_fraction", lambda v: 0 <= v < 1,
                         message="--pretrain_fraction must be in [0, 1), e.g. --pretrain_fraction=0.1")
flags.register_validator("momentum", lambda v: 0 <= v < 1, message="--momentum must be in [0, 1)")
flags.register_validator("dropout_rate", lambda v: 0 <= v < 1, message="--dropout_rate must be in [0, 1), e.g. 0.2")
flags.register_validator("lr_decay_rate", lambda v: 0 < v < 1, message="--lr_decay_rate must be in (0, 1), e.g. 0.04")
flags.register_validator("dwc_floor_ratio", lambda v: v > 0, message="--dwc_floor_ratio must be > 0, e.g. 1.0")
flags.register_validator("test_samples", lambda v: v >= 1, message="--test_samples must be >= 1")
flags.register_validator("fedreg_gamma", lambda v: 0 <= v <= 1, message="--fedreg_gamma must be in [0, 1], e.g. 0.4")
flags.register_validator("dp_noise", lambda v: v >= 0, message="--dp_noise must be >= 0, e.g. 0.01")
flags.register_validator("dp_clip", lambda v: v is None or v > 0, message="--dp_clip must be > 0, e.g. 1.0")
flags.register_multi_flags_validator(
    ["dp_clip", "algorithm"], lambda f: f["dp_clip"] is None or f["algorithm"] in ("fedavg", "fedprox", "fedcurv", "sgd"),
    message="--dp_clip (DP-SGD) works with --algorithm=fedavg, fedprox, fedcurv or sgd")
flags.register_multi_flags_validator(
    ["optimizer", "algorithm"], lambda f: f["optimizer"] == "sgd" or f["algorithm"] == "fedavg",
    message="--optimizer=adam is for --algorithm=fedavg (bfl clients always use Adam)")
flags.register_multi_flags_validator(
    ["clients_per_round", "num_clients"],
    lambda f: f["clients_per_round"] is None or f["clients_per_round"] <= f["num_clients"],
    message="--clients_per_round must be <= --num_clients")
flags.register_multi_flags_validator(
    ["clients_per_round", "participation"],
    lambda f: f["clients_per_round"] is None or f["participation"] is None,
    message="give --clients_per_round or --participation, not both")
flags.register_multi_flags_validator(
    ["client_weights", "num_clients"],
    lambda f: f["client_weights"] is None or f["client_weights"] == ["uniform"]
    or len(f["client_weights"]) == f["num_clients"],
    message="--client_weights needs exactly --num_clients comma-separated numbers, or 'uniform'")


def parse_class_groups(text: str) -> list[list[int]]:
    """'0-4;5-9' or '0,2,4;1,3' -> [[0..4], [5..9]]."""
    groups = []
    for part in text.split(";"):
        labels = []
        for item in part.split(","):
            item = item.strip()
            if "-" in item:
                lo, hi = item.split("-")
                labels.extend(range(int(lo), int(hi) + 1))
            elif item:
                labels.append(int(item))
        groups.append(labels)
    return groups


def load_dataset():
    import bfedjax as bf
    try:
        return bf.data.load(FLAGS.dataset, FLAGS.data_dir, tfds_data_dir=FLAGS.tfds_data_dir,
                            max_train=FLAGS.max_train, max_test=FLAGS.max_test, seed=FLAGS.seed, pixels=FLAGS.pixels)
    except bf.data.DataUnavailableError as err:
        if not FLAGS.fallback_to_digits:
            raise
        print(f"NOTICE: {FLAGS.dataset} is not available here ({str(err).splitlines()[0][:200]}); "
              "falling back to scikit-learn's digits.", flush=True)
        return bf.data.load("digits", seed=FLAGS.seed, pixels=FLAGS.pixels)


def split_server_data(dataset, fraction: float, seed: int):
    """A stratified ``fraction`` of the training indices, held out for the server."""
    rng = np.random.default_rng(seed + 7)
    held = [rng.permutation(np.flatnonzero(dataset.y_train == c))[: int(round(fraction * np.sum(dataset.y_train == c)))]
            for c in range(dataset.num_classes)]
    return dataset, np.sort(np.concatenate(held))


def make_partition(labels):
    import bfedjax as bf
    scheme = FLAGS.partition
    kwargs = {}
    if scheme.startswith("dirichlet"):
        kwargs["alpha"] = FLAGS.alpha
    elif scheme in ("shards", "power_law"):
        kwargs["classes_per_client"] = FLAGS.classes_per_client
    elif scheme == "single_class":
        kwargs["samples_per_client"] = FLAGS.samples_per_client
    if scheme == "class_groups":
        groups = parse_class_groups(FLAGS.class_groups)
        if len(groups) != FLAGS.num_clients:
            raise app.UsageError(f"--class_groups has {len(groups)} groups but --num_clients={FLAGS.num_clients}")
        return bf.data.class_groups(labels, groups, seed=FLAGS.seed)
    return bf.data.partition(labels, scheme, FLAGS.num_clients, seed=FLAGS.seed, **kwargs)


def make_algorithm(num_classes: int, input_shape: tuple[int, ...]):
    import bfedjax as bf
    try:
        model = bf.models.get_model(FLAGS.model, num_classes, hidden=tuple(int(h) for h in FLAGS.hidden),
                                    dropout_rate=FLAGS.dropout_rate)
    except ValueError as err:
        raise app.UsageError(f"{err} (--model / --dropout_rate)") from None
    common = dict(lr=FLAGS.lr, local_epochs=FLAGS.local_epochs, batch_size=FLAGS.batch_size)
    if FLAGS.clip_norm is not None:
        common["clip_norm"] = FLAGS.clip_norm or None
    if FLAGS.momentum:
        common["momentum"] = FLAGS.momentum
    lam = {} if FLAGS.lam is None else {"lam": FLAGS.lam}
    dp = {"dp_clip": FLAGS.dp_clip, "dp_noise": FLAGS.dp_noise} if FLAGS.dp_clip else {}
    if FLAGS.algorithm == "fedavg":
        return bf.algorithms.fedavg(model, optimizer=FLAGS.optimizer, weight_decay=FLAGS.weight_decay, **common, **dp)
    if FLAGS.algorithm == "sgd":
        return bf.algorithms.sgd(model, lr=FLAGS.lr, client_size=FLAGS.batch_size, **dp)  # resized in main()
    if FLAGS.algorithm == "fedprox":
        return bf.algorithms.fedprox(model, **({"mu": FLAGS.lam} if FLAGS.lam is not None else {}),
                                     scaling=FLAGS.fedprox_scaling, **common, **dp)
    if FLAGS.algorithm == "scaffold":
        return bf.algorithms.scaffold(model, num_clients=FLAGS.num_clients, option=FLAGS.scaffold_option, **common)
    if FLAGS.algorithm == "fednova":
        return bf.algorithms.fednova(model, **common)
    if FLAGS.algorithm == "fedreg":
        try:
            return bf.algorithms.fedreg(model, gamma=FLAGS.fedreg_gamma, eta_s=FLAGS.eta_s, eta_p=FLAGS.eta_p,
                                        mg=FLAGS.mg, granularity=FLAGS.fedreg_granularity, clamp=FLAGS.fedreg_clamp,
                                        lr=FLAGS.lr, local_epochs=FLAGS.local_epochs, batch_size=FLAGS.batch_size)
        except ValueError as err:
            raise app.UsageError(str(err)) from None
    if FLAGS.algorithm == "bfl":
        return bf.algorithms.bfl(model, input_shape, rule=FLAGS.rule, weighting_scheme=FLAGS.weighting,
                                 prior_update=FLAGS.prior_update, lr=FLAGS.lr, local_epochs=FLAGS.local_epochs,
                                 batch_size=FLAGS.batch_size, prior_scale=FLAGS.prior_scale,
                                 variational_biases=FLAGS.variational_biases, train_samples=FLAGS.train_samples,
                                 estimator=FLAGS.vi_estimator, dwc_guard=FLAGS.dwc_guard, dwc_floor_ratio=FLAGS.dwc_floor_ratio)
    if FLAGS.algorithm == "fedcurv":
        if FLAGS.fedcurv_variant == "previous_round":
            common = {"clip_norm": None, **common, "estimator": "per_sample_sq"}
        return bf.algorithms.fedcurv(model, variant=FLAGS.fedcurv_variant, **lam, **common, **dp)
    options = {name: getattr(FLAGS, name) for name in
               ("fisher", "normalisation", "precision_mode", "damping", "eps", "gamma", "prior_grad")
               if getattr(FLAGS, name) is not None}
    return bf.algorithms.fola(model, profile=FLAGS.fola_profile, **lam, **common, **options)


def learning_rate_fn():
    """``round -> {"lr": ...}`` for a decaying --lr_schedule, else None."""
    import bfedjax as bf
    if FLAGS.lr_schedule == "constant":
        return None
    schedule = bf.core.lr_schedule(FLAGS.lr_schedule, FLAGS.lr, start=FLAGS.lr_decay_start, rate=FLAGS.lr_decay_rate)
    return lambda r: {"lr": schedule(r)}


def final_uncertainty(algorithm, server, fed) -> dict:
    """Accuracy, NLL, ECE, Brier and mean entropy of the final global predictive on the test set.

    bfl: the ``--test_samples``-sample MC predictive of the posterior; MC dropout:
    as many dropout passes; otherwise the softmax of the global model.
    """
    import jax
    import jax.numpy as jnp
    import bfedjax as bf
    probs = bf.algorithms.predict_proba(algorithm, server, jnp.asarray(fed.x_test),
                                        jax.random.PRNGKey(FLAGS.seed + 20_000), FLAGS.test_samples)
    out = bf.metrics.uncertainty.summary(probs, jnp.asarray(fed.y_test))
    return {k: float(v) for k, v in out.items() if jnp.ndim(v) == 0}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    import jax
    import bfedjax as bf

    dataset = load_dataset()
    algorithm = make_algorithm(dataset.num_classes, tuple(dataset.x_train.shape[1:]))
    if FLAGS.augment != "none":
        if dataset.x_train.ndim != 4:
            raise app.UsageError(f"--augment={FLAGS.augment} needs image data [N, H, W, C]; {dataset.name} has "
                                 f"shape {dataset.x_train.shape[1:]}; fix: --augment=none")
        algorithm = bf.data.augmented(algorithm, bf.data.AUGMENTATIONS[FLAGS.augment])
    init_server = None
    if FLAGS.pretrain_fraction > 0:
        dataset, held_out = split_server_data(dataset, FLAGS.pretrain_fraction, FLAGS.seed)
        init_server = bf.core.pretrain(algorithm, dataset.x_train[held_out], dataset.y_train[held_out],
                                       epochs=FLAGS.pretrain_epochs, key=jax.random.PRNGKey(FLAGS.seed + 10_000),
                                       num_classes=dataset.num_classes,
                                       validation_fraction=FLAGS.pretrain_validation_fraction,
                                       patience=FLAGS.pretrain_patience)
        if FLAGS.pretrain_disjoint:
            keep = np.setdiff1d(np.arange(len(dataset.y_train)), held_out)
            dataset = dataclasses.replace(dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep])
        stopping = " at most, stopping early" if FLAGS.pretrain_validation_fraction else ""
        print(f"pre-trained the server model on {len(held_out)} training samples for {FLAGS.pretrain_epochs} "
              f"epochs{stopping}"
              f"{' (removed from the clients)' if FLAGS.pretrain_disjoint else ''}", flush=True)
    parts = make_partition(dataset.y_train)
    fed = bf.data.from_partition(dataset, parts)
    if algorithm.name == "sgd":  # FedReg's SGD baseline: one step on the whole of the largest client
        algorithm = algorithm._replace(batch_size=fed.max_n)
    weights = FLAGS.client_weights
    if weights and weights != ["uniform"]:
        weights = [float(w) for w in weights]
    elif weights:
        weights = "uniform"

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    checkpoints = os.path.join(FLAGS.output_dir, "checkpoints")
    metrics_path = os.path.join(FLAGS.output_dir, "metrics.jsonl")
    if not FLAGS.resume:
        shutil.rmtree(checkpoints, ignore_errors=True)
    print(f"{algorithm.name} on {dataset.name} ({dataset.source}): {fed.num_clients} clients, "
          f"sizes {int(fed.counts.min())}..{int(fed.counts.max())}, {FLAGS.partition}, "
          f"{FLAGS.rounds} rounds, E={FLAGS.local_epochs}, B={FLAGS.batch_size}, lr={FLAGS.lr}, "
          f"hparams={algorithm.hparams}, clients with pi_n < 1e-3: {int(np.sum(fed.weights < 1e-3))}", flush=True)

    with open(metrics_path, "w") as sink:
        def on_round(record):
            la = record.get("local_accuracy", float("nan"))
            print(f"round {record['round']:4d}  GA {record['global_accuracy']:.4f}  LA {la:.4f}  "
                  f"loss {record['global_loss']:.4f}  {record['seconds']:.2f}s", flush=True)
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        result = bf.simulate(
            algorithm, fed, rounds=FLAGS.rounds, key=jax.random.PRNGKey(FLAGS.seed),
            clients_per_round=FLAGS.clients_per_round, participation=FLAGS.participation,
            clients_per_chunk=FLAGS.clients_per_chunk,
            backend=FLAGS.backend, client_weights=weights, evaluate_local=FLAGS.evaluate_local,
            checkpoint_dir=checkpoints, on_round=on_round, init_server=init_server,
            hparams_fn=learning_rate_fn())
    with open(metrics_path, "w") as sink:  # complete history, restored rounds included
        for r in range(len(result.metrics["round"])):
            sink.write(json.dumps({k: v[r] for k, v in result.metrics.items()}) + "\n")

    ga = result.metrics["global_accuracy"]
    summary = {
        "algorithm": algorithm.name, "dataset": dataset.name, "source": dataset.source,
        "flags": {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])},
        "round1_global_accuracy": ga[0], "final_global_accuracy": ga[-1], "best_global_accuracy": max(ga),
        "rounds_to_target": {t: bf.metrics.rounds_to_target(ga, float(t)) for t in FLAGS.targets},
    }
    if "local_accuracy" in result.metrics:
        summary["best_local_accuracy"] = max(result.metrics["local_accuracy"])
    summary["uncertainty"] = final_uncertainty(algorithm, result.state.server, fed)
    print("final predictive: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["uncertainty"].items()
                                           if isinstance(v, float)), flush=True)
    with open(os.path.join(FLAGS.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"done: round-1 GA {ga[0]:.4f}, best GA {max(ga):.4f}, final GA {ga[-1]:.4f} -> {FLAGS.output_dir}")


if __name__ == "__main__":
    app.run(main)
