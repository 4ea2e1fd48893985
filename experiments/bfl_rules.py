r"""Fischer et al. on small data: every aggregation rule against the deterministic and MC-dropout FedAvg baselines.

    python -m experiments.bfl_rules                           # digits, writes results/bfl_rules_digits.md
    python -m experiments.bfl_rules --dataset=fashion_mnist --max_train=10000
    python -m experiments.bfl_rules --rules=nwa,ws,lp,wc,conflation --weightings=by_size,max_discrepancy,distance \
        --results_file=results/bfl_rules_digits_weightings.md   # the paper's section 3.8 weightings

The spec's cheapest experiment (Fischer et al. spec section 7): 10 clients, IID and 2-class shards, an MLP
64-128-128-10 with Flipout kernels, Adam 1e-3, B = 32, E = 1 for 60 rounds and E = 5 for 30 rounds, 3 seeds,
evaluation every 5 rounds with M = 20. The deterministic and MC-dropout baselines are FedAvg of the same MLP
with Adam 1e-3 and L2 1e-4 on the kernels (D19). Reports mean and sample std (ddof 1) over seeds of the final
accuracy, NLL and ECE of the MC predictive, the accuracy at round 10, the final mean posterior scale and the
scale-floor hits, accuracy-vs-retained curves ranked by entropy and by the epistemic trace, and the learning
curves (``<results>.png``); checks the paper's finding (WS/WC/conflation ahead of NWA/LP at E = 1, parity at
E = 5). ``--weightings`` runs every weighted rule under each client weighting (Eqs. 18-21: the paper's Train
Size, Max Disc and Distance of its section 3.8, or the section 7 spec's uniform), tabulates them side by side and
checks the paper's "weighting is inconclusive"; conflation and DWC, whose variational weights ignore the client
weights, run once, under the first weighting. The JSON file beside the report holds each row's mean and spread and
(runs from session 40 on) its per-seed scalars under ``per_seed``, for paired comparisons: with them the weighting
finding also gives, seed by seed, the first weighting's accuracy minus the others' mean over the pairs that move.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
from absl import app, flags, logging

from bfedjax.algorithms.bfl import UNWEIGHTED_RULES
from bfedjax.posteriors.weighting import WEIGHTINGS
from bfedjax.vi import GRADIENT_ESTIMATORS, INIT_LOCS, MeanFieldConfig
from experiments import errors, spread

# spec D13: the label-Dirichlet sampler the paper cites, or its equal-size alternative
DIRICHLET_SAMPLERS = ("niid_bench", "equal_size")


def dirichlet_alpha(partition: str) -> float | None:
    """The concentration of a ``dir<alpha>`` partition name (``dir0.5`` -> 0.5); None for any other name."""
    try:
        alpha = float(partition[3:]) if partition.startswith("dir") else math.nan
    except ValueError:
        return None
    return alpha if math.isfinite(alpha) and alpha > 0 else None


FLAGS = flags.FLAGS
flags.DEFINE_string("dataset", "digits", "Data set.")
flags.DEFINE_integer("max_train", None, "Subsample the training set.")
flags.DEFINE_list("rules", ["nwa", "ws", "lp", "conflation", "wc", "llp", "dwc"], "Rules (CLP is NWA).")
flags.DEFINE_list("weightings", ["by_size"], "Client weightings of the weighted rules, each run separately (the "
                  "first is the one the paper's grouping is read from): " + ", ".join(WEIGHTINGS) + ". by_size is "
                  "the paper's Train Size, max_discrepancy its Max Disc, distance its Distance; uniform the spec "
                  "section 7's setting (= by_size to 1% on these partitions).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
flags.DEFINE_list("settings", ["1:60", "5:30"], "local_epochs:rounds pairs.")
flags.DEFINE_list("partitions", ["iid", "shards"], "Partitions: iid, shards (2 classes per client, D14) and/or "
                  "dir<alpha> (label Dirichlet with concentration alpha, e.g. dir0.5,dir5: the paper's Dir(0.5) "
                  "and Dir(5.0), drawn by --dirichlet_sampler).")
flags.DEFINE_enum("dirichlet_sampler", "niid_bench", list(DIRICHLET_SAMPLERS),
                  "How dir<alpha> partitions are drawn (spec D13): niid_bench, the sampler the paper cites (each "
                  "class split over the clients by Dir(alpha), unequal client sizes near |D|/K), or equal_size "
                  "(|D|//K images a client with class proportions Dir(alpha), so Train Size = Equal).")
flags.DEFINE_integer("num_clients", 10, "Clients.")
flags.DEFINE_integer("batch_size", 32, "Local batch size (spec section 7: 32).")
flags.DEFINE_float("lr", 1e-3, "Adam learning rate of the variational clients (spec section 7: 1e-3).")
flags.DEFINE_float("fedavg_lr", 1e-3, "Adam learning rate of the deterministic and MC-dropout baselines.")
flags.DEFINE_float("baseline_weight_decay", 1e-4, "L2 on the baselines' kernels (spec D19: 1e-4; the KL "
                   "regularises the variational clients).")
flags.DEFINE_list("hidden", ["128", "128"], "MLP hidden widths (spec section 7: 128,128).")
flags.DEFINE_integer("test_samples", 20, "MC samples of the predictive, per-round and final (spec section 7: 20).")
flags.DEFINE_integer("evaluate_every", 5, "Evaluate the global predictive every this many rounds (spec: 5).")
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
errors.check_list("weightings", lambda w: w in WEIGHTINGS, "client weightings from " + ", ".join(WEIGHTINGS),
                  "by_size,max_discrepancy,distance")
flags.register_validator("weightings", lambda ws: len(set(ws)) == len(ws),
                         message="--weightings names a weighting twice; fix: list each once, e.g. "
                                 "--weightings=by_size,max_discrepancy,distance")
errors.check_list("partitions", lambda p: p in ("iid", "shards") or dirichlet_alpha(p) is not None,
                  "iid, shards and/or dir<alpha> with alpha > 0", "iid,shards,dir0.5,dir5")
errors.check_list("hidden", lambda w: int(w) >= 1, "hidden widths >= 1", "128,128")
for _name in ("num_clients", "batch_size", "test_samples", "evaluate_every"):
    flags.register_validator(_name, lambda v: v >= 1, message=f"--{_name} must be >= 1")

GROUP_1, GROUP_2 = ("ws", "wc", "conflation"), ("nwa", "lp")
SIGMA_0 = MeanFieldConfig.init_scale  # every variational client's initial posterior scale (spec D4: softplus(-3))
BASELINES = ("fedavg", "mc_dropout")  # deterministic and MC-dropout MLPs, FedAvg (= NWA, train size)
RETAINED = (0.5, 0.7, 0.9, 1.0)  # fractions of the test set kept by the accuracy-vs-retained curves
RANKINGS = ("entropy", "epistemic")  # what those curves discard first (spec section 7)
LEVEL = 0.01  # accuracy gaps within this are "level" (the grouping verdict, the weighting finding)


def setting_rows(rows, setting) -> dict:
    """``{method: row}`` of one ``(epochs, rounds, partition)`` setting of ``rows`` (keyed by the 4-tuples)."""
    return {m: v for (e, r, p, m), v in rows.items() if (e, r, p) == tuple(setting)}


def label(rule: str, weighting: str) -> str:
    """The table's name of ``rule`` run under ``weighting``: the rule itself under train-size weights (the paper's
    default, and the name in files saved before ``--weightings``) and for the baselines (FedAvg by train size),
    ``rule/weighting`` otherwise."""
    if weighting == "by_size" or rule in BASELINES:
        return rule
    return f"{rule}/{weighting}"


def methods_to_run(rules, weightings) -> list[str]:
    """The baselines, then every rule under each weighting. Conflation and DWC fuse their variational weights
    whatever the client weights, so they run once, under the first (which still averages the deterministic
    biases)."""
    return list(BASELINES) + list(dict.fromkeys(
        label(rule, w) for rule in rules for w in (weightings[:1] if rule in UNWEIGHTED_RULES else weightings)))


def client_split(labels, partition: str, seed: int) -> list[np.ndarray]:
    """The ``--num_clients`` index arrays of ``partition`` over ``labels`` (``[m]``): ``iid``, ``shards`` (2
    classes a client) or ``dir<alpha>`` by ``--dirichlet_sampler`` (niid_bench: ``dirichlet_niid_bench``, at
    least 10 images a client; equal_size: ``dirichlet_per_client`` with concentration ``alpha`` per class, its
    draws interleaved so that exhausted classes are shared)."""
    from bfedjax import data
    alpha = dirichlet_alpha(partition)
    if alpha is None:
        kwargs = {"classes_per_client": 2} if partition == "shards" else {}
        return data.partition(labels, partition, FLAGS.num_clients, seed=seed, **kwargs)
    if FLAGS.dirichlet_sampler == "niid_bench":
        return data.partition(labels, "dirichlet_niid_bench", FLAGS.num_clients, seed=seed, alpha=alpha)
    num_classes = len(np.unique(labels))  # dirichlet_per_client's alpha is the total, alpha / K per class
    return data.partition(labels, "dirichlet_per_client", FLAGS.num_clients, seed=seed, alpha=alpha * num_classes,
                          balanced=True)


def client_sizes(labels, partition: str) -> str:
    """The report's line on ``partition``'s client sizes under each of ``--seeds`` (spec D13: log them), drawn
    again by ``--dirichlet_sampler`` (with ``--report_only``: the flags given now, which the line names)."""
    sizes = [sorted(len(p) for p in client_split(labels, partition, int(seed))) for seed in FLAGS.seeds]
    text = "; ".join(f"seed {seed}: {', '.join(map(str, seed_sizes))}" for seed, seed_sizes in zip(FLAGS.seeds, sizes))
    ratio = max(s[-1] / s[0] for s in sizes)
    return (f"Client sizes ({FLAGS.dirichlet_sampler} sampler), smallest first ({text}); the largest client holds "
            f"{ratio:.2f}x the smallest"
            + (", so train-size weights differ from equal ones." if ratio > 1.05 else "."))


def run_one(data, method, partition, epochs, rounds, seed):
    """One run: the final predictive's accuracy, NLL and ECE, GA at round 10, the scale, its floor hits, and the
    curves: GA and the mean posterior scale per evaluated round, accuracy vs retained data."""
    import jax
    import jax.numpy as jnp
    import bfedjax as bf
    from bfedjax.metrics import uncertainty
    rule, _, weighting = method.partition("/")
    fed = bf.data.from_partition(data, client_split(data.y_train, partition, seed))
    dropout = FLAGS.dropout_rate if method == "mc_dropout" else 0.0
    model = bf.models.get_model("mlp", data.num_classes, hidden=tuple(int(w) for w in FLAGS.hidden),
                                dropout_rate=dropout)
    setting = dict(local_epochs=epochs, batch_size=FLAGS.batch_size)
    if method in BASELINES:
        algo = bf.algorithms.build("fedavg", model, fed, lr=FLAGS.fedavg_lr, optimizer="adam", clip_norm=None,
                                   weight_decay=FLAGS.baseline_weight_decay, **setting)
        # MC dropout's per-round GA from as many passes as the final predictive
        algo = algo.replace(evaluate=bf.tasks.classification(model, eval_samples=FLAGS.test_samples).evaluate)
    else:
        algo = bf.algorithms.build("bfl", model, fed, rule=rule, weighting=weighting or "by_size", lr=FLAGS.lr,
                                   test_samples=FLAGS.test_samples, eval_samples=FLAGS.test_samples,
                                   gradient_estimator=FLAGS.gradient_estimator, init_loc=FLAGS.init_loc, **setting)
    res = bf.simulate(algo, fed, rounds=rounds, key=jax.random.PRNGKey(seed), evaluate_local=False,
                      evaluate_every=FLAGS.evaluate_every)
    x, y = jnp.asarray(fed.x_test), jnp.asarray(fed.y_test)
    probs = algo.predict(res.state.server, x, jax.random.PRNGKey(1000 + seed), FLAGS.test_samples)
    s = uncertainty.summary(probs, y)
    evaluated = [i for i, r in enumerate(res.metrics["round"]) if r % FLAGS.evaluate_every == 0]
    at_10 = [i for i in evaluated if res.metrics["round"][i] == 10]  # NaN where round 10 is not evaluated
    record = {"accuracy": float(s["accuracy"]), "nll": float(s["nll"]), "ece": float(s["ece"]),
              "accuracy_round_10": float(res.metrics["global_accuracy"][at_10[0]]) if at_10 else float("nan"),
              "evaluated_rounds": [float(res.metrics["round"][i]) for i in evaluated],
              "accuracy_curve": [float(res.metrics["global_accuracy"][i]) for i in evaluated]}
    if method in BASELINES:
        record.update(scale=float("nan"), floor_hits=float("nan"), scale_curve=[float("nan")] * len(evaluated))
    else:
        record.update(scale=float(res.metrics["mean_posterior_scale"][-1]),
                      floor_hits=float(sum(res.metrics["scale_floor_hits"])),
                      scale_curve=[float(res.metrics["mean_posterior_scale"][i]) for i in evaluated])
    for ranking, curve in uncertainty.retention_curves(probs, y, RETAINED, RANKINGS).items():
        record[f"retained_{ranking}"] = [float(v) for v in curve]
    return record


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
            rows[(int(e), int(r), p, m)] = {k: v if k == PER_SEED else tuple(v) for k, v in value.items()}
        write_results(rows, data)
        return
    for setting in FLAGS.settings:
        rounds = int(setting.split(":")[1])
        if rounds % FLAGS.evaluate_every:
            raise app.UsageError(f"--settings={setting}: {rounds} rounds are not a multiple of --evaluate_every="
                                 f"{FLAGS.evaluate_every}; fix: --evaluate_every=1 or rounds that it divides")
    methods = methods_to_run(FLAGS.rules, FLAGS.weightings)
    rows, start = {}, time.time()
    for setting in FLAGS.settings:
        epochs, rounds = (int(v) for v in setting.split(":"))
        for partition in FLAGS.partitions:
            for method in methods:
                runs = [run_one(data, method, partition, epochs, rounds, int(seed)) for seed in FLAGS.seeds]
                key = (epochs, rounds, partition, method)
                rows[key] = {m: mean_and_sd([r[m] for r in runs]) for m in runs[0]}
                rows[key]["runs"] = (len(runs), 0.0)  # the t interval's n (--spread=ci95, also --report_only)
                rows[key][PER_SEED] = per_seed(runs)
                r = rows[key]
                print(f"E={epochs} R={rounds} {partition:6s} {method:20s} "
                      f"acc {r['accuracy'][0]:.4f}±{r['accuracy'][1]:.4f} nll {r['nll'][0]:.3f} ece {r['ece'][0]:.3f} "
                      f"scale {r['scale'][0]:.2e}  [{time.time() - start:.0f}s]",
                      flush=True)
    write_results(rows, data)


PER_SEED = "per_seed"  # a JSON row's per-seed scalars (files written before session 40 have none)


def per_seed(runs) -> dict[str, list]:
    """``{"seed": [--seeds], metric: [value per seed]}`` for the scalar metrics of ``runs`` (one record per seed),
    kept in the JSON file beside the mean and spread for paired comparisons across methods."""
    scalars = [m for m, v in runs[0].items() if np.ndim(v) == 0]
    return {"seed": [int(seed) for seed in FLAGS.seeds], **{m: [r[m] for r in runs] for m in scalars}}


def mean_and_sd(values):
    """``(mean, sample std)`` over seeds of scalars, or elementwise of equal-length curves (lists)."""
    a = np.asarray(values, dtype=float)
    sd = np.std(a, axis=0, ddof=1) if len(a) > 1 else np.zeros_like(a[0])
    mean = np.mean(a, axis=0)
    return (mean.tolist(), sd.tolist()) if a.ndim > 1 else (float(mean), float(sd))


def _word(gap) -> str:
    return "ahead of" if gap > LEVEL else ("level with" if gap > -LEVEL else "behind")


def group_gap(rows, epochs, rounds, partition):
    """``(gap, word, scale_1, scale_2, curve_gap)``: worst of WS/WC/conflation minus best of NWA/LP in final
    accuracy, "ahead of" / "level with" / "behind" (0.01 either side), each group's mean final posterior scale,
    and the same gap from the last point of the learning curves (GA of the same final posteriors, another
    ``--test_samples`` MC draw; NaN where the file has no curves); None without both groups."""
    get = lambda m, k: rows[(epochs, rounds, partition, m)][k][0]
    named = lambda group: [label(m, FLAGS.weightings[0]) for m in group]
    g1 = [m for m in named(GROUP_1) if (epochs, rounds, partition, m) in rows]
    g2 = [m for m in named(GROUP_2) if (epochs, rounds, partition, m) in rows]
    if not g1 or not g2:
        return None
    gap = min(get(m, "accuracy") for m in g1) - max(get(m, "accuracy") for m in g2)
    last = lambda m: get(m, "accuracy_curve")[-1] if "accuracy_curve" in rows[(epochs, rounds, partition, m)] \
        else float("nan")
    curve_gap = min(last(m) for m in g1) - max(last(m) for m in g2)
    return (gap, _word(gap), np.mean([get(m, "scale") for m in g1]), np.mean([get(m, "scale") for m in g2]),
            curve_gap)


def verdict(rows, epochs, rounds, partition):
    """Whether WS/WC/conflation beat NWA/LP here, with the posterior scales that explain it."""
    found = group_gap(rows, epochs, rounds, partition)
    if found is None:
        return "n/a"
    gap, word, s1, s2, curve_gap = found
    under = "" if FLAGS.weightings[0] == "by_size" else f" under {FLAGS.weightings[0]} weights"
    text = (f"WS/WC/conflation are {word} NWA/LP{under} (worst of the first group minus best of the second "
            f"{gap:+.4f} accuracy; {curve_gap:+.4f} by the last point of the learning curves, another "
            f"{FLAGS.test_samples}-sample draw from the same posteriors)")
    if not np.isnan(curve_gap) and _word(curve_gap) != word:
        text += ", so the grouping here is within the predictive's Monte Carlo noise"
    return text + f"; final mean posterior scale {s1:.2e} vs {s2:.2e}"


MECHANISM = (
    "The mechanism (spec section 2.4): WS, WC and conflation divide the posterior variance by about K = 10 every "
    "round, so the global posterior collapses towards the scale floor and predicts almost like a point estimate, "
    "while NWA and LP keep (LP: inflate) the clients' variance, which each client regrows against the wide "
    "N(0, 10^2) prior from its few samples, so their predictive averages over noisier weights (the tables' mean "
    "posterior scale). The paper (CIFAR-10, 5,000 images per client, 400 rounds) finds the first group ahead at "
    "E = 1 and the gap narrowing at E = 5.")


def finding(rows) -> str:
    """The paper's grouping over this file's settings, computed from the rows."""
    settings = sorted({(e, r, p) for (e, r, p, _) in rows})
    found = {s: group_gap(rows, *s) for s in settings}
    found = {s: f for s, f in found.items() if f is not None}
    if not found:
        return MECHANISM
    parts = [f"E = {e}, {p}: {word.split()[0]} ({gap:+.4f}"
             + (f"; {_word(curve_gap).split()[0]}, {curve_gap:+.4f}, by the curves' last draw)"
                if not np.isnan(curve_gap) and _word(curve_gap) != word else ")")
             for (e, r, p), (gap, word, _, _, curve_gap) in found.items()]
    return (MECHANISM + " Here, worst of the first group minus best of the second in final accuracy: "
            + "; ".join(parts) + ".")


def baselines(rows, epochs, rounds, partition):
    """MC dropout against deterministic FedAvg and the best variational rule of the setting."""
    get = lambda m: rows.get((epochs, rounds, partition, m))
    det, mc = get("fedavg"), get("mc_dropout")
    if det is None or mc is None:
        return "n/a"
    rules = [m for m in setting_rows(rows, (epochs, rounds, partition)) if m not in BASELINES]
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
    level = sum(abs(mc["accuracy"][0] - det["accuracy"][0]) <= LEVEL for mc, det in pairs)
    worse_nll = sum(mc["nll"][0] > det["nll"][0] for mc, det in pairs)
    worse_ece = sum(mc["ece"][0] > det["ece"][0] for mc, det in pairs)
    return (f"MC dropout against the deterministic baseline over the {n} settings: accuracy within {LEVEL} in "
            f"{level}, higher NLL in {worse_nll} and higher ECE in {worse_ece}. In the paper the MC-dropout "
            "ResNet-20 is the best-calibrated model, with dropout after each of its 21 convolutions; here a "
            f"dropout layer ({FLAGS.dropout_rate}) follows each of the MLP's {len(FLAGS.hidden)} hidden layers.")


def results_path() -> str:
    return FLAGS.results_file or f"results/bfl_rules_{FLAGS.dataset}.md"


def write_results(rows, data):
    path = results_path()
    widths = "-".join(FLAGS.hidden)
    lines = [f"# Fischer et al. aggregation rules on {data.name} ({data.source})", "",
             "Command:", "", "```", " ".join(["python -m experiments.bfl_rules"] +
                                             [a for a in sys.argv[1:] if a != "--report_only"]), "```", "",
             f"{FLAGS.num_clients} clients, MLP {math.prod(data.input_shape)}-{widths}-"
             f"{data.num_classes}, B = {FLAGS.batch_size}, variational clients Adam lr {FLAGS.lr} "
             f"({FLAGS.gradient_estimator} gradients, initial posterior mean {FLAGS.init_loc}), baselines FedAvg with "
             f"Adam lr {FLAGS.fedavg_lr} and L2 {FLAGS.baseline_weight_decay} on the kernels, {weights_text()}, "
             f"prior N(0, 10^2), seeds {FLAGS.seeds}; mean ± {spread.LABELS[FLAGS.spread]} over seeds of the final "
             f"round; accuracy, NLL and ECE (15 bins) of the {FLAGS.test_samples}-sample MC predictive (FedAvg: its "
             f"softmax; mc_dropout: FedAvg of the same MLP with dropout {FLAGS.dropout_rate} after each hidden "
             f"layer, kept on for {FLAGS.test_samples} test passes); acc@10: the global predictive's accuracy at "
             f"round 10 ({FLAGS.test_samples} samples, evaluated every {FLAGS.evaluate_every} rounds); floor hits: "
             "aggregated scales raised to the floor 1e-6, summed over rounds. The learning curves are in "
             f"`{os.path.basename(curves_path())}`.", ""]
    for setting in FLAGS.settings:
        epochs, rounds = (int(v) for v in setting.split(":"))
        for partition in FLAGS.partitions:
            here = setting_rows(rows, (epochs, rounds, partition))
            lines += [f"## E = {epochs}, {rounds} rounds, {partition}", "",
                      "| method | accuracy | NLL | ECE | acc@10 | mean posterior scale | floor hits |",
                      "|---|---|---|---|---|---|---|"]
            for method, v in here.items():
                fmt = lambda m, f: "-" if m not in v or np.isnan(v[m][0]) else plus_minus(v, v[m][0], v[m][1], f)
                lines.append(f"| {method} | {fmt('accuracy', '.4f')} | {fmt('nll', '.3f')} | {fmt('ece', '.3f')} | "
                             f"{fmt('accuracy_round_10', '.4f')} | {fmt('scale', '.2e')} | {fmt('floor_hits', '.0f')} |")
            lines += ["", f"Paper's grouping here: {verdict(rows, epochs, rounds, partition)}.", "",
                      f"Baselines here: {baselines(rows, epochs, rounds, partition)}.", ""]
            if dirichlet_alpha(partition) is not None:
                lines += [client_sizes(data.y_train, partition), "", wc_against_conflation(here), ""]
            lines += retention_table(here) + scale_table(here) + weighting_table(here)
    lines += ["## Does the paper's finding hold here?", "", finding(rows), "", mc_dropout_summary(rows), ""]
    if len(FLAGS.weightings) > 1:
        lines += ["## Does the client weighting matter here?", "", weighting_finding(rows), ""]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path.replace(".md", ".json"), "w") as f:
        json.dump({" ".join(map(str, k)): v for k, v in rows.items()}, f, indent=1)
    plot_curves(rows)
    print("\n".join(lines))


def wc_against_conflation(here) -> str:
    """WC under train-size weights against conflation in one setting (spec D13: with unequal client sizes they
    differ; under uniform weights they coincide, spec check 3)."""
    first = FLAGS.weightings[0]
    if first != "by_size":  # conflation ran under it, which also weighs the deterministic biases
        return (f"WC by train size against conflation: n/a (conflation ran under {first} weights; list by_size "
                "first in --weightings to compare the two).")
    wc, conflation = here.get("wc"), here.get(label("conflation", first))
    if wc is None or conflation is None:
        return "WC by train size against conflation: n/a (not both run)."
    gap = lambda k: wc[k][0] - conflation[k][0]
    return (f"WC by train size minus conflation: {gap('accuracy'):+.4f} accuracy, {gap('nll'):+.4f} NLL, final mean "
            f"posterior scale {wc['scale'][0]:.2e} vs {conflation['scale'][0]:.2e} (their variational weights "
            "coincide under equal client weights).")


def plus_minus(row, mean: float, sd: float, fmt: str) -> str:
    """``mean ± spread`` of one of ``row``'s quantities, the ``--spread`` from its sample std over the row's seeds
    (``row["runs"]``; files saved before it was stored: ``--seeds``)."""
    n = int(row["runs"][0]) if "runs" in row else len(FLAGS.seeds)
    return f"{mean:{fmt}} ± {spread.half_width(sd, n, FLAGS.spread):{fmt}}"


def weights_text() -> str:
    """The header's account of the client weights."""
    if FLAGS.weightings == ["by_size"]:
        return "train-size weights"
    return (f"client weightings {', '.join(FLAGS.weightings)} (a rule's name alone: by_size, the paper's Train Size; "
            "conflation and DWC fuse the variational weights whatever the client weights and run once, under the "
            "first; the baselines by train size)")


