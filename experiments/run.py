r"""Runs one federated experiment from absl flags.

    python -m experiments.run --algorithm=fola --dataset=fashion_mnist \
        --partition=dirichlet_per_class --alpha=0.01 --num_clients=20 --rounds=10

    python -m experiments.run --flagfile=experiments/configs/fola_fmnist_demo.flags

    python -m experiments.run --flagfile=experiments/configs/fedref/vessels_unet.flags   # segmentation

Prints one progress line per round (round, GA, LA, seconds; with
``--task=segmentation`` the global model's Dice, IoU and HD95; on a terminal
above a progress bar with an ETA), writes ``metrics.jsonl`` (one JSON record
per round), ``summary.json`` and, for classification, ``evaluation.json`` (the
final predictive's reliability bins, accuracy vs retained data, per-client
accuracy; ``python -m experiments.plot OUT_DIR`` draws them) into
``--output_dir``, with ``--tensorboard`` also TensorBoard event files in
``OUT_DIR/tensorboard``, and checkpoints every round there so a crashed run
resumes where it stopped (``--noresume`` starts over). A folder whose checkpoints
another command saved (other flags than ``RESUMABLE_FLAGS``: ``--rounds``, the
layout, logging and evaluation) is not resumed: one line names what differs.

A bad command line (a flag out of range, flags that conflict, missing data, an impossible partition)
stops with one line on stderr, ``error: ...; fix: ...``, and exit status 2 (``experiments.errors``).
``setup`` does everything up to the first round and can be called in-process (``prepare(argv)``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import warnings
from typing import Any, Sequence

import numpy as np
from absl import app, flags, logging

import bfedjax as bf
from experiments import algorithm_flags, errors, round_log

FLAGS = flags.FLAGS
# What to run: --algorithm, --lr, --local_epochs, --batch_size and the algorithms' options.
algorithm_flags.define(FLAGS)
flags.adopt_module_key_flags(algorithm_flags)  # --helpshort lists them with this binary's own
flags.DEFINE_enum("task", "classification", list(bf.tasks.TASKS), "What the model learns: classification, or "
                  "segmentation (--model=unet on --dataset=vessels, mnist_5k_foreground, drive, oxford_iiit_pet or fets; "
                  "--model=unet3d on --dataset=fets_volumes; loss --segmentation_loss; Dice, IoU and HD95 reported; "
                  "fedavg, fedprox and fedref).")
flags.DEFINE_enum("segmentation_loss", "ce_dice", list(bf.metrics.segmentation.LOSSES), "--task=segmentation's loss: "
                  "ce_dice (cross-entropy + soft Dice per image), or the FedRef authors' focal (DRIVE) and dice_focal "
                  "(FeTS): segmentation_models_pytorch's multiclass losses as they configure them.")
flags.DEFINE_enum("segmentation_head", "sigmoid", list(bf.models.SEGMENTATION_HEADS), "--task=segmentation on "
                  "binary masks: sigmoid (one foreground logit per pixel; class 0's logit is the constant 0) or softmax "
                  "(one trainable logit per class, the FedRef authors' two-channel DRIVE head). More classes: "
                  "always one logit per class.")
flags.DEFINE_enum("model", "mlp", list(bf.models.MODELS), "Model architecture.")
flags.DEFINE_list("hidden", ["200", "200"], "Hidden widths of --model=mlp.")
flags.DEFINE_enum("compute_dtype", "float32", list(bf.models.COMPUTE_DTYPES), "Dtype of the models' activations "
                  "and matrix products; bfloat16 is mixed precision (parameters, optimiser and logits stay float32).")
flags.DEFINE_float("dropout_rate", 0.0, "MC dropout (MLPs, resnet20): dropout layers of this rate, on at test time "
                   "(Fischer et al.'s baseline: --algorithm=fedavg --dropout_rate=0.2).")
# Data.
flags.DEFINE_enum("dataset", "digits", list(bf.data.DATASETS) + [f"emnist/{c}" for c in bf.data.EMNIST_CONFIGS],
                  "Data set (emnist: emnist/balanced).")
flags.DEFINE_string("data_dir", None, "Folder with the data set's files (mnist, fashion_mnist: IDX; drive, fets, "
                    "fets_volumes); "
                    "it must exist and hold them. Unset: $BFEDJAX_DATA_DIR, Debian's folder, TFDS.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir with prepared data sets.")
flags.DEFINE_enum("fets_labels", "whole_tumour", list(bf.data.segmentation.FETS_LABELS), "--dataset=fets or "
                  "fets_volumes: whole_tumour masks (seg > 0), or the FedRef authors' 4 classes (FeTS's labels 0, 1, 2, "
                  "4 as 0..3; the model gets one logit per class).")
flags.DEFINE_list("volume_size", None, "--dataset=fets_volumes: resize every volume to D,H,W voxels (e.g. 48,64,64); "
                  "unset keeps FeTS's grid (155,240,240).")
flags.DEFINE_integer("max_train", None, "Subsample the training set to this many samples.")
flags.DEFINE_integer("max_test", None, "Subsample the test set to this many samples.")
flags.DEFINE_bool("fallback_to_digits", False, "If the data set cannot be had, print a notice and use digits "
                  "(not when an explicit --data_dir is wrong).")
flags.DEFINE_bool("allow_nonfinite_inputs", False, "Keep loaded inputs that hold NaN/Inf (one warning line with "
                  "the counts) instead of stopping; e.g. to see how the algorithms cope with a poisoned client.")
flags.DEFINE_enum("partition", "dirichlet_per_class", list(bf.data.PARTITIONERS) + ["institutions"],
                  "How the training set is split over clients (institutions: one client per institution of a data "
                  "set that records them, --dataset=fets or fets_volumes).")
flags.DEFINE_float("alpha", 0.5, "Dirichlet concentration.")
flags.DEFINE_list("round_fractions", None, "Each round every client trains on the first f * n_k of its samples, f "
                  "drawn from these (default with --partition=nested: 0.5,0.6,0.7,0.8,0.9, FedRef's protocol).")
flags.DEFINE_integer("classes_per_client", 2, "Classes per client for shards / power_law.")
flags.DEFINE_integer("samples_per_client", 24, "Images per client for --partition=single_class (FedReg EMNIST: 24).")
flags.DEFINE_enum("pixels", "standardised", list(bf.data.PIXELS),
                  "Input scale: standardised, or [0, 1] (FedReg's eta_s is in these units).")
flags.DEFINE_string("class_groups", "0-4;5-9", "For --partition=class_groups: ';'-separated label ranges/lists.")
flags.DEFINE_integer("num_clients", 20, "Clients N.")
flags.DEFINE_string("client_architectures", None, "hbfl, fml: each client's local model as name:count,... summing to "
                    "--num_clients (HBFL's setting: mlp:2,lenet:2,cnn1:3,cnn2:3); unset: every client's local model "
                    "is --model; 'none' (hbfl): no local model, the 'Bayesian aggregation only' ablation.")
flags.DEFINE_integer("shuffle_architectures", None, "Permute the --client_architectures assignment with this seed "
                     "(default: in order, clients 0-1 first architecture, ...).")
flags.DEFINE_float("straggler_fraction", 0.0, "Each round this fraction of clients trains x ~ U{1..E} epochs "
                   "(the same draw for every algorithm at a --seed).")
flags.DEFINE_enum("straggler_weighting", "unchanged", ["unchanged", "by_epochs"], "unchanged: a straggler keeps "
                  "its aggregation weight (HBFL spec Decision 14); by_epochs: q_k proportional to n_k x / E.")
flags.DEFINE_bool("client_test_splits", False, "Give each client a test split with its training split's Dirichlet "
                  "proportions (--partition=dirichlet_per_class) and report client_test_accuracy (HBFL's per-client "
                  "accuracy).")
flags.DEFINE_float("validation_fraction", 0.1, "abavg: stratified fraction of the training set the server holds "
                   "out for validation.")
flags.DEFINE_list("client_weights", None, "Override pi_n = m_n/m with these N weights (e.g. 0.51,0.49), or "
                  "'uniform' for the unweighted cohort mean (FedReg's experiments).")
# Faults and attacks.
flags.DEFINE_enum("attack", "none", ["none"] + list(bf.core.ATTACKS), "Simulated malicious clients: sign_flip "
                  "(reversed update), scale (boosted update), noise (N(0, s^2) update), label_flip (labels K-1-y), nan (a "
                  "fault: the clients send NaN, which the round leaves out).")
flags.DEFINE_float("attack_fraction", 0.2, "--attack: share of the clients that attack (seeded by --seed).")
flags.DEFINE_float("attack_scale", None, "--attack=sign_flip/scale: the update's factor (default 1 / 10).")
flags.DEFINE_float("attack_noise_std", 1.0, "--attack=noise: standard deviation of the sent update.")
flags.DEFINE_enum("on_nonfinite", "drop", ["drop", "stop"], "A client that sends NaN or Inf is left out of the "
                  "aggregation and counted (drop), or also stops the run naming the round and the client (stop).")
# Rounds.
flags.DEFINE_integer("rounds", 10, "Federated rounds R.")
flags.DEFINE_integer("clients_per_round", None, "Cohort size K (default: all clients).")
flags.DEFINE_float("participation", None, "Alternatively, the fraction of clients sampled each round.")
flags.DEFINE_string("clients_per_chunk", "auto", "Train the cohort in chunks of this many clients (1: one after "
                    "another); 'none': the whole cohort in one vmap; 'auto': chosen from the platform, the model "
                    "and the cohort (bfedjax.core.layout).")
flags.DEFINE_string("cpu_devices", "auto", "On a CPU, split it into this many JAX devices before anything runs and "
                    "train the cohort's chunks on all of them at once (bfedjax.core.layout.use_cpu_cores; "
                    "simulate's client_devices); 'auto': one per usable core; 1: one device.")
flags.DEFINE_string("compilation_cache_dir", "auto", "JAX's persistent compilation cache "
                    "(bfedjax.core.compile_cache): a rerun, another seed or a resumed run loads the compiled round "
                    "from here instead of compiling it again. 'auto': $XDG_CACHE_HOME/bfedjax/jax (~/.cache/...), "
                    "off with a note if it cannot be written; 'none': off. JAX_COMPILATION_CACHE_DIR, where set, wins.")
flags.DEFINE_enum("backend", "vmap", list(bf.core.BACKENDS), "Round engine backend (debug: jit off, errors name "
                  "the client and the stage).")
flags.DEFINE_enum("augment", "none", list(bf.data.AUGMENTATIONS), "Augment every local mini-batch inside the "
                  "jitted round: shift_flip = random shifts of up to 10% of the width/height and horizontal flips "
                  "(Fischer et al.'s CIFAR-10 augmentation); crop_flip = random crops of the image zero-padded "
                  "by 4 px and horizontal flips (the HBFL spec's CIFAR option); autoaugment_cutout = FOLA's "
                  "Table I on RGB 8-bit data: crops with grey padding, flips, AutoAugment's CIFAR-10 policy "
                  "(Pillow's operations) and Cutout 16.")
flags.DEFINE_enum("lr_schedule", "constant", list(bf.core.SCHEDULES),
                  "Per-round learning rate: constant, or after --lr_decay_start rounds decayed "
                  "(exponential: lr*exp(-rate*(r-start)), the spec's reading of Fischer et al.).")
flags.DEFINE_integer("lr_decay_start", 50, "Rounds at the full learning rate before the decay.")
flags.DEFINE_float("lr_decay_rate", 0.04, "Decay rate of --lr_schedule.")
flags.DEFINE_integer("test_samples", 50, "MC samples of the final predictive (bfl, MC dropout) for summary.json "
                     "(Fischer et al. spec D9: 50).")
flags.DEFINE_integer("seed", 0, "Seed of partition, init and training.")
flags.DEFINE_float("pretrain_fraction", 0.0, "Pre-train the global model before round 1 on this stratified "
                   "fraction of the training set (Fischer et al.'s DWC protocol, 0.1).")
flags.DEFINE_integer("pretrain_epochs", 5, "Epochs of server pre-training (the most, with early stopping).")
flags.DEFINE_float("pretrain_validation_fraction", 0.0, "Hold out this fraction of the pre-training data and stop "
                   "early on its accuracy (Fischer et al.: 0.1); 0 trains --pretrain_epochs epochs.")
flags.DEFINE_integer("pretrain_patience", 10, "Early stopping: epochs without a better validation accuracy.")
flags.DEFINE_bool("pretrain_disjoint", False, "Take the pre-training fraction away from the clients (default: it "
                  "may overlap their data, as Fischer et al.'s protocol allows).")
# Output.
flags.DEFINE_string("output_dir", "/tmp/bfedjax_run", "Where metrics.jsonl, summary.json and checkpoints go.")
flags.DEFINE_bool("resume", True, "Resume from the last checkpoint in --output_dir.")
flags.DEFINE_bool("tensorboard", False, "Also write TensorBoard event files (tensorboardX) into "
                  "OUTPUT_DIR/tensorboard: every numeric round metric at step = round, and the final predictive's "
                  "numbers.")
flags.DEFINE_bool("evaluate_local", True, "Also compute LA (every local model on the test set).")
flags.DEFINE_integer("evaluate_every", 1, "Evaluate GA (and LA) only every this many rounds (it must divide --rounds); "
                     "the other rounds log NaN and cost no evaluation (FedReg spec decision 17).")
flags.DEFINE_list("targets", ["0.5", "0.7", "0.8"], "GA thresholds for rounds-to-target in summary.json.")

for _name in ("num_clients", "rounds"):
    flags.register_validator(_name, lambda v: v is not None and v >= 1, message=f"--{_name} must be >= 1")
flags.register_validator("alpha", lambda v: 0 < v < float("inf"),
                         message="--alpha must be > 0 and finite (e.g. --alpha=0.01)")
flags.register_validator("clients_per_round", lambda v: v is None or v >= 1, message="--clients_per_round must be >= 1")
flags.register_validator("participation", lambda v: v is None or 0 < v <= 1,
                         message="--participation must be in (0, 1], e.g. --participation=0.1")
flags.register_validator("cpu_devices", lambda v: v == "auto" or (v.isdigit() and int(v) >= 1),
                         message="--cpu_devices must be auto or a number >= 1, e.g. --cpu_devices=2")
flags.register_validator("clients_per_chunk", lambda v: v in ("auto", "none") or (v.isdigit() and int(v) >= 1),
                         message="--clients_per_chunk must be auto, none or a number >= 1, e.g. --clients_per_chunk=2")
flags.register_validator("pretrain_validation_fraction", lambda v: 0 <= v < 1,
                         message="--pretrain_validation_fraction must be in [0, 1), e.g. 0.1")
flags.register_validator("pretrain_fraction", lambda v: 0 <= v < 1,
                         message="--pretrain_fraction must be in [0, 1), e.g. --pretrain_fraction=0.1")
flags.register_validator("attack_fraction", lambda v: 0 <= v <= 1,
                         message="--attack_fraction must be in [0, 1], e.g. 0.2")
flags.register_validator("attack_noise_std", lambda v: v > 0, message="--attack_noise_std must be > 0, e.g. 1.0")
flags.register_validator("straggler_fraction", lambda v: 0 <= v <= 1,
                         message="--straggler_fraction must be in [0, 1], e.g. 0.5")
flags.register_validator("validation_fraction", lambda v: 0 < v < 1,
                         message="--validation_fraction must be in (0, 1), e.g. 0.1")
flags.register_multi_flags_validator(
    ["rounds", "evaluate_every"], lambda v: v["evaluate_every"] >= 1 and v["rounds"] % v["evaluate_every"] == 0,
    message="--evaluate_every must be >= 1 and divide --rounds (so the last round is evaluated), e.g. --rounds=100 "
            "--evaluate_every=5")
flags.register_validator("dropout_rate", lambda v: 0 <= v < 1, message="--dropout_rate must be in [0, 1), e.g. 0.2")
flags.register_validator("lr_decay_rate", lambda v: 0 < v < 1, message="--lr_decay_rate must be in (0, 1), e.g. 0.04")
flags.register_validator("test_samples", lambda v: v >= 1, message="--test_samples must be >= 1")
flags.register_validator("round_fractions", lambda v: v is None or all(_is_fraction(f) for f in v),
                         message="--round_fractions must be numbers in (0, 1], e.g. 0.5,0.7,0.9")
flags.register_validator("hidden", lambda v: all(h.isdigit() and int(h) >= 1 for h in v),
                         message="--hidden must be widths >= 1, e.g. --hidden=200,200")
flags.register_validator("targets", lambda v: all(_is_fraction(t) for t in v),
                         message="--targets must be accuracies in (0, 1], e.g. 0.5,0.7")
flags.register_validator("client_weights", lambda v: v is None or v == ["uniform"]
                         or all(_is_number(w) and float(w) >= 0 for w in v),
                         message="--client_weights must be numbers >= 0 (e.g. 0.51,0.49) or 'uniform'")
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


def _is_fraction(text: str) -> bool:
    return _is_number(text) and 0 < float(text) <= 1


def _is_number(text: str) -> bool:
    try:
        return np.isfinite(float(text))
    except ValueError:
        return False


NESTED_FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)  # the FedRef authors' randint(5, 9) / 10


def round_fractions():
    """The per-round subset fractions: --round_fractions, FedRef's 0.5..0.9 with --partition=nested, else None."""
    if FLAGS.round_fractions:
        return tuple(float(f) for f in FLAGS.round_fractions)
    return NESTED_FRACTIONS if FLAGS.partition == "nested" else None


