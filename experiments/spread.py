"""What "±" means in the results tables: the sample std over seeds, or a 95% confidence interval.

Fischer et al. never define their "±" (spec decision D12); the default is the
sample standard deviation over runs (ddof = 1) and the option a 95% confidence
interval of the mean, ``t_{0.975, n-1} * s / sqrt(n)`` (Student's t, n runs).
"""
from __future__ import annotations

import math

SPREADS = ("std", "ci95")
LABELS = {"std": "sample std", "ci95": "95% CI half-width of the mean (Student t)"}


def half_width(std: float, n: int, spread: str = "std") -> float:
    """The "±" of ``n`` runs whose sample std is ``std``: ``std`` itself or the 95% CI half-width (0 for one run)."""
    if spread not in SPREADS:
        raise ValueError(f"spread={spread!r}; choose one of {SPREADS}")
    if spread == "std" or n < 2:
        return std if n >= 2 else 0.0
    from scipy import stats
    return float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n))


def mean_pm(values, digits: int = 4, spread: str = "std") -> str:
    """``"mean ± half_width"`` of the runs ``values`` (just the value for one run), ``digits`` decimals."""
    import numpy as np
    values = np.asarray(values, np.float64)
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {half_width(float(values.std(ddof=1)), len(values), spread):.{digits}f}"


__all__ = ["LABELS", "SPREADS", "half_width", "mean_pm"]
