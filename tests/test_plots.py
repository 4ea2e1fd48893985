"""bfedjax.plots draws what it is given; experiments.run writes what the plots need (evaluation.json, TensorBoard
scalars, one line per round off a terminal); experiments.plot turns a run folder into PNGs."""
import contextlib
import glob
import io
import json
import os
import pathlib
import struct
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from bfedjax import plots  # noqa: E402
from bfedjax.metrics import uncertainty  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--dataset=digits", "--num_clients=2", "--hidden=8", "--batch_size=32", "--lr=0.1", "--max_train=200",
        "--max_test=100", "--algorithm=fola", "--client_test_splits", "--tensorboard", "--test_samples=1"]


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 1000


def test_learning_curves_and_posterior_scale_draw_the_given_columns():
    runs = {"a": {"round": [1, 2, 3], "global_accuracy": [0.1, 0.5, 0.7], "local_accuracy": [0.2, 0.4, 0.6],
                  "precision_median": [1.0, 10.0, 100.0]},
            "b": {"round": [1, 2], "global_accuracy": [0.3, 0.35]}}  # no LA: skipped
    ax = plots.learning_curves(runs).axes[0]
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle())
             for line in ax.lines}
    assert drawn == {"a GA": ([1, 2, 3], [0.1, 0.5, 0.7], "-"), "a LA": ([1, 2, 3], [0.2, 0.4, 0.6], "--"),
                     "b GA": ([1, 2], [0.3, 0.35], "-")}
    assert ax.lines[0].get_color() == ax.lines[1].get_color() != ax.lines[2].get_color()  # one colour per run
    ax = plots.posterior_scale(runs).axes[0]
    assert ax.get_yscale() == "log" and [line.get_label() for line in ax.lines] == ["a precision_median"]
    assert list(ax.lines[0].get_ydata()) == [1.0, 10.0, 100.0]
    plt.close("all")


def test_reliability_bars_are_the_per_bin_accuracies_and_the_ece_is_the_metrics():
    rng = np.random.default_rng(0)
    p_bar = rng.dirichlet(np.full(4, 0.7), size=300).astype(np.float32)
    labels = rng.integers(0, 4, size=300)
    bins = 10
    conf, correct = p_bar.max(-1), p_bar.argmax(-1) == labels
    which = np.digitize(conf, np.linspace(0, 1, bins + 1)[1:-1], right=True)  # bin b holds (b/B, (b+1)/B]
    expected = [correct[which == b].mean() if np.any(which == b) else 0.0 for b in range(bins)]
    ax = plots.reliability_diagram(p_bar, labels, num_bins=bins, label="m").axes[0]
    np.testing.assert_allclose([bar.get_height() for bar in ax.patches], expected, atol=1e-6)
    np.testing.assert_allclose([bar.get_x() for bar in ax.patches], np.arange(bins) / bins)
    ece = float(uncertainty.expected_calibration_error(p_bar, labels, bins))
    independent = sum(np.mean(which == b) * abs(expected[b] - conf[which == b].mean())
                      for b in range(bins) if np.any(which == b))
    assert ece == pytest.approx(independent, abs=1e-5)
    assert f"ECE {ece:.3f}" in ax.get_legend().get_texts()[1].get_text()
    assert list(ax.lines[0].get_xdata()) == [0, 1] == list(ax.lines[0].get_ydata())  # the diagonal
    plt.close("all")


def test_retention_and_per_client_plots_and_save(tmp_path):
    fig = plots.accuracy_vs_retained({"fola": ([0.5, 1.0], [0.9, 0.8]), "fedavg": ([0.5, 1.0], [0.85, 0.8])})
    assert [(list(l.get_xdata()), list(l.get_ydata())) for l in fig.axes[0].lines] == [
        ([0.5, 1.0], [0.9, 0.8]), ([0.5, 1.0], [0.85, 0.8])]
    path = plots.save(fig, str(tmp_path / "new" / "retained.png"))
    assert _is_png(path) and fig.number not in plt.get_fignums()  # written and closed
    ax = plots.per_client_accuracy({"fola": [0.9, 0.5, float("nan"), 0.7]}).axes[0]
    dots, mean = ax.lines
    assert list(dots.get_ydata()) == [0.5, 0.7, 0.9] and list(dots.get_xdata()) == [1, 2, 3]
    assert mean.get_ydata()[0] == pytest.approx(0.7) and "mean 0.700" in mean.get_label()
    plt.close("all")