def make_task(dataset, model):
    """The task of --task, checked against the data, the model and the algorithm; None for classification."""
    is_masks = dataset.y_train.ndim in (3, 4)  # [n, H, W] image masks or [n, D, H, W] volume masks
    segmenter = "unet" if dataset.y_train.ndim == 3 else "unet3d"
    if FLAGS.task == "classification":
        if is_masks:
            raise app.UsageError(f"{dataset.name} holds segmentation masks; fix: --task=segmentation "
                                 f"--model={segmenter}")
        return None
    if not is_masks:
        raise app.UsageError(f"--task=segmentation needs masks; {dataset.name} has class labels; fix: "
                             "--dataset=vessels or mnist_5k_foreground (offline), drive --data_dir=DIR or oxford_iiit_pet "
                             "--tfds_data_dir=DIR")
    if FLAGS.model != segmenter:
        what = "volumes [D, H, W]" if segmenter == "unet3d" else "images [H, W]"
        raise app.UsageError(f"--task=segmentation on {dataset.name}'s {what} needs a per-voxel model; fix: "
                             f"--model={segmenter} (not {FLAGS.model})")
    if "task" not in bf.algorithms.options_of(FLAGS.algorithm):
        takes = [name for name in bf.algorithms.ALGORITHMS if "task" in bf.algorithms.options_of(name)]
        raise app.UsageError(f"--algorithm={FLAGS.algorithm} trains classifiers only; fix: --algorithm="
                             f"{' or '.join(takes)} for --task=segmentation")
    regions = bf.metrics.segmentation.FETS_REGIONS if dataset.name.startswith("fets") and dataset.num_classes == 4 else ()
    return bf.tasks.segmentation(model, loss=FLAGS.segmentation_loss, regions=regions)