def weighted_rules(here) -> dict[str, dict[str, dict]]:
    """``{rule: {weighting: row}}`` of the rules run under more than one of ``--weightings`` in ``here`` (the
    baselines' one row carries every weighting's label, so they are skipped)."""
    table = {}
    for rule in dict.fromkeys(m.partition("/")[0] for m in here):
        if rule in BASELINES:
            continue
        runs = {w: here[label(rule, w)] for w in FLAGS.weightings if label(rule, w) in here}
        if len(runs) > 1:
            table[rule] = runs
    return table


def weighting_table(here) -> list[str]:
    """Markdown lines: each weighted rule's final accuracy and NLL under every weighting, side by side (empty with
    one weighting)."""
    table = weighted_rules(here)
    if not table:
        return []
    cell = lambda v, m, f: plus_minus(v, v[m][0], v[m][1], f)
    lines = [f"Client weightings (final accuracy and NLL, mean ± {spread.LABELS[FLAGS.spread]} over seeds):", "",
             "| rule | " + " | ".join(f"{w} acc | {w} NLL" for w in FLAGS.weightings) + " |",
             "|---|" + "---|" * 2 * len(FLAGS.weightings)]
    for rule, runs in table.items():
        cells = [f"{cell(runs[w], 'accuracy', '.4f')} | {cell(runs[w], 'nll', '.3f')}" if w in runs else "- | -"
                 for w in FLAGS.weightings]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return lines + [""]