def test_a_folder_that_is_no_run_gets_one_line_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="is not a run folder .*fix: pass folders written by python -m experiments.run"):
        plots.read_run(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "experiments.plot", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"error: {tmp_path} is not a run folder (no metrics.jsonl); fix: pass folders written by python -m "
        "experiments.run --output_dir=DIR"]


def test_bfedjax_plots_imports_matplotlib_only_when_drawing():
    code = "import bfedjax as bf, sys; bf.plots.read_run; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def _event_scalars(logdir) -> dict:
    """tag -> [(step, value)] over every event file of ``logdir`` (TFRecord frames checked with their CRCs)."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    scalars = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data, pos = pathlib.Path(path).read_bytes(), 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
            payload = data[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(payload)
            pos += 16 + length
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny FOLA run through experiments.run in-process: 1 round, then resumed to 2 (stdout captured)."""
    from experiments import run
    out = tmp_path_factory.mktemp("run")
    printed = []
    for rounds in (1, 2):
        stdout = io.StringIO()  # not a terminal: plain lines
        run.parse(["run", *TINY, f"--rounds={rounds}", f"--output_dir={out}"])
        with contextlib.redirect_stdout(stdout):
            run.main(["run"])
        printed.append(stdout.getvalue())
    return out, printed


def test_run_prints_one_line_per_round_and_writes_the_plot_data(run_dir):
    from experiments.round_log import round_line
    out, printed = run_dir
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for text, record in zip(printed, records):  # the resumed run prints round 2 only
        assert [l for l in text.splitlines() if l.startswith("round")] == [round_line(record)]
    run = plots.read_run(str(out))
    assert run["metrics"]["global_accuracy"] == [r["global_accuracy"] for r in records]
    assert len(run["metrics"]["precision_median"]) == 2  # FOLA's posterior scale per round
    evaluation, unc = run["evaluation"], run["summary"]["uncertainty"]
    rel = evaluation["reliability"]
    assert sum(rel["count"]) == evaluation["num_test"] == 100 and rel["ece"] == pytest.approx(unc["ece"])
    assert plots._ece(rel) == pytest.approx(unc["ece"], abs=1e-5)
    retained = evaluation["accuracy_vs_retained"]
    assert retained["fractions"][-1] == 1.0 and sorted(retained["accuracy"]) == ["aleatoric", "entropy"]  # M = 1
    for curve in retained["accuracy"].values():  # every ranking keeps all points at fraction 1
        assert curve[-1] == pytest.approx(unc["accuracy"])
    per_client = evaluation["per_client_accuracy"]
    assert len(per_client["accuracy"]) == 2 == len(per_client["test_counts"])
    assert sum(per_client["test_counts"]) > 0 and all(0 <= a <= 1 for a in per_client["accuracy"])


def test_per_client_accuracy_scores_each_clients_own_padded_split():
    """experiments.run's per-client accuracy of a predictive on the real rows of padded test splits [N=3, t=4]."""
    import types
    from experiments import run
    y = np.array([[0, 1, 0, 0], [1, 0, 0, 0], [2, 2, 2, 2]])  # client 0: 3 rows, client 1: 2, client 2: none
    predicted = np.array([0, 1, 2, 1, 1])  # the 5 real rows in order
    probs = np.stack([np.eye(3)[predicted], np.eye(3)[predicted] * 0.5 + 0.5 / 3])  # [M=2, 5, 3]
    fed = types.SimpleNamespace(y_test_clients=y, test_counts=np.array([3, 2, 0]))
    assert run.per_client_accuracy(probs, fed) == [pytest.approx(2 / 3), pytest.approx(0.5), None]