def parse_class_groups(text: str) -> list[list[int]]:
    """'0-4;5-9' or '0,2,4;1,3' -> [[0..4], [5..9]]; a ``UsageError`` for text of another form."""
    groups = []
    try:
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
    except ValueError:
        raise app.UsageError(f"--class_groups={text!r} is not ';'-separated label ranges or lists; fix: e.g. "
                             "--class_groups='0-4;5-9' or '0,2,4;1,3'") from None
    return groups


def _load(name: str, **kwargs):
    """``bf.data.load``, with a ``NonFiniteInputsWarning`` (--allow_nonfinite_inputs) as one ``warning: ...`` line."""
    original = warnings.showwarning

    def show(message, category, *args, **kw):
        if issubclass(category, bf.data.NonFiniteInputsWarning):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            original(message, category, *args, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("always", bf.data.NonFiniteInputsWarning)
        warnings.showwarning = show
        return bf.data.load(name, **kwargs)


def dataset_name() -> str:
    """--dataset, with --volume_size and --fets_labels as the FeTS configs ``bf.data.load`` takes
    (``fets/classes``, ``fets_volumes/DxHxW/classes``)."""
    name = FLAGS.dataset
    if FLAGS.volume_size:
        if FLAGS.dataset != "fets_volumes":
            raise app.UsageError(f"--volume_size resizes --dataset=fets_volumes only, not {FLAGS.dataset}; fix: drop "
                                 "--volume_size")
        if len(FLAGS.volume_size) != 3 or not all(v.isdigit() and int(v) > 0 for v in FLAGS.volume_size):
            raise app.UsageError(f"--volume_size={','.join(FLAGS.volume_size)}: need three sizes D,H,W >= 1; fix: "
                                 "e.g. --volume_size=48,64,64")
        name += "/" + "x".join(str(int(v)) for v in FLAGS.volume_size)
    if FLAGS.fets_labels != "whole_tumour":
        if FLAGS.dataset not in ("fets", "fets_volumes"):
            raise app.UsageError(f"--fets_labels chooses FeTS's masks, not {FLAGS.dataset}'s; fix: drop --fets_labels")
        name += "/" + FLAGS.fets_labels
    return name


def load_dataset():
    """--dataset, checked by ``bf.data.load``; --fallback_to_digits when it cannot be had (not for a wrong
    --data_dir)."""
    try:
        return _load(dataset_name(), data_dir=FLAGS.data_dir, tfds_data_dir=FLAGS.tfds_data_dir,
                     max_train=FLAGS.max_train, max_test=FLAGS.max_test, seed=FLAGS.seed, pixels=FLAGS.pixels,
                     allow_nonfinite=FLAGS.allow_nonfinite_inputs)
    except bf.data.DataUnavailableError as err:
        if not FLAGS.fallback_to_digits or isinstance(err, bf.data.DataDirNotFoundError):
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


def make_federation(dataset):
    """The federated data: --partition, plus per-client test splits with --client_test_splits."""
    if not FLAGS.client_test_splits:
        parts = institution_parts(dataset) if FLAGS.partition == "institutions" else make_partition(dataset.y_train)
        return bf.data.from_partition(dataset, parts)
    if FLAGS.partition != "dirichlet_per_class":
        raise app.UsageError(f"--client_test_splits splits the test set with the training split's Dirichlet "
                             f"proportions; fix: --partition=dirichlet_per_class (not {FLAGS.partition})")
    train, test = bf.data.dirichlet_train_test(dataset.y_train, dataset.y_test, FLAGS.num_clients, alpha=FLAGS.alpha,
                                               seed=FLAGS.seed)
    return bf.data.from_partition(dataset, train, test_parts=test)


def institution_parts(dataset):
    """--partition=institutions: client k holds the training rows of the data set's institution k."""
    if dataset.client_ids is None:
        raise app.UsageError("--partition=institutions needs a data set with institutions (--dataset=fets); fix: "
                             "--dataset=fets or another --partition")
    if len(dataset.client_ids) != len(dataset.y_train):  # e.g. rows taken away by --pretrain_disjoint
        raise app.UsageError(f"--partition=institutions: {dataset.name}'s institutions no longer match its "
                             "training rows; fix: drop --pretrain_disjoint")
    parts = bf.data.institution_parts(dataset.client_ids)
    if len(parts) != FLAGS.num_clients:
        raise app.UsageError(f"--partition=institutions: {dataset.name} has {len(parts)} institutions, not "
                             f"--num_clients={FLAGS.num_clients}; fix: --num_clients={len(parts)}")
    return parts


def architecture_setting(dataset, model):
    """``(setting, client_groups)``: hbfl/fml's local models and the client-to-architecture map."""
    if FLAGS.algorithm not in ("hbfl", "fml"):
        if FLAGS.client_architectures:
            raise app.UsageError(f"--client_architectures gives hbfl/fml their local models; --algorithm="
                                 f"{FLAGS.algorithm} trains one model on every client; fix: drop the flag")
        return {}, None
    if FLAGS.client_architectures is None:  # every local model has the meme's architecture
        return {}, None
    if FLAGS.client_architectures == "none":
        if FLAGS.algorithm == "fml":
            raise app.UsageError("fml needs local models; fix: drop --client_architectures=none")
        return {"local_models": ()}, None
    try:
        models, groups = bf.models.client_architectures(
            FLAGS.client_architectures, FLAGS.num_clients, num_classes=dataset.num_classes,
            hidden=tuple(int(h) for h in FLAGS.hidden), shuffle_seed=FLAGS.shuffle_architectures,
            compute_dtype=FLAGS.compute_dtype)
    except ValueError as err:
        raise app.UsageError(f"--client_architectures: {err}") from None
    return {"local_models": models}, groups


def make_partition(labels):
    scheme = FLAGS.partition
    if labels.ndim > 1 and scheme not in ("iid", "nested"):
        raise app.UsageError(f"--partition={scheme} splits by class label; segmentation masks have none; fix: "
                             "--partition=nested (FedRef's) or iid")
    if scheme == "nested" and FLAGS.num_clients > len(labels):  # every client holds all m samples
        raise app.UsageError(f"--partition=nested gives each client all {len(labels)} training samples; --num_clients="
                             f"{FLAGS.num_clients} copies are too many; fix: --num_clients <= {len(labels)}")
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
            raise app.UsageError(f"--class_groups has {len(groups)} groups but --num_clients={FLAGS.num_clients}; "
                                 f"fix: --num_clients={len(groups)}")
        return bf.data.class_groups(labels, groups, seed=FLAGS.seed)
    return bf.data.partition(labels, scheme, FLAGS.num_clients, seed=FLAGS.seed, **kwargs)


def make_model(num_classes: int):
    try:
        return bf.models.get_model(FLAGS.model, num_classes, hidden=tuple(int(h) for h in FLAGS.hidden),
                                   dropout_rate=FLAGS.dropout_rate, compute_dtype=FLAGS.compute_dtype,
                                   segmentation_head=FLAGS.segmentation_head)
    except ValueError as err:
        raise app.UsageError(f"{err} (--model / --dropout_rate / --segmentation_head)") from None


def check_model_fits(model, dataset, task, flag: str | None = None) -> None:
    """A ``UsageError`` when ``model`` (``flag``: the flag that chose it, default --model) cannot take --dataset's
    inputs (LeNet's pooling on 8x8 digits) or, for classification, does not output one score per class (a
    U-Net); traced abstractly, nothing is computed."""
    import jax
    import jax.numpy as jnp
    flag = flag or f"--model={FLAGS.model}"
    shape = dataset.x_train.shape[1:]
    try:
        out = jax.eval_shape(lambda key, x: model.init_with_output(key, x)[0], jax.random.PRNGKey(0),
                             jax.ShapeDtypeStruct((1, *shape), jnp.float32))
    except (ZeroDivisionError, ValueError, TypeError) as err:
        raise app.UsageError(f"{flag} does not fit {dataset.name}'s inputs of shape {shape} "
                             f"({type(err).__name__}: {' '.join(str(err).split())[:120]}); fix: --model=mlp or "
                             "logistic, or a data set of larger images (e.g. --dataset=mnist_5k)") from None
    if task is None and out.shape != (1, dataset.num_classes):
        raise app.UsageError(f"{flag} outputs {out.shape[1:]} per input, not {dataset.num_classes} "
                             "class scores; fix: a classifier such as --model=mlp (--model=unet is for "
                             "--task=segmentation)")


def learning_rate_fn():
    """``round -> {"lr": ...}`` for a decaying --lr_schedule, else None."""
    if FLAGS.lr_schedule == "constant":
        return None
    schedule = bf.core.lr_schedule(FLAGS.lr_schedule, FLAGS.lr, start=FLAGS.lr_decay_start, rate=FLAGS.lr_decay_rate)
    return lambda r: {"lr": schedule(r)}


RETAINED_FRACTIONS = tuple(np.round(np.arange(0.05, 1.0001, 0.05), 2).tolist())  # accuracy vs retained data
CALIBRATION_BINS = 15  # as bfedjax.metrics.uncertainty.summary's ECE


def final_evaluation(algorithm, server, fed) -> tuple[dict, dict]:
    """The final global predictive on the test set: (summary numbers, what the plots need).

    The algorithm's predict hook gives the predictive: bfl's ``--test_samples``-sample MC predictive of
    the posterior, as many MC-dropout passes for a dropout model, otherwise the softmax of the global model.
    Returns ``(numbers, evaluation)``: ``numbers`` the accuracy, NLL, ECE, Brier, mean entropy, aleatoric and
    epistemic parts (summary.json's ``uncertainty``); ``evaluation`` (evaluation.json): ``reliability``, the
    ECE's ``calibration_bins`` (``count``, ``confidence``, ``accuracy`` [15] and ``ece``),
    ``accuracy_vs_retained`` (``fractions`` [F] and ``accuracy``: ``{ranking: [F]}``, the accuracy on the least
    uncertain fractions by normalised entropy, aleatoric and, for an MC predictive, epistemic uncertainty) and,
    when the clients have test splits (``--client_test_splits``), ``per_client_accuracy``: the global
    predictive's accuracy on each client's own split [N] (``None`` for a client without one).
    """
    import jax
    import jax.numpy as jnp
    key = jax.random.PRNGKey(FLAGS.seed + 20_000)
    x = jnp.asarray(fed.x_test)
    own = fed.test_counts is not None
    if own:  # the clients' own splits (their real rows, not the padding) ride along in the same predict call
        x = jnp.concatenate([x, jnp.asarray(fed.x_test_clients[_filled(fed)])])
    probs = algorithm.predict(server, x, key, FLAGS.test_samples)  # [M, T (+ sum of test_counts), K]
    t = len(fed.y_test)
    scores, bins, retained = jax.jit(_predictive_scores)(probs[:, :t], jnp.asarray(fed.y_test))
    numbers = {k: float(scores[k]) for k in bf.metrics.uncertainty.SUMMARY_METRICS}  # in summary's order
    evaluation = {
        "num_test": t,
        "reliability": {**{k: np.asarray(v).tolist() for k, v in bins.items()}, "ece": numbers["ece"]},
        "accuracy_vs_retained": {"fractions": list(RETAINED_FRACTIONS),
                                 "accuracy": {r: np.asarray(curve).tolist() for r, curve in retained.items()}},
    }
    if own:
        evaluation["per_client_accuracy"] = {
            "model": "final global predictive on each client's own test split",
            "accuracy": per_client_accuracy(np.asarray(probs[:, t:]), fed), "test_counts": fed.test_counts.tolist()}
    return numbers, evaluation


def _predictive_scores(probs, y):
    """Summary numbers (``{name: scalar}``), calibration bins and accuracy vs retained data of ``probs [M, T, K]``
    and labels ``y [T]``: one program to jit rather than dozens of small ones."""
    unc = bf.metrics.uncertainty
    p_bar = unc.predictive(probs)
    return (unc.summary(probs, y, CALIBRATION_BINS), unc.calibration_bins(p_bar, y, CALIBRATION_BINS),
            unc.retention_curves(probs, y, RETAINED_FRACTIONS, retention_rankings(probs.shape[0])))


def retention_rankings(num_samples: int) -> tuple[str, ...]:
    """The uncertainties accuracy-vs-retained ranks by: epistemic only for an MC predictive (one sample has none)."""
    rankings = bf.metrics.uncertainty.RANKINGS
    return rankings if num_samples > 1 else tuple(r for r in rankings if r != "epistemic")


def _filled(fed) -> np.ndarray:
    """``[N, t]``: which rows of the clients' padded test splits ``fed.x_test_clients [N, t, ...]`` are real."""
    return np.arange(fed.y_test_clients.shape[1])[None, :] < np.asarray(fed.test_counts)[:, None]


def per_client_accuracy(probs, fed) -> list:
    """Each client's accuracy on its own test split ``[N]`` (``None``: a client without one), from ``probs
    [M, sum_n test_counts[n], K]``, the predictive on the real rows of ``fed.x_test_clients`` in order."""
    filled = _filled(fed)
    client = np.broadcast_to(np.arange(filled.shape[0])[:, None], filled.shape)[filled]
    correct = np.argmax(probs.mean(0), -1) == fed.y_test_clients[filled]
    hits = np.bincount(client, weights=correct, minlength=filled.shape[0])
    return [float(h / c) if c else None for h, c in zip(hits, fed.test_counts)]


@dataclasses.dataclass
class Experiment:
    """What :func:`setup` makes of the flags: everything a run needs before its first round."""

    dataset: Any                # bf.data.Dataset (minus --pretrain_disjoint / abavg's held-out rows)
    fed: Any                    # bf.data.FederatedData
    algorithm: Any              # bf.Algorithm
    task: Any                   # bf.tasks.Task, or None for classification
    client_groups: Any          # hbfl/fml's client-to-architecture map, or None
    client_weights: Any         # None, "uniform" or N floats (--client_weights)
    server_data: tuple | None   # (x, y) held out for --pretrain_fraction, or None
    attack: Any                 # bf.core.Attack (--attack), or None
    pretrainer: Any = None      # what pre-trains on server_data (``pretraining_algorithm``), or None


def parse(argv: Sequence[str]) -> list[str]:
    """Parses the command line ``argv`` (``argv[0]``: the program) into FLAGS afresh; returns the rest."""
    FLAGS.unparse_flags()
    return FLAGS(list(argv))


def prepare(argv: Sequence[str]) -> Experiment:
    """:func:`setup` for the command line ``argv``, parsed afresh (in-process runs and tests)."""
    return setup(parse(argv))


def setup(argv: Sequence[str] = ("run",)) -> Experiment:
    """Checks the parsed flags, loads and validates the data, partitions it, builds the model and the algorithm.

    ``argv`` is what flag parsing left (only the program name is allowed). A bad command line raises one of
    ``experiments.errors.user_errors()`` (``app.UsageError``, ``ValueError``, ``DataUnavailableError``, ...),
    whose message is one line ending in ``fix: ...``; nothing is trained or written.
    """
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {list(argv[1:])}; fix: flags take the form --name=value")
    if FLAGS.abavg_accuracy_source == "client_test" and not FLAGS.client_test_splits:
        raise app.UsageError("--abavg_accuracy_source=client_test: the clients report accuracy on their own test "
                             "splits; fix: add --client_test_splits")
    if FLAGS.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise app.UsageError("--tensorboard writes with tensorboardX, which is not installed; fix: pip install "
                             "'bfedjax[logging]' (from a clone: pip install -e '.[logging]'), or drop --tensorboard")
    dataset = load_dataset()
    server_data = None
    if FLAGS.pretrain_fraction > 0:
        dataset, held_out = split_server_data(dataset, FLAGS.pretrain_fraction, FLAGS.seed)
        server_data = dataset.x_train[held_out], dataset.y_train[held_out]
        if FLAGS.pretrain_disjoint:
            keep = np.setdiff1d(np.arange(len(dataset.y_train)), held_out)
            dataset = dataclasses.replace(dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep])
    setting = {}
    if FLAGS.algorithm == "abavg" and FLAGS.abavg_accuracy_source in (None, "server_validation"):
        dataset, setting["validation"] = bf.data.holdout(dataset, FLAGS.validation_fraction, FLAGS.seed)
        if len(setting["validation"][1]) == 0:
            raise app.UsageError(f"--validation_fraction={FLAGS.validation_fraction} of {len(dataset.y_train)} "
                                 "training samples holds out none for abavg; fix: raise --validation_fraction or "
                                 "--max_train")
    model = make_model(dataset.num_classes)
    task = make_task(dataset, model)
    check_model_fits(model, dataset, task)
    if task is not None:
        setting["task"] = task
    fed = make_federation(dataset)
    architectures, client_groups = architecture_setting(dataset, model)
    for local in architectures.get("local_models", ()):
        check_model_fits(local, dataset, task, f"--client_architectures={FLAGS.client_architectures}")
    algorithm = algorithm_flags.build(FLAGS, model, fed, {**setting, **architectures})
    if task is not None and FLAGS.augment != "none":
        raise app.UsageError(f"--augment={FLAGS.augment} moves the images but not their masks; fix: --augment=none "
                             "for --task=segmentation")
    augment = bf.data.augmentation(FLAGS.augment, dataset.input_shape, dataset.pixel_norm)
    if augment is not None:
        algorithm = bf.data.augmented(algorithm, augment)
    pretrainer = None if server_data is None else pretraining_algorithm(
        algorithm, model, fed, {**setting, **architectures}, augment)
    weights = FLAGS.client_weights
    if weights:
        weights = "uniform" if weights == ["uniform"] else [float(w) for w in weights]
    attack = None
    if FLAGS.attack != "none":
        attack = bf.core.Attack(FLAGS.attack, FLAGS.attack_fraction, seed=FLAGS.seed, scale=FLAGS.attack_scale,
                                noise_std=FLAGS.attack_noise_std)
    return Experiment(dataset, fed, algorithm, task, client_groups, weights, server_data, attack, pretrainer)


