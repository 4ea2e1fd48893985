"""Per-round learning-rate schedules (``round -> lr``) for ``simulate(hparams_fn=...)``.

The learning rate is a traced hyper-parameter of the round, so a schedule
never recompiles. Fischer et al. keep the rate for a silent period of 50
rounds and then decay it "by a factor of .04 every round"; the spec
reads this as ``lr * exp(-0.04 (r - 50))`` and offers the alternatives below.
"""
from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("constant", "exponential", "geometric", "literal")


def lr_schedule(name: str, lr: float, *, start: int = 50, rate: float = 0.04) -> Callable[[int], float]:
    """``round (from 1) -> learning rate``; constant up to round ``start``, then

    * ``exponential``: ``lr * exp(-rate * (r - start))`` (the spec's reading, the default);
    * ``geometric``: ``lr * (1 - rate) ** (r - start)``;
    * ``literal``: ``lr * rate ** (r - start)`` (the paper's words; stalls training);
    * ``constant``: ``lr`` throughout.
    """
    if name not in SCHEDULES:
        raise ValueError(f"lr schedule {name!r}; choose one of {SCHEDULES}")
    if name != "constant" and not 0 < rate < 1:
        raise ValueError(f"lr decay rate={rate} must be in (0, 1), e.g. 0.04")
    decay = {"constant": lambda k: 1.0, "exponential": lambda k: math.exp(-rate * k),
             "geometric": lambda k: (1.0 - rate) ** k, "literal": lambda k: rate ** k}[name]
    return lambda r: lr * decay(max(0, r - start))


__all__ = ["SCHEDULES", "lr_schedule"]
