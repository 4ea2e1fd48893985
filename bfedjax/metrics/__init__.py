"""Metrics: accuracy / loss inside jit, uncertainty of MC predictives, and round-curve summaries."""
from bfedjax.metrics import uncertainty
from bfedjax.metrics.classification import accuracy, evaluate
from bfedjax.metrics.rounds import best_so_far, rounds_to_fraction, rounds_to_target

__all__ = ["accuracy", "evaluate", "best_so_far", "rounds_to_fraction", "rounds_to_target", "uncertainty"]