def pretraining_algorithm(algorithm, model, fed, setting: dict, augment):
    """What pre-trains the global model on the server's data: the run's own algorithm as one client, except that
    ``bfl`` with ``--rule=dwc`` or ``--prior_update`` pre-trains against its fixed N(0, prior_scale^2) prior, as
    ordinary training of the Bayesian network (Fischer et al.'s protocol). Run as they are, each pre-training epoch
    (a round of one client) would train against the previous epoch's posterior, the first against the initial
    posterior. It is the run's algorithm (its options and wrappers: server optimiser, robust rule) with
    ``rule="wc"``, which returns one client's posterior as it is, and no prior update, so the server state it
    returns has the run's structure."""
    if FLAGS.algorithm != "bfl" or not (FLAGS.rule == "dwc" or FLAGS.prior_update):
        return algorithm
    fixed_prior = algorithm_flags.build(FLAGS, model, fed, {**setting, "rule": "wc", "prior_update": False,
                                                            "prior_temperature": 1.0}, quiet=True)
    return fixed_prior if augment is None else bf.data.augmented(fixed_prior, augment)


def main(argv):
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    import jax
    use_cpu_cores()
    use_compilation_cache()

    run = setup(argv)
    dataset, fed, algorithm = run.dataset, run.fed, run.algorithm
    init_server = None
    if run.server_data is not None:
        server_x, server_y = run.server_data
        init_server = bf.core.pretrain(run.pretrainer, server_x, server_y, epochs=FLAGS.pretrain_epochs,
                                       key=jax.random.PRNGKey(FLAGS.seed + 10_000), num_classes=dataset.num_classes,
                                       validation_fraction=FLAGS.pretrain_validation_fraction,
                                       patience=FLAGS.pretrain_patience)
        stopping = " at most, stopping early" if FLAGS.pretrain_validation_fraction else ""
        print(f"pre-trained the server model on {len(server_y)} training samples for {FLAGS.pretrain_epochs} "
              f"epochs{stopping}"
              f"{' (removed from the clients)' if FLAGS.pretrain_disjoint else ''}", flush=True)

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    checkpoints = os.path.join(FLAGS.output_dir, "checkpoints")
    if not FLAGS.resume:  # a fresh run: no checkpoint and no earlier run's records
        shutil.rmtree(checkpoints, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(FLAGS.output_dir, "metrics.jsonl"))
    attack = f", attack {run.attack.kind} by {run.attack.fraction:.0%} of the clients" if run.attack else ""
    print(f"{algorithm.name} on {dataset.name} ({dataset.source}): {fed.num_clients} clients, "
          f"sizes {int(fed.counts.min())}..{int(fed.counts.max())}, {FLAGS.partition}, "
          f"{FLAGS.rounds} rounds, E={algorithm.local_epochs}, B={algorithm.batch_size}, lr={FLAGS.lr}, "
          f"hparams={algorithm.hparams}, clients with pi_n < 1e-3: {int(np.sum(fed.weights < 1e-3))}{attack}",
          flush=True)

    with round_log.RoundLog(FLAGS.output_dir, FLAGS.rounds, round_log.round_line, tensorboard=FLAGS.tensorboard) as log:
        result = bf.simulate(
            algorithm, fed, rounds=FLAGS.rounds, key=jax.random.PRNGKey(FLAGS.seed),
            clients_per_round=FLAGS.clients_per_round, participation=FLAGS.participation,
            clients_per_chunk=clients_per_chunk(),
            backend=FLAGS.backend, client_weights=run.client_weights, evaluate_local=FLAGS.evaluate_local,
            evaluate_every=FLAGS.evaluate_every,
            checkpoint_dir=checkpoints, on_round=log, init_server=init_server,
            hparams_fn=learning_rate_fn(), client_groups=run.client_groups,
            straggler_fraction=FLAGS.straggler_fraction, straggler_weighting=FLAGS.straggler_weighting,
            round_fractions=round_fractions(), attack=run.attack, on_nonfinite=FLAGS.on_nonfinite,
            checkpoint_identity={"flags": training_flags()})
        log.end_rounds(result.metrics)  # metrics.jsonl complete (restored rounds included), progress bar closed
        finish(run, result, log)


