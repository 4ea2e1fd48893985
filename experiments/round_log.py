"""Where ``experiments.run`` sends each round's record: metrics.jsonl, the console, TensorBoard.

* ``metrics.jsonl``: one JSON record per round (``json.dumps`` of ``simulate``'s record). A resumed run keeps
  the interrupted run's records of the rounds before its first one (those the checkpoint restored, unless
  the kill fell between a round's checkpoint and its record) and drops the later ones it will redo; after
  the last round the file is rewritten from ``simulate``'s whole history.
* The console: exactly one plain line per round (``format_line(record)``) when stdout is not a terminal
  (logs, CI, pipes); on a terminal the same lines above a tqdm progress bar with an ETA and the round's
  key numbers (GA, LA, loss, ...) as its postfix. A resumed run first says which round it resumes at, or
  that every round was restored.
* TensorBoard (``tensorboard=True``): tensorboardX event files in ``<output_dir>/tensorboard/``, every
  numeric round metric as a scalar at step = round, and :meth:`RoundLog.final`'s numbers as ``final/<name>``.
  A resumed run appends a new event file whose ``purge_step`` is its first round, so TensorBoard hides any
  steps >= that round an interrupted earlier process had logged: every step appears once.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Callable, Mapping, TextIO

TENSORBOARD_DIR = "tensorboard"
# The record's key numbers shown in the progress bar's postfix, with their short names.
POSTFIX = (("global_accuracy", "GA"), ("local_accuracy", "LA"), ("client_test_accuracy", "CA"),
           ("global_dice", "Dice"), ("global_loss", "loss"))


def numeric_items(record: Mapping) -> dict[str, float]:
    """The record's numbers (bools, the ``round`` key and NaN, a metric ``--evaluate_every`` skipped, left out)
    as floats."""
    return {k: float(v) for k, v in record.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def round_line(record) -> str:
    """One progress line: the global model's scores (GA, LA, CA; segmentation: Dice, IoU, HD95); LA only where the
    clients' local models were evaluated."""
    end = f"loss {record['global_loss']:.4f}  {record['seconds']:.2f}s"
    if "global_dice" in record:
        return (f"round {record['round']:4d}  Dice {record['global_dice']:.4f}  IoU {record['global_iou']:.4f}  "
                f"HD95 {record['global_hd95']:.2f}  {end}")
    la = record.get("local_accuracy", float("nan"))
    la = f"  LA {la:.4f}" if la == la else ""  # not evaluated (--evaluate_local=false, or a skipped round)
    ca = f"  CA {record['client_test_accuracy']:.4f}" if "client_test_accuracy" in record else ""
    dropped = f"  ({int(record['nonfinite_clients'])} non-finite clients left out)" if record.get(
        "nonfinite_clients") else ""
    return f"round {record['round']:4d}  GA {record['global_accuracy']:.4f}{la}{ca}  {end}{dropped}"


