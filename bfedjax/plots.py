"""Figures of federated runs: learning curves, calibration, retention, posterior scale, per-client accuracy.

    import bfedjax as bf
    runs = {name: bf.plots.read_run(f"out/demo/{name}") for name in ("fedavg", "fola")}
    fig = bf.plots.learning_curves({name: run["metrics"] for name, run in runs.items()})
    bf.plots.save(fig, "out/demo/learning_curves.png")

Every function draws on ``ax`` when given (and returns its figure), otherwise on a new pyplot figure,
so figures show in notebooks; :func:`save` writes a PNG and closes the figure. matplotlib is imported
on first use (the ``plots`` extra), never by ``import bfedjax``. The binary ``experiments/plot.py``
turns run folders (``experiments.run --output_dir``) into PNGs with these functions.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from bfedjax.optional import require

# Short legend names of the usual round metrics.
SHORT_NAMES = {"global_accuracy": "GA", "local_accuracy": "LA", "client_test_accuracy": "CA",
               "global_loss": "global loss", "local_loss": "local loss"}
METRICS_FILE, SUMMARY_FILE, EVALUATION_FILE = "metrics.jsonl", "summary.json", "evaluation.json"


def _axes(ax, figsize=(6.4, 4.2)):
    """``ax``, or the axes of a new pyplot figure."""
    if ax is not None:
        return ax
    require("matplotlib")
    import matplotlib.pyplot as plt
    return plt.figure(figsize=figsize).add_subplot()


def _titled(ax, title: str, grid_which: str = "major"):
    """Title, a light grid, and a legend when something is plotted; returns the figure."""
    ax.set_title(title)
    ax.grid(alpha=0.3, which=grid_which)
    if ax.lines:
        ax.legend(fontsize="small")
    return ax.figure


def _integer_x(ax) -> None:
    """Whole-number ticks on the x axis (rounds, client ranks)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def learning_curves(runs: Mapping[str, Mapping[str, Sequence[float]]],
                    metrics: Sequence[str] = ("global_accuracy", "local_accuracy"), ax=None, *,
                    title: str | None = None):
    """One line per run and metric against the round: the first metric solid, the second dashed, ...

    Args:
      runs: run name -> columns (``SimulationResult.metrics``, or ``read_run(d)["metrics"]``): a
        ``"round"`` column ``[R]`` and the metrics' columns ``[R]``. A metric a run lacks is skipped.
      metrics: the columns to draw (default GA and LA).
      ax: axes to draw on (default: a new figure).
    Returns the figure.
    """
    ax = _axes(ax)
    styles = ("-", "--", ":", "-.")
    for i, (name, columns) in enumerate(runs.items()):
        for j, metric in enumerate(metrics):
            if metric not in columns:
                continue
            ax.plot(columns["round"], columns[metric], linestyle=styles[j % len(styles)], color=f"C{i % 10}",
                    label=f"{name} {SHORT_NAMES.get(metric, metric)}")
    ax.set_xlabel("round")
    _integer_x(ax)
    ax.set_ylabel(" / ".join(SHORT_NAMES.get(m, m) for m in metrics))
    return _titled(ax, title or "Learning curves (" + ", ".join(
        f"{SHORT_NAMES.get(m, m)} {s}" for m, s in zip(metrics, ("solid", "dashed", "dotted", "dash-dot"))) + ")")


def reliability_diagram(p_bar, labels, num_bins: int = 15, ax=None, label: str | None = None):
    """Accuracy per confidence bin of a predictive, against the diagonal; the ECE in the legend.

    Args:
      p_bar: ``[n, K]`` predictive class probabilities.
      labels: ``[n]`` integer labels.
      num_bins: equal-width confidence bins, as ``metrics.uncertainty.expected_calibration_error``.
    Returns the figure (:func:`reliability_diagram_from_bins` of ``calibration_bins``).
    """
    from bfedjax.metrics import uncertainty
    bins = uncertainty.calibration_bins(np.asarray(p_bar), np.asarray(labels), num_bins)
    return reliability_diagram_from_bins({k: np.asarray(v).tolist() for k, v in bins.items()}, ax=ax, label=label)