# Flags a resumed run may change: they do not change what the saved rounds trained (how many rounds, where the files
# go, the layout, what is logged or evaluated, where the same data is read from).
RESUMABLE_FLAGS = frozenset({
    "rounds", "output_dir", "resume", "tensorboard", "evaluate_local", "evaluate_every", "test_samples", "targets",
    "clients_per_chunk", "cpu_devices", "compilation_cache_dir", "backend", "on_nonfinite", "data_dir",
    "tfds_data_dir", "max_test", "precision_cosine"})


def run_flags() -> dict:
    """This binary's and the algorithm flags' values, by name (``summary.json``'s ``flags``)."""
    return {f.name: f.value for module in (__name__, algorithm_flags.__name__)
            for f in FLAGS.get_key_flags_for_module(sys.modules[module])}


def training_flags() -> dict:
    """``run_flags`` except ``RESUMABLE_FLAGS``: with ``simulate``'s own checks, a checkpoint saved under other
    values is not resumed (``checkpoint.DifferentRunError``)."""
    return {name: value for name, value in run_flags().items() if name not in RESUMABLE_FLAGS}


def use_cpu_cores() -> int:
    """``--cpu_devices`` applied (``bfedjax.core.layout.use_cpu_cores``) before JAX's first computation; ``auto``
    in a process whose JAX already runs (a notebook, a test calling ``main``) keeps its devices."""
    import jax
    if FLAGS.cpu_devices == "auto":
        if bf.core.layout.jax_started():
            return len(jax.devices("cpu"))
        return bf.core.layout.use_cpu_cores()
    try:
        return bf.core.layout.use_cpu_cores(int(FLAGS.cpu_devices))
    except RuntimeError as e:
        raise app.UsageError(f"--cpu_devices={FLAGS.cpu_devices}: {e}") from None