class RoundLog:
    """A ``simulate(on_round=...)`` callback writing each record to metrics.jsonl, the console and TensorBoard.

    Args:
      output_dir: the run folder (metrics.jsonl and ``tensorboard/`` go there).
      rounds: the run's total rounds R (the progress bar's length).
      format_line: record -> the round's one console line.
      tensorboard: also write TensorBoard event files.
      stream: the console (default ``sys.stdout``); a progress bar only when ``stream.isatty()``.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, output_dir: str, rounds: int, format_line: Callable[[Mapping], str], *,
                 tensorboard: bool = False, stream: TextIO | None = None):
        self.output_dir, self.rounds, self.format_line = output_dir, rounds, format_line
        self.stream = stream or sys.stdout
        self.tensorboard = tensorboard
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self._sink = None  # opened at the first record, which says how many earlier records to keep
        self._bar = None
        self._writer = None
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, record: Mapping) -> None:
        if self._sink is None:
            first = int(record["round"])
            if first > 1:  # simulate restored the rounds before it
                restored = "round 1" if first == 2 else f"rounds 1-{first - 1}"
                self._say(f"resuming at round {first}: {restored} restored from the last checkpoint")
            self._sink = self._open_sink(first_round=first)
        self._sink.write(json.dumps(record) + "\n")
        self._sink.flush()
        self._to_console(record)
        if self.tensorboard:
            writer = self._tensorboard_writer(purge_step=int(record["round"]))
            for name, value in numeric_items(record).items():
                writer.add_scalar(name, value, global_step=int(record["round"]))
            writer.flush()

    def _say(self, restored: str) -> None:
        """One console line about the rounds restored from a checkpoint, and how to start over instead."""
        print(f"{restored} (--noresume starts over)", file=self.stream, flush=True)

    def _open_sink(self, first_round: int) -> TextIO:
        """metrics.jsonl for appending, holding only the records already there of rounds before ``first_round``
        (a resumed run's restored rounds; a half-written last line of a killed run is dropped). The kept
        records replace the file in one rename, so a kill here loses none of them."""
        kept = []
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as old:
                for line in old:
                    try:
                        earlier = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(earlier, dict) and isinstance(earlier.get("round"), int) and (
                            earlier["round"] < first_round):
                        kept.append(line if line.endswith("\n") else line + "\n")
        partial = self.metrics_path + ".partial"
        with open(partial, "w") as out:
            out.writelines(kept)
        os.replace(partial, self.metrics_path)
        return open(self.metrics_path, "a")

    def _to_console(self, record: Mapping) -> None:
        line = self.format_line(record)
        if not self._interactive:
            print(line, file=self.stream, flush=True)
            return
        bar = self._progress_bar(int(record["round"]))
        if bar is None:  # no tqdm: plain lines
            print(line, file=self.stream, flush=True)
            return
        bar.write(line, file=self.stream)
        if bar.n < int(record["round"]):
            bar.update(int(record["round"]) - bar.n)
        bar.set_postfix({short: f"{record[key]:.4f}" for key, short in POSTFIX
                         if isinstance(record.get(key), float) and math.isfinite(record[key])})

    def _progress_bar(self, round_index: int):
        """The tqdm bar, started at the first round this process ran (its ETA leaves compilation out)."""
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                return None
            self._bar = tqdm(total=self.rounds, initial=round_index, unit="round", file=self.stream,
                             dynamic_ncols=True)
        return self._bar

    def _tensorboard_writer(self, purge_step: int | None):
        """The event writer, made on first use. ``purge_step``: the first round this process logs; TensorBoard
        then drops steps >= it from older event files (an interrupted run's rounds after its last checkpoint)."""
        if self._writer is None:
            from tensorboardX import SummaryWriter
            suffix = f".from_round_{purge_step}" if purge_step is not None else ".final"  # apart from older files
            self._writer = SummaryWriter(os.path.join(self.output_dir, TENSORBOARD_DIR), purge_step=purge_step,
                                         filename_suffix=suffix)
        return self._writer

    def final(self, numbers: Mapping[str, float], step: int) -> None:
        """Logs the final predictive's scalar ``numbers`` as ``final/<name>`` at ``step`` (the last round)."""
        if not self.tensorboard:
            return
        writer = self._tensorboard_writer(purge_step=None)  # all rounds restored: purge none of them
        for name, value in numeric_items(numbers).items():
            writer.add_scalar(f"final/{name}", value, global_step=step)
        writer.flush()

    def end_rounds(self, metrics: Mapping[str, list]) -> None:
        """After the last round: closes the progress bar and rewrites metrics.jsonl from ``simulate``'s columns
        ``metrics`` (rounds restored from a checkpoint included), one record per round."""
        if self._sink is None and metrics.get("round"):  # every round restored: this process trained none
            self._say(f"all {len(metrics['round'])} rounds restored from the last checkpoint: nothing left to train")
        self._close_bar()
        if self._sink is not None:
            self._sink.close()
        with open(self.metrics_path, "w") as sink:
            for r in range(len(metrics["round"])):
                sink.write(json.dumps({k: v[r] for k, v in metrics.items()}) + "\n")

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self._close_bar()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._sink is not None:
            self._sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
