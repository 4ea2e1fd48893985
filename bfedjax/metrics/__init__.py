"""Metrics: accuracy / loss inside jit, uncertainty of MC predictives, round-curve summaries, segmentation and
forgetting.

``bfedjax.metrics.segmentation`` (Dice, IoU, HD95, the FedRef authors' soft metrics) loads on first use:
it needs optax, which the core pieces of the library do not. ``bfedjax.metrics.forgetting`` (FedReg's
forgetting gap across rounds) loads on first use too: it imports the engine (``bfedjax.core``), which
imports this package.
"""
import importlib

from bfedjax.metrics import uncertainty
from bfedjax.metrics.classification import accuracy, evaluate, predictive_evaluate
from bfedjax.metrics.rounds import best_so_far, rounds_to_fraction, rounds_to_target


def __getattr__(name):
    if name in ("forgetting", "segmentation"):
        return importlib.import_module(f"bfedjax.metrics.{name}")
    raise AttributeError(f"module 'bfedjax.metrics' has no attribute {name!r}")


__all__ = ["accuracy", "evaluate", "predictive_evaluate", "best_so_far", "forgetting", "rounds_to_fraction", "rounds_to_target",
           "segmentation", "uncertainty"]
