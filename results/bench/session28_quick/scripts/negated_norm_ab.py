"""FOLA's epoch (as ``fola_step.py``) with the library's clip norm against a variant whose norm reads the
update's loop-invariant arrays (the pull written ``g - lam * p * (c - t)``, bitwise the update's
``g + lam * p * (t - c)``, and not one expression XLA would share), alternated in one process, 100 epochs each.

    taskset -c 0 python results/bench/session28_quick/scripts/negated_norm_ab.py

The variant is the library's ``algorithms/local_sgd.py`` with one replacement, loaded as a separate module
(tried and not kept in session 28: no faster).
"""
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import fola_step  # noqa: E402

import bfedjax as bf  # noqa: E402
import bfedjax.algorithms.fola as fola_module  # noqa: E402
import bfedjax.algorithms.local_sgd as library  # noqa: E402

EXPANDED = """                weight = jax.tree.map(lambda p: lam * p, precision)
                grad = jax.tree.map(lambda g, w, t, c: (g + w * t) - w * c, grad, weight, params, center)"""
NEGATED = """                grad = jax.tree.map(lambda g, t, c, p: g - lam * p * (c - t), grad, params, center, precision)"""


def negated_module():
    source = open(library.__file__).read()
    assert source.count(EXPANDED) == 1, "local_sgd.py changed: update EXPANDED"
    spec = importlib.util.spec_from_loader("local_sgd_negated", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source.replace(EXPANDED, NEGATED), "local_sgd_negated.py", "exec"), module.__dict__)
    return module


def main():
    n = fola_step.N
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    fed = bf.data.stack_clients(x, y, [np.arange(n)], x_test=x[:100], y_test=y[:100], num_classes=10, name="p")
    fns = {"fola": fola_step.epoch_fn("fola", fed)}
    fola_module.make_sgd_client = negated_module().make_sgd_client
    fns["fola_negated_norm"] = fola_step.epoch_fn("fola", fed)
    fola_module.make_sgd_client = library.make_sgd_client
    fns["fedavg"] = fola_step.epoch_fn("fedavg", fed)
    for name, us in fola_step.alternated(fns, 100).items():
        print(f"{name}: {us:.0f} us per step (median of 100 epochs)")


if __name__ == "__main__":
    main()