def _ece(bins: Mapping[str, Sequence[float]]) -> float:
    count = np.asarray(bins["count"], float)
    return float(np.sum(count * np.abs(np.asarray(bins["accuracy"]) - np.asarray(bins["confidence"])))
                 / max(count.sum(), 1.0))


def reliability_diagram_from_bins(bins: Mapping[str, Sequence[float]], ax=None, label: str | None = None):
    """The reliability diagram of precomputed bins (``metrics.uncertainty.calibration_bins``, or the
    ``"reliability"`` entry of a run's ``evaluation.json``).

    Args:
      bins: ``count [B]``, ``confidence [B]`` and ``accuracy [B]`` (per-bin means, 0 when empty); bin
        ``b`` covers confidences ``(b / B, (b + 1) / B]``.
    Returns the figure: one bar per bin of height ``accuracy[b]``, the diagonal, ECE in the legend.
    """
    ax = _axes(ax, figsize=(4.8, 4.8))
    accuracy = np.asarray(bins["accuracy"], float)
    b = len(accuracy)
    edges = np.arange(b) / b
    ece = _ece(bins)
    name = f"{label}: " if label else ""
    ax.bar(edges, accuracy, width=1.0 / b, align="edge", edgecolor="black", alpha=0.7,
           label=f"{name}accuracy per bin (ECE {ece:.3f})")
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (max predicted probability)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Reliability{' of ' + label if label else ''}")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: bars fill the axes
    return ax.figure


def accuracy_vs_retained(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], ax=None,
                         ranking: str = "predictive entropy"):
    """Accuracy on the most certain fraction of the test set against that fraction, one line per run.

    Args:
      curves: name -> (retained fractions ``[F]``, accuracies ``[F]``), as
        ``metrics.uncertainty.accuracy_vs_retained`` gives them for its ``fractions``.
      ranking: the uncertainty the points were ranked by (the title says it).
    Returns the figure.
    """
    ax = _axes(ax)
    for i, (name, (fractions, accuracies)) in enumerate(curves.items()):
        ax.plot(fractions, accuracies, marker="o", markersize=3, color=f"C{i % 10}", label=name)
    ax.set_xlabel("fraction of the test set retained (most certain first)")
    ax.set_ylabel("accuracy")
    return _titled(ax, f"Accuracy vs retained data (by {ranking})")


# The rankings of ``metrics.uncertainty.RANKINGS``, in its order, as the panels' titles name them.
RANKING_TITLES = {"entropy": "predictive entropy", "aleatoric": "aleatoric uncertainty",
                  "epistemic": "epistemic uncertainty"}


def retained_panels(retained: Mapping[str, Mapping[str, Any]]):
    """One accuracy-vs-retained panel per ranking that any run holds (entropy, aleatoric, epistemic).

    Args:
      retained: run name -> its evaluation.json's ``accuracy_vs_retained``: ``fractions [F]`` and
        ``accuracy`` ``{ranking: [F]}`` (a plain list ``[F]``, as folders written before 2026-12-02 hold,
        is the entropy ranking).
    Returns the figure, or None when no run holds a curve.
    """
    by_run = {name: (e["fractions"], e["accuracy"] if isinstance(e["accuracy"], Mapping)
                     else {"entropy": e["accuracy"]}) for name, e in retained.items()}
    rankings = [r for r in RANKING_TITLES if any(r in curves for _, curves in by_run.values())]
    if not rankings:
        return None
    require("matplotlib")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(rankings), squeeze=False, figsize=(5 * len(rankings), 4))
    for ax, ranking in zip(axes[0], rankings):
        accuracy_vs_retained({name: (fractions, curves[ranking]) for name, (fractions, curves) in by_run.items()
                              if ranking in curves}, ax=ax, ranking=RANKING_TITLES[ranking])
    return fig


