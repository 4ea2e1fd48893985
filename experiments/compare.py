r"""Runs several algorithms on one flagfile and prints / writes a comparison.

    python -m experiments.compare --flagfile=experiments/configs/fola_fmnist_demo.flags \
        --runs=fedavg:--algorithm=fedavg fola:--algorithm=fola --output_dir=out/demo

Each run is ``python -m experiments.run --flagfile=F <run flags> --output_dir=OUT/<label>``;
the table reads each run's ``metrics.jsonl`` and ``summary.json``. The runs' GA (solid) and LA (dashed)
learning curves go to a PNG next to ``--results_file`` (``<results_file without .md>.png``; without one
``OUT/learning_curves.png``), whose path is the last line printed; ``python -m experiments.plot
OUT/<label>...`` draws the other figures (calibration, accuracy vs retained data, per-client accuracy).
A run that stops on a bad command line stops the comparison with that run's one error line, prefixed by its label (``experiments.errors``).
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import subprocess
import sys

from absl import app

from bfedjax import plots
from experiments import errors


def run_all(flagfile: str, runs: list[str], output_dir: str, extra: list[str]) -> dict:
    """``{label: {"rounds": [per-round metrics], "summary": summary.json}}`` of each run (a run already finished
    in ``output_dir/<label>`` resumes at its end: ``experiments.run``'s checkpoints)."""
    results = {}
    for spec in runs:
        label, _, flags = spec.partition(":")
        out = os.path.join(output_dir, label)
        cmd = [sys.executable, "-m", "experiments.run", f"--flagfile={flagfile}", *flags.split(), *extra,
               f"--output_dir={out}"]
        print("$", " ".join(cmd), flush=True)
        _run(label, cmd)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rounds = [json.loads(line) for line in f]
        with open(os.path.join(out, "summary.json")) as f:
            results[label] = {"rounds": rounds, "summary": json.load(f)}
    return results


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


def table(results: dict) -> str:
    targets = next(iter(results.values()))["summary"]["rounds_to_target"]
    head = ["method", "round-1 GA", "best GA", "final GA", "best LA"] + [f"rounds to GA {t}" for t in targets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, res in results.items():
        s = res["summary"]
        reach = [str(s["rounds_to_target"][t]) if s["rounds_to_target"][t] else "-" for t in targets]
        round1 = s["round1_global_accuracy"]  # None: --evaluate_every skipped round 1
        lines.append("| " + " | ".join([label, "-" if round1 is None else f"{round1:.4f}", f"{s['best_global_accuracy']:.4f}",
                                        f"{s['final_global_accuracy']:.4f}", f"{s.get('best_local_accuracy', float('nan')):.4f}"]
                                       + reach) + " |")
    return "\n".join(lines)


def per_round_table(results: dict, metric: str = "global_accuracy", short: str = "GA") -> str:
    """A markdown table of ``metric`` per round, one column ``<label> <short>`` per run that reports it."""
    labels = [label for label, res in results.items() if any(metric in r for r in res["rounds"])]
    n = max(len(results[l]["rounds"]) for l in labels)
    lines = ["| round | " + " | ".join(f"{l} {short}" for l in labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for i in range(n):
        cells = [f"{results[l]['rounds'][i][metric]:.4f}" if i < len(results[l]["rounds"]) else "" for l in labels]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def learning_curves_png(output_dir: str, labels: list[str], path: str) -> str:
    """Writes the GA / LA learning curves of the runs ``OUT/<label>`` as the PNG ``path``; returns it."""
    import matplotlib
    matplotlib.use("Agg")  # a file, whatever $DISPLAY says
    runs = {label: plots.read_run(os.path.join(output_dir, label))["metrics"] for label in labels}
    return plots.save(plots.learning_curves(runs), path)


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flagfile", required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="label:flags (flags space-separated, quoted)")
    parser.add_argument("--output_dir", default="out/compare")
    parser.add_argument("--results_file", default=None, help="Also write the tables as markdown here.")
    parser.add_argument("--title", default="Comparison")
    parser.add_argument("--per_round_metrics", default="", help="Comma-separated metrics of metrics.jsonl (e.g. "
                        "precision_cosine) to tabulate per round too, for the runs that report them.")
    args, extra = parser.parse_known_args(argv)
    if not os.path.exists(args.flagfile):
        raise app.UsageError(f"--flagfile {args.flagfile} does not exist; fix: pass one of experiments/configs/*.flags")
    results = run_all(args.flagfile, args.runs, args.output_dir, extra)
    source = next(iter(results.values()))["summary"]["source"]
    text = (f"## {args.title}\n\nData: {source}. Command:\n\n```\npython -m experiments.compare "
            + shlex.join(sys.argv[1:] if argv is None else argv) + f"\n```\n\n{table(results)}\n\nGA per round:\n\n"
            + per_round_table(results) + "\n")
    if all("local_accuracy" in r for res in results.values() for r in res["rounds"]):
        text += "\nLA per round (the local models before aggregation):\n\n" + per_round_table(
            results, "local_accuracy", "LA") + "\n"
    for metric in filter(None, args.per_round_metrics.split(",")):
        if not any(metric in r for res in results.values() for r in res["rounds"]):
            raise app.UsageError(f"no run reports {metric!r}; fix: name a key of the runs' metrics.jsonl in "
                                 "--per_round_metrics, or add the flag that reports it (e.g. --precision_cosine)")
        text += f"\n{metric} per round:\n\n" + per_round_table(results, metric, metric) + "\n"
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
    learning_curves_png(args.output_dir, list(results), png)
    run_dirs = " ".join(shlex.quote(os.path.join(args.output_dir, label)) for label in results)
    print(f"more figures: python -m experiments.plot {run_dirs}")
    print(f"learning curves (GA solid, LA dashed): {png}", flush=True)


if __name__ == "__main__":
    errors.guard(main)()
