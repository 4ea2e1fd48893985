"""Checks of loaded data: labels in ``[0, num_classes)`` and finite inputs, with counts in one-line messages.

Two callers, two policies:

* :func:`bfedjax.data.load` (files from disk, TFDS, generators) calls :func:`check_dataset`: a label out of
  range or a NaN/Inf pixel means a corrupt or mismatched file, so it raises ``ValueError`` unless the caller
  passes ``allow_nonfinite=True``, which turns the non-finite check into a :class:`NonFiniteInputsWarning`
  with the same counts (``experiments.run --allow_nonfinite_inputs``). Labels out of range always raise:
  no algorithm can train on them (one-hot of label 12 among 10 classes is all zeros).
* :func:`bfedjax.data.stack_clients` checks labels only. Non-finite inputs are allowed there on purpose:
  simulating a poisoned client (a client whose data hold NaN) is how the engine's tolerance of non-finite
  clients is exercised, so a library user who builds such a federation by hand must be able to.
"""
from __future__ import annotations

import warnings

import numpy as np

__all__ = ["NonFiniteInputsWarning", "check_dataset", "check_labels", "label_problem", "nonfinite_problem"]


class NonFiniteInputsWarning(UserWarning):
    """Loaded inputs hold NaN or Inf (issued instead of a ValueError with ``allow_nonfinite=True``)."""


def _rows(rows: np.ndarray, limit: int = 5) -> str:
    """``"row 4"`` / ``"rows 4, 9"`` / ``"rows 4, 9, 11, 20, 31, ..."`` (the first ``limit`` rows)."""
    shown = ", ".join(str(int(r)) for r in rows[:limit]) + (", ..." if len(rows) > limit else "")
    return f"row{'s' if len(rows) > 1 else ''} {shown}"


def label_problem(y, num_classes: int, split: str) -> str | None:
    """What is wrong with labels ``y`` (``[n]`` class ids or ``[n, H, W]`` masks), or None if all are in range.

    E.g. ``"3 training labels outside [0, 10) (e.g. 12 at row 5)"``; the row is the first offending sample.
    """
    y = np.asarray(y)
    if y.size == 0:
        return None
    if not np.issubdtype(y.dtype, np.number) or (np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all()):
        return f"{split} labels are not finite numbers (dtype {y.dtype})"
    bad = (y < 0) | (y >= num_classes) | (y != np.floor(y))
    count = int(bad.sum())
    if count == 0:
        return None
    per_row = bad.reshape(len(y), -1).any(axis=1)
    row = int(np.argmax(per_row))
    value = y.reshape(len(y), -1)[row][bad.reshape(len(y), -1)[row]][0]
    value = int(value) if float(value).is_integer() else float(value)
    noun = "labels" if y.ndim == 1 else f"mask pixels (in {int(per_row.sum())} masks)"
    return f"{count} {split} {noun} outside [0, {num_classes}) (e.g. {value} at row {row})"


def nonfinite_problem(x, split: str) -> str | None:
    """``"12 non-finite pixels in 2 training images (rows 4, 9)"`` for inputs ``x [n, ...]``, or None."""
    x = np.asarray(x)
    if x.size == 0 or not np.issubdtype(x.dtype, np.floating):
        return None
    bad = ~np.isfinite(x.reshape(len(x), -1))
    count = int(bad.sum())
    if count == 0:
        return None
    rows = np.flatnonzero(bad.any(axis=1))
    images = "image" if len(rows) == 1 else "images"
    return f"{count} non-finite pixels in {len(rows)} {split} {images} ({_rows(rows)})"


def check_labels(y, num_classes: int, *, name: str, split: str, fix: str) -> None:
    """Raises a one-line ``ValueError`` ``"<name>: <label_problem>; fix: <fix>"`` if a label is out of range."""
    problem = label_problem(y, num_classes, split)
    if problem:
        raise ValueError(f"{name}: {problem}; fix: {fix}")


def check_dataset(dataset, *, allow_nonfinite: bool = False) -> None:
    """Checks a loaded :class:`~bfedjax.data.Dataset`: labels in range, then finite inputs (both splits).

    Raises:
      ValueError: one line naming the data set, the split and the counts, ending in ``fix: ...``; for
        non-finite inputs only when ``allow_nonfinite`` is False (else a :class:`NonFiniteInputsWarning`).
    """
    k = dataset.num_classes
    for split, y in (("training", dataset.y_train), ("test", dataset.y_test)):
        check_labels(y, k, name=dataset.name, split=split,
                     fix=f"re-fetch the label files (they must hold class ids 0..{k - 1} and belong to the images)")
    for split, x in (("training", dataset.x_train), ("test", dataset.x_test)):
        problem = nonfinite_problem(x, split)
        if problem is None:
            continue
        message = f"{dataset.name}: {problem}"
        if allow_nonfinite:
            warnings.warn(f"{message}; kept (allow_nonfinite=True)", NonFiniteInputsWarning, stacklevel=3)
        else:
            raise ValueError(f"{message}; fix: re-fetch or clean the files, or pass allow_nonfinite=True "
                             "(experiments.run: --allow_nonfinite_inputs) to keep them")