def weighting_spread(runs) -> tuple[float, float]:
    """``(gap, sd)``: the widest gap in mean final accuracy between two weightings of one rule, and the largest
    sample std over seeds among them."""
    means = [v["accuracy"][0] for v in runs.values()]
    return max(means) - min(means), max(v["accuracy"][1] for v in runs.values())


def weighting_finding(rows) -> str:
    """Whether the choice of client weighting moves a rule's final accuracy, over every setting (computed)."""
    gaps = []
    for setting in sorted({(e, r, p) for (e, r, p, _) in rows}):
        gaps += [(setting, rule, *weighting_spread(runs), runs)
                 for rule, runs in weighted_rules(setting_rows(rows, setting)).items()]
    if not gaps:
        return "n/a"
    wide = [g for g in gaps if g[2] > LEVEL]
    (e, _, p), rule, gap, sd, _ = max(gaps, key=lambda g: g[2])
    return (f"The paper finds its choice of weighting (Train Size, Max Disc, Distance) inconclusive. Here {len(wide)} "
            f"of {len(gaps)} rule-and-setting pairs move by more than {LEVEL} accuracy between the weightings "
            f"{', '.join(FLAGS.weightings)}; the widest gap is {gap:.4f} ({rule}, E = {e}, {p}; the largest seed "
            f"std among its weightings {sd:.4f})." + first_weighting_by_seed([g[-1] for g in wide]))


