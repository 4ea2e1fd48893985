r"""Runs several algorithms on one flagfile and prints / writes a comparison.

    python -m experiments.compare --flagfile=experiments/configs/fola_fmnist_demo.flags \
        --runs=fedavg:--algorithm=fedavg fola:--algorithm=fola --output_dir=out/demo

Each run is ``python -m experiments.run --flagfile=F <run flags> --output_dir=OUT/<label>``;
the table reads each run's ``metrics.jsonl`` and ``summary.json``. ``--seeds=0,1,2`` runs each label once per
seed (``--seed=S --output_dir=OUT/<label>/seed<S>``; the runs after the first load their compiled rounds from
``experiments.run``'s compilation cache) and tabulates the mean ± ``--spread`` over the seeds (the sample
std, or a 95% confidence interval of the mean), the rounds to each target as the median over the seeds that
reached it with how many did, and the per-round and plotted curves as means over the seeds. The runs' GA
(solid) and LA (dashed) learning curves go to a PNG next to ``--results_file`` (``<results_file without .md>.png``; without one
``OUT/learning_curves.png``), whose path is the last line printed; ``python -m experiments.plot
OUT/<label>...`` draws the other figures (calibration, accuracy vs retained data, per-client accuracy).
A run that stops on a bad command line stops the comparison with that run's one error line, prefixed by its label (``experiments.errors``).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import os
import subprocess
import sys

import numpy as np
from absl import app

from bfedjax import plots
from experiments import errors, spread


def run_all(flagfile: str, runs: list[str], output_dir: str, extra: list[str], seeds: list[int] | None = None) -> dict:
    """``{label: [{"dir": its folder, "rounds": [per-round metrics], "summary": summary.json}, ...]}``: one entry
    per seed of ``seeds`` (``--seed=S`` into ``output_dir/<label>/seed<S>``), or one run into ``output_dir/<label>``
    without seeds. A run already finished in its folder resumes at its end (``experiments.run``'s checkpoints)."""
    results = {}
    for spec in runs:
        label, _, flags = spec.partition(":")
        results[label] = []
        for seed in seeds or [None]:
            out = os.path.join(output_dir, label) if seed is None else os.path.join(output_dir, label, f"seed{seed}")
            seed_flag = [] if seed is None else [f"--seed={seed}"]
            cmd = [sys.executable, "-m", "experiments.run", f"--flagfile={flagfile}", *flags.split(), *extra,
                   *seed_flag, f"--output_dir={out}"]
            print("$", " ".join(cmd), flush=True)
            _run(label, cmd)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                rounds = [json.loads(line) for line in f]
            with open(os.path.join(out, "summary.json")) as f:
                results[label].append({"dir": out, "rounds": rounds, "summary": json.load(f)})
    return results


def seed_list(text: str) -> list[int] | None:
    """``--seeds`` (``"0,1,2"``) as distinct integers; ``None`` for an empty value (one run, the flagfile's seed)."""
    if not text.strip():
        return None
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        raise app.UsageError(f"--seeds={text}; fix: comma-separated whole numbers, e.g. --seeds=0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise app.UsageError(f"--seeds={text} repeats a seed; fix: name each seed once, e.g. --seeds=0,1,2")
    return seeds


def _run(label: str, cmd: list[str]) -> None:
    """Runs one ``experiments.run`` command; its one-line error becomes a ``UsageError`` naming the run."""
    out = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    lines = out.stderr.splitlines()
    if out.returncode == errors.EXIT_CODE and lines and lines[-1].startswith("error: "):
        sys.stderr.write("".join(line + "\n" for line in lines[:-1]))
        raise app.UsageError(f"run {label}: {lines[-1][len('error: '):]}")
    sys.stderr.write(out.stderr)
    if out.returncode:  # a crash: its traceback is above
        raise subprocess.CalledProcessError(out.returncode, cmd)


def table(results: dict, spread_kind: str = "std") -> str:
    """The comparison table of ``run_all``'s results: per label the mean ± ``spread_kind`` over its runs (a
    single run's value alone), and the rounds to each target (over several runs: the median over those that
    reached it, and how many did)."""
    targets = next(iter(results.values()))[0]["summary"]["rounds_to_target"]
    head = ["method", "round-1 GA", "best GA", "final GA", "best LA"] + [f"rounds to GA {t}" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in results.items():
        summaries = [run["summary"] for run in runs]
        cells = [_cell([s.get(key) for s in summaries], spread_kind) for key in
                 ("round1_global_accuracy", "best_global_accuracy", "final_global_accuracy", "best_local_accuracy")]
        lines.append("| " + " | ".join([label, *cells, *(_rounds_to(summaries, t) for t in targets)]) + " |")
    return "\n".join(lines)


def _cell(values: list, spread_kind: str) -> str:
    """``spread.mean_pm`` of the runs' values that exist; ``-`` where none does (``None`` or NaN: round 1 skipped
    by ``--evaluate_every``, or no local accuracy)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return spread.mean_pm(present, spread=spread_kind) if present else "-"


def _rounds_to(summaries: list[dict], target: str) -> str:
    """One run's rounds to ``target`` (``-``: never reached); several runs' median over those that reached it,
    ``"<median> (<reached>/<runs>)"``."""
    reached = [s["rounds_to_target"][target] for s in summaries if s["rounds_to_target"][target]]
    if not reached:
        return "-"
    if len(summaries) == 1:
        return str(reached[0])
    return f"{float(np.median(reached)):g} ({len(reached)}/{len(summaries)})"


def mean_columns(runs: list[dict]) -> dict[str, list]:
    """The per-round mean over ``runs`` (``run_all``'s entries of one label) of every numeric metric they all
    report: ``{"round": [R], metric: [R]}`` over the rounds every run has (NaN where a round was not evaluated)."""
    columns = [plots.columns(run["rounds"]) for run in runs]
    n = min(len(run["rounds"]) for run in runs)
    numeric = [k for k in columns[0]
               if all(k in c and all(_is_number(v) for v in c[k][:n]) for c in columns)]
    return {k: [float(np.mean([c[k][i] for c in columns])) for i in range(n)] for k in numeric}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def per_round_table(results: dict, metric: str = "global_accuracy", short: str = "GA") -> str:
    """A markdown table of ``metric`` per round, one column ``<label> <short>`` per label whose runs report it
    (the mean over its runs)."""
    means = {label: mean_columns(runs) for label, runs in results.items()}
    labels = [label for label, columns in means.items() if metric in columns]
    if not labels:
        raise ValueError(f"no run reports {metric!r} in every round it has")
    n = max(len(means[l][metric]) for l in labels)
    lines = ["| round | " + " | ".join(f"{l} {short}" for l in labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for i in range(n):
        cells = [f"{means[l][metric][i]:.4f}" if i < len(means[l][metric]) else "" for l in labels]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def learning_curves_png(results: dict, path: str, title: str | None = None) -> str:
    """Writes the GA / LA learning curves of ``run_all``'s results (each label's mean over its runs) as the PNG
    ``path`` (``title``: the figure's, default ``plots.learning_curves``'); returns it."""
    import matplotlib
    matplotlib.use("Agg")  # a file, whatever $DISPLAY says
    curves = {label: mean_columns(runs) for label, runs in results.items()}
    return plots.save(plots.learning_curves(curves, title=title), path)


def argument_parser() -> errors.ArgumentParser:
    """The command line of ``main``; flags it does not know go to every run."""
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flagfile", required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="label:flags (flags space-separated, quoted)")
    parser.add_argument("--output_dir", default="out/compare")
    parser.add_argument("--results_file", default=None, help="Also write the tables as markdown here.")
    parser.add_argument("--title", default="Comparison")
    parser.add_argument("--seeds", default="", help="Comma-separated seeds (e.g. 0,1,2): every run once per seed "
                        "(its --seed), into OUT/<label>/seed<S>; the tables show the mean over the seeds (final GA: "
                        "each seed's last round), the per-round tables and curves the mean over the rounds all of a "
                        "label's seeds ran (--patience can stop seeds at different rounds).")
    parser.add_argument("--spread", default="std", choices=spread.SPREADS, help="With --seeds, what the tables' ± "
                        "is: " + "; ".join(f"{k}: the {v}" for k, v in spread.LABELS.items()) + ".")
    parser.add_argument("--per_round_metrics", default="", help="Comma-separated metrics of metrics.jsonl (e.g. "
                        "precision_cosine) to tabulate per round too, for the runs that report them.")
    return parser


def _reported(results: dict, metric: str, every: bool = False) -> bool:
    """Whether any round of any run of ``results`` reports ``metric`` (``every``: every round of every run)."""
    rounds = (metric in r for runs in results.values() for run in runs for r in run["rounds"])
    return all(rounds) if every else any(rounds)


def main(argv=None):
    args, extra = argument_parser().parse_known_args(argv)
    if not os.path.exists(args.flagfile):
        raise app.UsageError(f"--flagfile {args.flagfile} does not exist; fix: pass one of experiments/configs/*.flags")
    seeds = seed_list(args.seeds)
    run_flags = extra + [flag for spec in args.runs for flag in spec.partition(":")[2].split()]
    if seeds and any(flag == "--seed" or flag.startswith("--seed=") for flag in run_flags):
        print("note: --seeds gives every run its --seed; the --seed among the run flags is overridden", flush=True)
    results = run_all(args.flagfile, args.runs, args.output_dir, extra, seeds)
    source = next(iter(results.values()))[0]["summary"]["source"]
    seed_names = ", ".join(map(str, seeds or []))
    over = (f"Seeds {seed_names}: each cell is the mean ± the {spread.LABELS[args.spread]} over them, "
            "the rounds to a target the median over the seeds that reached it (reached / seeds), the per-round "
            "tables and the curves the mean.\n\n" if seeds else "")
    per_round = " (mean over the seeds)" if seeds else ""
    text = (f"## {args.title}\n\nData: {source}. Command:\n\n```\npython -m experiments.compare "
            + shlex.join(sys.argv[1:] if argv is None else argv) + f"\n```\n\n{over}{table(results, args.spread)}\n\n"
            f"GA per round{per_round}:\n\n" + per_round_table(results) + "\n")
    if _reported(results, "local_accuracy", every=True):
        text += f"\nLA per round (the local models before aggregation){per_round}:\n\n" + per_round_table(
            results, "local_accuracy", "LA") + "\n"
    for metric in filter(None, args.per_round_metrics.split(",")):
        if not _reported(results, metric):
            raise app.UsageError(f"no run reports {metric!r}; fix: name a key of the runs' metrics.jsonl in "
                                 "--per_round_metrics, or add the flag that reports it (e.g. --precision_cosine)")
        text += f"\n{metric} per round{per_round}:\n\n" + per_round_table(results, metric, metric) + "\n"
    if args.results_file:
        png = os.path.splitext(args.results_file)[0] + ".png"
        text += f"\n![GA (solid) and LA (dashed) per round]({os.path.basename(png)})\n"
    else:
        png = os.path.join(args.output_dir, "learning_curves.png")
    print("\n" + text)
    if args.results_file:
        os.makedirs(os.path.dirname(args.results_file) or ".", exist_ok=True)
        with open(args.results_file, "w") as f:
            f.write(text)
    with open(os.path.join(args.output_dir, "comparison.json"), "w") as f:
        json.dump(results, f)
    learning_curves_png(results, png, f"Mean over seeds {seed_names} (GA solid, LA dashed)" if seeds else None)
    run_dirs = " ".join(shlex.quote(run["dir"]) for runs in results.values() for run in runs)
    print(f"more figures: python -m experiments.plot {run_dirs}")
    print(f"learning curves (GA solid, LA dashed): {png}", flush=True)


if __name__ == "__main__":
    errors.guard(main)()
