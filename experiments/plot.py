r"""Turns run folders (``experiments.run --output_dir``) into PNGs.

    python -m experiments.plot out/demo/fedavg out/demo/fola --output_dir=out/demo/plots

Draws, each only when the runs hold the data: GA (solid) and LA (dashed) learning curves of all runs
(``learning_curves.png``), the posterior scale per round (``posterior_scale.png``: FOLA's
``precision_median``, bfl's ``mean_posterior_scale``, hbfl's ``mean_global_scale``), and from each run's
``evaluation.json`` the accuracy on the most certain fraction of the test set, one panel per
uncertainty the points were ranked by (``accuracy_vs_retained.png``: entropy, aleatoric, epistemic), one reliability diagram per run (``reliability.png``) and, with
``--client_test_splits``, each client's accuracy (``per_client_accuracy.png``). Prints each PNG's path.
The default ``--output_dir`` is ``plots/`` in the runs' common parent folder (one run: in the run folder).
A folder that is not a run folder stops with one line naming the fix (``experiments.errors``).
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

from absl import app, flags

from bfedjax import plots
from experiments import errors

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Where the PNGs go (default: plots/ in the runs' common parent folder).")

# Per-round posterior-scale metrics of the Bayesian algorithms (the first a run has is drawn).
SCALE_METRICS = ("precision_median", "mean_posterior_scale", "mean_global_scale", "mean_meme_scale")


def run_names(run_dirs: Sequence[str]) -> list[str]:
    """Each folder's name, or its path as given where two folders share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, run_dirs)]


def default_output_dir(run_dirs: Sequence[str]) -> str:
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "plots")
    return os.path.join(os.path.commonpath([os.path.abspath(d) for d in run_dirs]), "plots")


def make_plots(runs: Mapping[str, dict], output_dir: str) -> list[str]:
    """Writes the PNGs of ``runs`` (name -> ``plots.read_run``) into ``output_dir``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")  # files only, whatever $DISPLAY says
    import matplotlib.pyplot as plt

    written = []
    columns = {name: run["metrics"] for name, run in runs.items()}
    curves = [m for m in ("global_accuracy", "local_accuracy") if any(m in c for c in columns.values())]
    if curves:
        written.append(plots.save(plots.learning_curves(columns, curves),
                                  os.path.join(output_dir, "learning_curves.png")))
    scales = [m for m in SCALE_METRICS if any(m in c for c in columns.values())]
    if scales:
        written.append(plots.save(plots.posterior_scale(columns, scales),
                                  os.path.join(output_dir, "posterior_scale.png")))
    evaluations = {name: run["evaluation"] for name, run in runs.items() if run["evaluation"]}
    panels = plots.retained_panels({name: e["accuracy_vs_retained"] for name, e in evaluations.items()
                                    if "accuracy_vs_retained" in e})
    if panels is not None:  # one panel per uncertainty the points were ranked by
        written.append(plots.save(panels, os.path.join(output_dir, "accuracy_vs_retained.png")))
    reliability = {name: e["reliability"] for name, e in evaluations.items() if "reliability" in e}
    if reliability:
        cols = min(len(reliability), 3)
        fig, axes = plt.subplots(math.ceil(len(reliability) / cols), cols, squeeze=False,
                                 figsize=(4.5 * cols, 4.5 * math.ceil(len(reliability) / cols)))
        for ax, (name, bins) in zip(axes.ravel(), reliability.items()):
            plots.reliability_diagram_from_bins(bins, ax=ax, label=name)
        for ax in axes.ravel()[len(reliability):]:
            ax.set_visible(False)
        written.append(plots.save(fig, os.path.join(output_dir, "reliability.png")))
    per_client = {name: [math.nan if a is None else a for a in e["per_client_accuracy"]["accuracy"]]
                  for name, e in evaluations.items() if "per_client_accuracy" in e}
    if per_client:
        written.append(plots.save(plots.per_client_accuracy(per_client),
                                  os.path.join(output_dir, "per_client_accuracy.png")))
    return written


def main(argv):
    run_dirs = argv[1:]
    if not run_dirs:
        raise app.UsageError("no run folders given; fix: python -m experiments.plot OUT_DIR... with folders written "
                             "by python -m experiments.run --output_dir=OUT_DIR")
    runs = {name: plots.read_run(d) for name, d in zip(run_names(run_dirs), run_dirs)}
    for path in make_plots(runs, FLAGS.output_dir or default_output_dir(run_dirs)):
        print(path)


if __name__ == "__main__":
    errors.run(main)
