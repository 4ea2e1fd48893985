r"""Fischer et al. on small data: every aggregation rule against the deterministic and MC-dropout FedAvg baselines.

    python -m experiments.bfl_rules                           # digits, writes results/bfl_rules_digits.md
    python -m experiments.bfl_rules --dataset=fashion_mnist --max_train=10000

10 clients, IID and 2-class shards, E = 1 for 60 rounds and E = 5 for 30
rounds, 3 seeds; reports mean and sample std (ddof 1) over seeds of the final
accuracy, NLL and ECE of the MC predictive (10 samples) and the final mean
posterior scale, and checks the paper's finding (WS/WC/conflation ahead of
NWA/LP at E = 1, parity at E = 5).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags, logging

from bfedjax.vi import GRADIENT_ESTIMATORS, INIT_LOCS, MeanFieldConfig
from experiments import errors, spread

FLAGS = flags.FLAGS
flags.DEFINE_string("dataset", "digits", "Data set.")
flags.DEFINE_integer("max_train", None, "Subsample the training set.")
flags.DEFINE_list("rules", ["nwa", "ws", "lp", "conflation", "wc", "llp", "dwc"], "Rules (CLP is NWA).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
flags.DEFINE_list("settings", ["1:60", "5:30"], "local_epochs:rounds pairs.")
flags.DEFINE_list("partitions", ["iid", "shards"], "Partitions (shards = 2 classes per client).")
flags.DEFINE_integer("num_clients", 10, "Clients.")
flags.DEFINE_integer("batch_size", 16, "Local batch size.")
flags.DEFINE_float("lr", 1e-2, "Adam learning rate of the variational clients (spec 1e-3 is for 5,000-image clients).")
flags.DEFINE_float("fedavg_lr", 0.05, "SGD learning rate of the deterministic baseline.")
flags.DEFINE_integer("hidden", 64, "MLP width.")
flags.DEFINE_integer("test_samples", 10, "MC samples of the predictive.")
flags.DEFINE_enum("gradient_estimator", "flipout", list(GRADIENT_ESTIMATORS),
                  "Gradient estimator of the variational clients (default Flipout, as Fischer et al.'s TFP layers).")
flags.DEFINE_enum("init_loc", MeanFieldConfig.init_loc, list(INIT_LOCS),
                  "Initial posterior mean of the variational kernels (spec D4: normal, N(0, 0.1^2)).")
flags.DEFINE_float("dropout_rate", 0.2, "Dropout rate of the MC-dropout baseline (paper: 0.2).")
flags.DEFINE_enum("spread", "std", list(spread.SPREADS), "What the tables' ± is: the sample std over seeds "
                  "(std, the spec's D12 default) or the 95% confidence interval of the mean (ci95).")
flags.DEFINE_string("results_file", None, "Markdown output (default results/bfl_rules_<dataset>.md).")
flags.DEFINE_bool("report_only", False, "Rewrite the markdown from the saved JSON of an earlier run (no training).")

errors.check_list("seeds", lambda s: int(s) >= 0, "integer seeds >= 0", "0,1,2")
errors.check_list("settings", lambda s: len(s.split(":")) == 2 and min(int(v) for v in s.split(":")) >= 1,
                  "local_epochs:rounds pairs of integers >= 1", "1:60,5:30")
errors.check_list("partitions", lambda p: p in ("iid", "shards"), "iid and/or shards", "iid,shards")
for _name in ("num_clients", "batch_size", "hidden", "test_samples"):
    flags.register_validator(_name, lambda v: v >= 1, message=f"--{_name} must be >= 1")

GROUP_1, GROUP_2 = ("ws", "wc", "conflation"), ("nwa", "lp")
BASELINES = ("fedavg", "mc_dropout")  # deterministic and MC-dropout MLPs, FedAvg (= NWA, train size)


def run_one(data, method, partition, epochs, rounds, seed):
    import jax
    import jax.numpy as jnp
    import bfedjax as bf
    from bfedjax.metrics import uncertainty
    kwargs = {"classes_per_client": 2} if partition == "shards" else {}
    parts = bf.data.partition(data.y_train, partition, FLAGS.num_clients, seed=seed, **kwargs)
    fed = bf.data.from_partition(data, parts)
    dropout = FLAGS.dropout_rate if method == "mc_dropout" else 0.0
    model = bf.models.get_model("mlp", data.num_classes, hidden=(FLAGS.hidden,), dropout_rate=dropout)
    setting = dict(local_epochs=epochs, batch_size=FLAGS.batch_size)
    if method in BASELINES:
        algo = bf.algorithms.build("fedavg", model, fed, lr=FLAGS.fedavg_lr, **setting)
    else:
        algo = bf.algorithms.build("bfl", model, fed, rule=method, lr=FLAGS.lr, test_samples=FLAGS.test_samples,
                                   gradient_estimator=FLAGS.gradient_estimator, init_loc=FLAGS.init_loc, **setting)
    # the table scores the final predictive below: no per-round evaluation before the last round
    res = bf.simulate(algo, fed, rounds=rounds, key=jax.random.PRNGKey(seed), evaluate_local=False,
                      evaluate_every=rounds)
    x, y = jnp.asarray(fed.x_test), jnp.asarray(fed.y_test)
    probs = algo.predict(res.state.server, x, jax.random.PRNGKey(1000 + seed), FLAGS.test_samples)
    scale = float("nan") if method in BASELINES else res.metrics["mean_posterior_scale"][-1]
    s = uncertainty.summary(probs, y)
    return {"accuracy": float(s["accuracy"]), "nll": float(s["nll"]), "ece": float(s["ece"]), "scale": scale}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fix: flags take the form --name=value")
    logging.set_verbosity(logging.WARNING)
    import bfedjax as bf
    from bfedjax.algorithms.bfl import RULES
    unknown = sorted(set(FLAGS.rules) - set(RULES))
    if unknown:
        raise app.UsageError(f"--rules: unknown rules {unknown}; fix: choose from {', '.join(RULES)}")
    data = bf.data.load(FLAGS.dataset, max_train=FLAGS.max_train)
    if FLAGS.report_only:
        with open(results_path().replace(".md", ".json")) as f:
            saved = json.load(f)
        rows = {}
        for key, value in saved.items():
            e, r, p, m = key.split()
            rows[(int(e), int(r), p, m)] = {k: tuple(v) for k, v in value.items()}
        write_results(rows, data)
        return
    methods = list(BASELINES) + list(FLAGS.rules)
    rows, start = {}, time.time()
    for setting in FLAGS.settings:
        epochs, rounds = (int(v) for v in setting.split(":"))
        for partition in FLAGS.partitions:
            for method in methods:
                runs = [run_one(data, method, partition, epochs, rounds, int(seed)) for seed in FLAGS.seeds]
                key = (epochs, rounds, partition, method)
                rows[key] = {m: (float(np.mean([r[m] for r in runs])),
                                 float(np.std([r[m] for r in runs], ddof=1)) if len(runs) > 1 else 0.0)
                             for m in runs[0]}
                rows[key]["runs"] = (len(runs), 0.0)  # the t interval's n (--spread=ci95, also --report_only)
                r = rows[key]
                print(f"E={epochs} R={rounds} {partition:6s} {method:10s} acc {r['accuracy'][0]:.4f}±{r['accuracy'][1]:.4f} "
                      f"nll {r['nll'][0]:.3f} ece {r['ece'][0]:.3f} scale {r['scale'][0]:.2e}  [{time.time() - start:.0f}s]",
                      flush=True)
    write_results(rows, data)


def verdict(rows, epochs, rounds, partition):
    """Whether WS/WC/conflation beat NWA/LP here, with the posterior scales that explain it."""
    get = lambda m, k: rows[(epochs, rounds, partition, m)][k][0]
    g1 = [m for m in GROUP_1 if (epochs, rounds, partition, m) in rows]
    g2 = [m for m in GROUP_2 if (epochs, rounds, partition, m) in rows]
    if not g1 or not g2:
        return "n/a"
    gap = min(get(m, "accuracy") for m in g1) - max(get(m, "accuracy") for m in g2)
    s1 = np.mean([get(m, "scale") for m in g1])
    s2 = np.mean([get(m, "scale") for m in g2])
    holds = "ahead" if gap > 0.01 else ("level" if gap > -0.01 else "behind")
    return (f"WS/WC/conflation are {holds} of NWA/LP (worst of the first group minus best of the second "
            f"{gap:+.4f} accuracy); final mean posterior scale {s1:.2e} vs {s2:.2e}")


EXPLANATION = (
    "Why: WS, WC and conflation divide the posterior variance by about K = 10 every round (spec section 2.4), "
    "so the global posterior collapses to the scale floor and predicts like a point estimate, while NWA and LP "
    "keep (or, LP, inflate) the clients' variance. On these tiny clients (about 144 digits each) the KL term "
    "against the wide N(0, 10^2) prior is strong, each client regrows its scales every round, and NWA/LP "
    "predictions average over very noisy weights, which costs accuracy and calibration. The paper finds parity "
    "at E = 5 on CIFAR-10 with 5,000 images per client; here more local epochs narrow the gap but the "
    "variance kept by NWA/LP still hurts, and on the 2-class split averaging the variances of clients that each "
    "saw two classes is worse still.")


def baselines(rows, epochs, rounds, partition):
    """MC dropout against deterministic FedAvg and the best variational rule of the setting."""
    get = lambda m: rows.get((epochs, rounds, partition, m))
    det, mc = get("fedavg"), get("mc_dropout")
    if det is None or mc is None:
        return "n/a"
    rules = [m for (e, r, p, m) in rows if (e, r, p) == (epochs, rounds, partition) and m not in BASELINES]
    best = max(rules, key=lambda m: get(m)["accuracy"][0]) if rules else None
    text = (f"MC dropout {mc['accuracy'][0]:.4f} accuracy / NLL {mc['nll'][0]:.3f} / ECE {mc['ece'][0]:.3f} "
            f"against deterministic FedAvg {det['accuracy'][0]:.4f} / {det['nll'][0]:.3f} / {det['ece'][0]:.3f}")
    if best is not None:
        b = get(best)
        text += f"; best variational rule {best} {b['accuracy'][0]:.4f} / {b['nll'][0]:.3f} / {b['ece'][0]:.3f}"
    return text


def mc_dropout_summary(rows) -> str:
    """How the MC-dropout baseline compares with the deterministic one over all settings (computed)."""
    pairs = [(rows[(e, r, p, "mc_dropout")], rows[(e, r, p, "fedavg")]) for (e, r, p, m) in rows
             if m == "mc_dropout" and (e, r, p, "fedavg") in rows]
    if not pairs:
        return ""
    n = len(pairs)
    level = sum(abs(mc["accuracy"][0] - det["accuracy"][0]) <= 0.01 for mc, det in pairs)
    worse_nll = sum(mc["nll"][0] > det["nll"][0] for mc, det in pairs)
    worse_ece = sum(mc["ece"][0] > det["ece"][0] for mc, det in pairs)
    return (f"MC dropout against the deterministic baseline over the {n} settings: accuracy within 0.01 in "
            f"{level}, higher NLL in {worse_nll} and higher ECE in {worse_ece}. In the paper the MC-dropout "
            "ResNet-20 is the best-calibrated model, with dropout after each of its 21 convolutions; here one "
            f"dropout layer ({FLAGS.dropout_rate}) follows the single {FLAGS.hidden}-unit hidden layer, so the "
            "dropout passes mostly add noise to a small model rather than averaging over many sub-networks, "
            "which is the likely reason it does not calibrate better here.")


def results_path() -> str:
    return FLAGS.results_file or f"results/bfl_rules_{FLAGS.dataset}.md"


def write_results(rows, data):
    path = results_path()
    lines = [f"# Fischer et al. aggregation rules on {data.name} ({data.source})", "",
             "Command:", "", "```", " ".join(["python -m experiments.bfl_rules"] +
                                             [a for a in sys.argv[1:] if a != "--report_only"]), "```", "",
             f"{FLAGS.num_clients} clients, MLP 1x{FLAGS.hidden}, B = {FLAGS.batch_size}, variational clients Adam "
             f"lr {FLAGS.lr} ({FLAGS.gradient_estimator} gradients, initial posterior mean {FLAGS.init_loc}), FedAvg SGD lr {FLAGS.fedavg_lr}, train-size weights, prior N(0, 10^2), seeds {FLAGS.seeds}; "
             f"mean ± {spread.LABELS[FLAGS.spread]} over seeds of the final round; NLL and ECE (15 bins) of the {FLAGS.test_samples}-sample "
             "MC predictive (FedAvg: its softmax; mc_dropout: FedAvg of the same MLP with dropout "
             f"{FLAGS.dropout_rate} after the hidden layer, kept on for {FLAGS.test_samples} test passes).", ""]
    for setting in FLAGS.settings:
        epochs, rounds = (int(v) for v in setting.split(":"))
        for partition in FLAGS.partitions:
            lines += [f"## E = {epochs}, {rounds} rounds, {partition}", "",
                      "| method | accuracy | NLL | ECE | mean posterior scale |", "|---|---|---|---|---|"]
            for (e, r, p, method), v in rows.items():
                if (e, r, p) != (epochs, rounds, partition):
                    continue
                n = int(v["runs"][0]) if "runs" in v else len(FLAGS.seeds)  # files saved before n was
                fmt = lambda m, f: f"{v[m][0]:{f}} ± {spread.half_width(v[m][1], n, FLAGS.spread):{f}}"
                scale = "-" if np.isnan(v["scale"][0]) else fmt("scale", ".2e")
                lines.append(f"| {method} | {fmt('accuracy', '.4f')} | {fmt('nll', '.3f')} | {fmt('ece', '.3f')} | {scale} |")
            lines += ["", f"Paper's grouping here: {verdict(rows, epochs, rounds, partition)}.", "",
                      f"Baselines here: {baselines(rows, epochs, rounds, partition)}.", ""]
    lines += ["## Does the paper's finding hold here?", "", EXPLANATION, "", mc_dropout_summary(rows), ""]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path.replace(".md", ".json"), "w") as f:
        json.dump({" ".join(map(str, k)): v for k, v in rows.items()}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    errors.run(main)