def test_tensorboard_scalars_equal_the_jsonl_once_per_step_after_a_resume(run_dir):
    out, _ = run_dir
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = _event_scalars(out / "tensorboard")
    assert len(glob.glob(str(out / "tensorboard" / "events.*"))) == 2  # the resumed run appended its own file
    for name in ("global_accuracy", "local_accuracy", "global_loss", "precision_median", "client_test_accuracy"):
        assert [step for step, _ in scalars[name]] == [1, 2], name
        np.testing.assert_allclose([v for _, v in scalars[name]], [r[name] for r in records], rtol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert [s for s, _ in scalars["final/ece"]] == [1, 2]  # each process's final predictive, at its last round
    assert scalars["final/ece"][-1][1] == pytest.approx(summary["uncertainty"]["ece"], rel=1e-6)


def test_progress_bar_on_a_terminal(tmp_path):
    from experiments.round_log import RoundLog

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    with RoundLog(str(tmp_path), 3, lambda r: f"round {r['round']}", stream=screen) as log:
        for r in (2, 3):  # resumed after round 1
            log({"round": r, "global_accuracy": 0.5 + r / 10, "global_loss": 1.0})
        log.end_rounds({"round": [1, 2, 3], "global_accuracy": [0.5, 0.7, 0.8], "global_loss": [1.0] * 3})
    text = screen.getvalue()
    assert "round 2\n" in text and "round 3\n" in text and "3/3" in text and "GA=0.8000" in text
    assert [json.loads(l)["round"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_resumed_round_log_keeps_the_restored_rounds_records(tmp_path):
    """A run resumed after round 2 keeps the interrupted run's records of rounds 1-2 while it runs (not only
    after its last round), and drops its round 3 and a half-written line: it redoes them."""
    from experiments.round_log import RoundLog
    old = [json.dumps({"round": r, "global_accuracy": r / 10}) for r in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(old) + '\n{"round": 4, "glob')
    rounds = lambda: [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    screen = io.StringIO()
    with RoundLog(str(tmp_path), 5, lambda r: f"round {r['round']}", stream=screen) as log:
        log({"round": 3, "global_accuracy": 0.35})
        assert rounds() == [{"round": 1, "global_accuracy": 0.1}, {"round": 2, "global_accuracy": 0.2},
                            {"round": 3, "global_accuracy": 0.35}]
    assert screen.getvalue().splitlines() == [
        "resuming at round 3: rounds 1-2 restored from the last checkpoint (--noresume starts over)", "round 3"]
    one = tmp_path / "one"
    one.mkdir()
    (one / "metrics.jsonl").write_text(old[0] + "\n")
    screen = io.StringIO()
    with RoundLog(str(one), 5, lambda r: f"round {r['round']}", stream=screen) as log:
        log({"round": 2, "global_accuracy": 0.25})
    assert screen.getvalue().splitlines()[0] == (
        "resuming at round 2: round 1 restored from the last checkpoint (--noresume starts over)")
    screen = io.StringIO()
    with RoundLog(str(tmp_path), 5, lambda r: f"round {r['round']}", stream=screen):
        pass  # a run resumed with every round done records nothing: the file stays as it was
    assert [r["round"] for r in rounds()] == [1, 2, 3] and screen.getvalue() == ""
    with RoundLog(str(tmp_path), 3, lambda r: f"round {r['round']}", stream=screen) as log:
        log.end_rounds({"round": [1, 2, 3], "global_accuracy": [0.1, 0.2, 0.35]})  # and says so
    assert screen.getvalue() == ("all 3 rounds restored from the last checkpoint: nothing left to train "
                                 "(--noresume starts over)\n")
    with RoundLog(str(tmp_path), 5, lambda r: f"round {r['round']}", stream=io.StringIO()) as log:
        log({"round": 1, "global_accuracy": 0.5})  # started over (--noresume): nothing earlier is kept
    assert rounds() == [{"round": 1, "global_accuracy": 0.5}]


def test_plot_cli_turns_the_run_folder_into_pngs(run_dir, tmp_path):
    out, _ = run_dir
    result = subprocess.run([sys.executable, "-m", "experiments.plot", str(out), f"--output_dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    names = ["learning_curves", "posterior_scale", "accuracy_vs_retained", "reliability", "per_client_accuracy"]
    assert result.stdout.split() == [str(tmp_path / f"{name}.png") for name in names]
    assert all(_is_png(tmp_path / f"{name}.png") for name in names)


def test_retained_data_gets_a_panel_per_ranking_and_reads_single_curve_folders():
    """One accuracy-vs-retained panel per ranking an evaluation.json holds; a folder written before the rankings
    (one list, ranked by entropy) joins the entropy panel."""
    assert tuple(plots.RANKING_TITLES) == uncertainty.RANKINGS
    curves = {"entropy": [0.9, 0.8], "aleatoric": [0.95, 0.8], "epistemic": [0.85, 0.8]}
    fig = plots.retained_panels({"new": {"fractions": [0.5, 1.0], "accuracy": curves},
                                 "old": {"fractions": [0.5, 1.0], "accuracy": [0.7, 0.6]}})
    assert [ax.get_title() for ax in fig.axes] == [f"Accuracy vs retained data (by {plots.RANKING_TITLES[r]})"
                                                   for r in ("entropy", "aleatoric", "epistemic")]
    assert [len(ax.lines) for ax in fig.axes] == [2, 1, 1]
    np.testing.assert_allclose(fig.axes[1].lines[0].get_ydata(), [0.95, 0.8])
    assert plots.retained_panels({}) is None
    plt.close(fig)