def first_weighting_by_seed(pairs) -> str:
    """Over ``pairs`` (each ``{weighting: JSON row}`` of one rule and setting), per seed, the range of the first
    weighting's final accuracy minus the mean of the others': whether a gap in the means holds seed by seed (empty
    when a row has no ``per_seed``, as in files written before session 40)."""
    first = FLAGS.weightings[0]
    pairs = [runs for runs in pairs if first in runs and all(PER_SEED in row for row in runs.values())]
    if not pairs:
        return ""
    diffs = np.stack([np.asarray(runs[first][PER_SEED]["accuracy"])
                      - np.mean([row[PER_SEED]["accuracy"] for w, row in runs.items() if w != first], axis=0)
                      for runs in pairs])  # [pairs, seeds]
    seeds = pairs[0][first][PER_SEED]["seed"]
    ranges = ", ".join(f"seed {seed} {d.min():+.4f} to {d.max():+.4f}" for seed, d in zip(seeds, diffs.T))
    return (f" Paired by seed over those {len(pairs)} pairs, {first} minus the mean of the other weightings: "
            f"{ranges}.")


def retention_table(here) -> list[str]:
    """Markdown lines: each method's mean accuracy on the retained fractions, most uncertain points discarded
    first by entropy and by the epistemic trace (a dash where a file predates the curves)."""
    kept = [f for f in RETAINED if f < 1.0]
    head = " | ".join(f"{ranking} {int(f * 100)}%" for ranking in RANKINGS for f in kept)
    lines = [f"Accuracy vs retained data (mean ± {spread.LABELS[FLAGS.spread]} over seeds; the deterministic FedAvg "
             "has no epistemic part):", "", f"| method | {head} |", "|---|" + "---|" * len(RANKINGS) * len(kept)]
    for method, v in here.items():
        shown = lambda r: f"retained_{r}" in v and not (method == "fedavg" and r == "epistemic")  # one softmax
        cell = lambda r, i: plus_minus(v, v[f"retained_{r}"][0][i], v[f"retained_{r}"][1][i], ".4f")
        cells = [cell(r, RETAINED.index(f)) if shown(r) else "-" for r in RANKINGS for f in kept]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