def use_compilation_cache() -> str | None:
    """``--compilation_cache_dir`` applied before JAX's first compilation (``core.compile_cache``); returns the
    directory JAX caches in, or None. The default directory falls back to no cache with a note line; a named one
    that cannot be used stops the run with one line."""
    if FLAGS.compilation_cache_dir == "none":
        return None
    auto = FLAGS.compilation_cache_dir == "auto"
    try:
        return bf.core.compile_cache.use_compilation_cache(None if auto else FLAGS.compilation_cache_dir)
    except (ValueError, ImportError) as err:
        if not auto:
            raise app.UsageError(f"--compilation_cache_dir: {err}") from None
        print(f"note: no compilation cache: {err}", flush=True)
        return None


def clients_per_chunk() -> int | str | None:
    """``--clients_per_chunk`` as ``simulate`` takes it: a number, ``None`` (one vmap) or ``"auto"``."""
    value = FLAGS.clients_per_chunk
    return None if value == "none" else value if value == "auto" else int(value)


def finish(run: Experiment, result, log: round_log.RoundLog) -> None:
    """Writes summary.json (and, for classification, evaluation.json) of a finished run and prints its last lines;
    the final predictive's numbers also go to TensorBoard (``log.final``)."""
    algorithm, task = run.algorithm, run.task
    headline = "dice" if task is not None else "accuracy"
    ga = result.metrics[f"global_{headline}"]
    summary = {
        "algorithm": algorithm.name, "dataset": run.dataset.name, "source": run.dataset.source,
        "flags": run_flags(),
        "clients_per_chunk": result.clients_per_chunk,  # the layout the rounds ran with (None: one vmap)
        "client_devices": result.client_devices,  # the devices its chunks were split over
        f"round1_global_{headline}": _number_or_none(ga[0]), f"final_global_{headline}": ga[-1],
        f"best_global_{headline}": float(np.nanmax(ga)),  # NaN: rounds --evaluate_every skipped
        "rounds_to_target": {t: bf.metrics.rounds_to_target(ga, float(t)) for t in FLAGS.targets},
    }
    if task is not None:  # segmentation: the last round's scores, ours and the FedRef authors'
        summary["final"] = {name[len("global_"):]: values[-1] for name, values in result.metrics.items()
                            if name.startswith("global_")}
        _write_json("summary.json", summary)
        print(f"done: best Dice {np.nanmax(ga):.4f}, final Dice {ga[-1]:.4f}, IoU {summary['final']['iou']:.4f}, "
              f"HD95 {summary['final']['hd95']:.2f} -> {FLAGS.output_dir}")
        return
    if "local_accuracy" in result.metrics:
        summary["best_local_accuracy"] = float(np.nanmax(result.metrics["local_accuracy"]))
    if "client_test_accuracy" in result.metrics:  # mean over clients of each client's accuracy on its own split
        summary["best_client_test_accuracy"] = float(np.nanmax(result.metrics["client_test_accuracy"]))
        summary["final_client_test_accuracy"] = result.metrics["client_test_accuracy"][-1]
    summary["uncertainty"], evaluation = final_evaluation(algorithm, result.state.server, run.fed)
    log.final(summary["uncertainty"], step=result.metrics["round"][-1])
    printed = [f"{PRINTED_AS.get(k, k)} {_printed(v)}" for k, v in summary["uncertainty"].items()
               if isinstance(v, float)]
    print("final predictive: " + ", ".join(printed), flush=True)
    _write_json("summary.json", summary)
    _write_json("evaluation.json", evaluation)
    print(f"done: round-1 GA {ga[0]:.4f}, best GA {np.nanmax(ga):.4f}, final GA {ga[-1]:.4f} -> {FLAGS.output_dir}")


# The final predictive's printed names where the bare key would mislead (``bfedjax.metrics.uncertainty``): the
# entropy is normalised by log C, the Eq. 9 parts are traces of per-class variances, not entropies.
PRINTED_AS = {"entropy": "entropy/log(C)", "aleatoric": "aleatoric (trace)", "epistemic": "epistemic (trace)"}


def _printed(value: float) -> str:
    """Four decimals, or three significant digits for a value that would print as 0.0000 (a collapsed
    posterior's epistemic part, e.g. 1.7e-12)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 5e-5 or value != value else f"{value:.3g}"


def _number_or_none(value: float) -> float | None:
    """``None`` for a round that was not evaluated (NaN), so summary.json stays strict JSON."""
    return None if value != value else value


def _write_json(name: str, value) -> None:
    with open(os.path.join(FLAGS.output_dir, name), "w") as f:
        json.dump(value, f, indent=1)


if __name__ == "__main__":
    errors.run(main, interrupted="rerun the same command to resume from the last checkpointed round "
                                  "(--noresume starts over)")
