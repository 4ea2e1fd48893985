"""Summaries of per-round metric curves (host-side, numpy)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def best_so_far(values: Sequence[float]) -> np.ndarray:
    """Running maximum: entry r is max(values[:r+1])."""
    return np.maximum.accumulate(np.asarray(values, dtype=np.float64))


def rounds_to_target(values: Sequence[float], target: float) -> int | None:
    """First round (1-indexed) whose value reaches ``target``; None if never."""
    hits = np.nonzero(np.asarray(values) >= target)[0]
    return int(hits[0]) + 1 if hits.size else None