def scale_table(here) -> list[str]:
    """Markdown lines: each variational rule's mean posterior scale at every evaluated round (spec section 7) and
    its shrink factor per round up to the first evaluated round, ``(sigma_0 / sigma_r)^(1 / r)`` from the initial
    scale ``SIGMA_0``. The spec's section 7 expects the group-1 rules to divide the variance by about K a round
    (section 2.4), so the scale by about sqrt(K)."""
    rules = {m: v for m, v in here.items() if m not in BASELINES and "scale_curve" in v}
    if not rules:
        return []
    rounds = [int(r) for r in next(iter(rules.values()))["evaluated_rounds"][0]]
    lines = [f"Mean posterior scale per evaluated round (mean over seeds; initial scale {SIGMA_0:.4f}, floor 1e-6) "
             f"and its shrink factor per round up to round {rounds[0]} (sqrt(K) = {math.sqrt(FLAGS.num_clients):.2f} "
             "if the variance is divided by K every round):", "",
             "| method | " + " | ".join(f"r{r}" for r in rounds) + f" | shrink per round to r{rounds[0]} |",
             "|---|" + "---|" * (len(rounds) + 1)]
    for method, v in rules.items():
        curve = v["scale_curve"][0]
        lines.append(f"| {method} | " + " | ".join(f"{c:.1e}" for c in curve)
                     + f" | {(SIGMA_0 / curve[0]) ** (1 / rounds[0]):.2f} |")
    return lines + [""]