def posterior_scale(runs: Mapping[str, Mapping[str, Sequence[float]]],
                    metrics: Sequence[str] = ("precision_median",), ax=None):
    """A per-round posterior-scale metric of each run on a log axis (e.g. FOLA's ``precision_median``,
    bfl's ``mean_posterior_scale``, hbfl's ``mean_global_scale``); a metric a run lacks is skipped.

    Args:
      runs: run name -> columns with ``"round" [R]`` (as :func:`learning_curves`).
    Returns the figure.
    """
    ax = _axes(ax)
    styles = ("-", "--", ":", "-.")
    for i, (name, columns) in enumerate(runs.items()):
        for j, metric in enumerate(metrics):
            if metric in columns:
                ax.plot(columns["round"], columns[metric], linestyle=styles[j % len(styles)], color=f"C{i % 10}",
                        label=f"{name} {metric}")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    _integer_x(ax)
    ax.set_ylabel(" / ".join(metrics))
    return _titled(ax, "Posterior scale per round", grid_which="both")


def per_client_accuracy(accuracies: Mapping[str, Sequence[float]], ax=None):
    """Each client's accuracy, sorted, as dots per run, with the run's mean over clients as a line.

    Args:
      accuracies: name -> per-client accuracy ``[N]`` (NaN: a client without test data, left out).
    Returns the figure.
    """
    ax = _axes(ax)
    for i, (name, values) in enumerate(accuracies.items()):
        values = np.asarray(values, float)
        values = np.sort(values[np.isfinite(values)])
        color = f"C{i % 10}"
        ax.plot(np.arange(1, len(values) + 1), values, marker="o", linestyle="", color=color, label=name)
        mean = float(np.mean(values)) if len(values) else math.nan
        ax.axhline(mean, color=color, linestyle="--", linewidth=1, label=f"{name} mean {mean:.3f}")
    ax.set_xlabel("client (sorted by accuracy)")
    _integer_x(ax)
    ax.set_ylabel("accuracy")
    return _titled(ax, "Per-client accuracy")


def save(fig, path: str, dpi: int = 120) -> str:
    """Writes ``fig`` as ``path`` (a PNG for a ``.png`` name), making its folder; closes it; returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    if getattr(fig.canvas, "manager", None) is not None:  # a pyplot figure: release it
        import matplotlib.pyplot as plt
        plt.close(fig)
    return path


def columns(records: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Per-round records (``metrics.jsonl``'s lines) -> columns ``{key: [R]}`` (a key a record lacks: NaN there)."""
    keys = list(dict.fromkeys(k for record in records for k in record))
    return {k: [record.get(k, math.nan) for record in records] for k in keys}


def read_run(run_dir: str) -> dict:
    """Loads a run folder written by ``experiments.run --output_dir=run_dir``.

    Returns ``{"name": the folder's name, "metrics": columns of metrics.jsonl (lists [R], "round" among
    them), "summary": summary.json (``{}`` if absent), "evaluation": evaluation.json, or None}``;
    evaluation.json holds the final predictive's ``reliability`` bins, its ``accuracy_vs_retained``
    curves (``fractions`` [F], ``accuracy``: ``{ranking: [F]}``) and, with per-client test splits, ``per_client_accuracy``.
    A folder without metrics.jsonl raises ``ValueError`` naming the fix.
    """
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        raise ValueError(f"{run_dir} is not a run folder (no {METRICS_FILE}); fix: pass folders written by "
                         "python -m experiments.run --output_dir=DIR")
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ValueError(f"{metrics_path} holds no rounds; fix: let the run finish a round, or pass another folder")
    out = {"name": os.path.basename(os.path.normpath(run_dir)), "metrics": columns(records), "summary": {},
           "evaluation": None}
    for key, name in (("summary", SUMMARY_FILE), ("evaluation", EVALUATION_FILE)):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                out[key] = json.load(f)
    return out


__all__ = ["RANKING_TITLES", "accuracy_vs_retained", "retained_panels", "columns", "learning_curves", "per_client_accuracy", "posterior_scale", "read_run",
           "reliability_diagram", "reliability_diagram_from_bins", "save"]
