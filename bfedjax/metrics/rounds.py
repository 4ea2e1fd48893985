"""Summaries of per-round metric curves (host-side, numpy)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def best_so_far(values: Sequence[float]) -> np.ndarray:
    """Running maximum: entry r is max(values[:r+1]); NaN (a round not evaluated) is skipped."""
    return np.fmax.accumulate(np.asarray(values, dtype=np.float64))


def rounds_to_target(values: Sequence[float], target: float) -> int | None:
    """First round (1-indexed) whose value reaches ``target``; None if never."""
    hits = np.nonzero(np.asarray(values) >= target)[0]
    return int(hits[0]) + 1 if hits.size else None


def rounds_to_fraction(values: Sequence[float], reference_accuracy: float, a: float,
                       initial: float | None = None) -> int | None:
    """FedReg's R_a: the first round whose accuracy reaches ``a * reference_accuracy``.

    ``reference_accuracy`` is SGD's ACC (its best accuracy over rounds) in the same
    experiment. ``values[r - 1]`` is the accuracy after round ``r``; ``initial``
    (the model before round 1) counts as round 0. None if never reached.
    """
    target = a * reference_accuracy
    if initial is not None and initial >= target:
        return 0
    return rounds_to_target(values, target)