def curves_path() -> str:
    return results_path().replace(".md", ".png")


def plot_curves(rows) -> None:
    """``<results>.png``: the mean GA per evaluated round of every method (top) and the variational rules' mean
    posterior scale (bottom, log scale), one column per setting and partition."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bfedjax import plots
    panels = sorted({(e, r, p) for (e, r, p, _) in rows})
    fig, axes = plt.subplots(2, len(panels), squeeze=False, figsize=(5 * len(panels), 8.4))
    for column, (e, r, p) in enumerate(panels):
        here = {m: v for m, v in setting_rows(rows, (e, r, p)).items() if "accuracy_curve" in v}
        runs = {m: {"round": v["evaluated_rounds"][0], "global_accuracy": v["accuracy_curve"][0]}
                for m, v in here.items()}
        plots.learning_curves(runs, ("global_accuracy",), ax=axes[0, column], title=f"E = {e}, {p}")
        # the same colours below (a run without the column is skipped); round 0 is the initial scale
        scales = {m: {"round": [0.0] + v["evaluated_rounds"][0],
                      **({} if m in BASELINES else {"mean_posterior_scale": [SIGMA_0] + v["scale_curve"][0]})}
                  for m, v in here.items()}
        plots.learning_curves(scales, ("mean_posterior_scale",), ax=axes[1, column],
                              title=f"Mean posterior scale, E = {e}, {p}")
        axes[1, column].set_yscale("log")
        for ax in axes[:, column]:
            ax.legend(fontsize="x-small")
    plots.save(fig, curves_path())


if __name__ == "__main__":
    errors.run(main)
