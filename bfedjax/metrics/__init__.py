"""Metrics: accuracy / loss inside jit, uncertainty of MC predictives, and round-curve summaries."""
from bfedjax.metrics.classification import accuracy, evaluate, evaluate_many
from bfedjax.metrics import uncertainty
from bfedjax.metrics.rounds import best_so_far, rounds_to_fraction, rounds_to_target

__all__ = ["accuracy", "evaluate", "evaluate_many", "best_so_far", "rounds_to_fraction", "rounds_to_target", "uncertainty"]
