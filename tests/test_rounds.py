"""Round-curve summaries: best so far, rounds to a target, FedReg's R_a."""
import numpy as np

from bfedjax.metrics import best_so_far, rounds_to_fraction, rounds_to_target


def test_best_so_far_and_rounds_to_target():
    curve = [0.2, 0.5, 0.4, 0.7]
    np.testing.assert_array_equal(best_so_far(curve), [0.2, 0.5, 0.5, 0.7])
    assert rounds_to_target(curve, 0.5) == 2
    assert rounds_to_target(curve, 0.71) is None


def test_r_a_is_relative_to_the_reference_accuracy():
    sgd_best = 0.8
    curve = [0.1, 0.35, 0.41, 0.7, 0.79]
    assert rounds_to_fraction(curve, sgd_best, 0.5) == 3      # first >= 0.40
    assert rounds_to_fraction(curve, sgd_best, 0.9) == 5      # first >= 0.72
    assert rounds_to_fraction(curve, sgd_best, 1.0) is None   # never reaches 0.80
    assert rounds_to_fraction(curve, sgd_best, 0.1, initial=0.09) == 0  # the initial model counts as round 0
    assert rounds_to_fraction(curve, sgd_best, 0.5, initial=0.09) == 3
