"""One client's local epoch (MLP 784-200-200-10, ``N`` procedural samples, B = 50), jitted, for several
variants whose calls alternate (200 epochs each); prints each variant's median microseconds a local step.

    taskset -c 0 python results/bench/session29_fola_floor/scripts/step_ab.py 600 fedavg:fedavg fola:fola \\
        noprior:fola_noprior noclip:fola_noclip
    PROF=1 taskset -c 0 python ... step_ab.py 600 fola:fola     # also: each variant's XLA operations

A variant is ``label:name[:ENV=1,ENV=1]``: ``name`` one of session 28's ``fola_step.VARIANTS`` (fedavg, fola,
fola_noclip, fola_noprior), the environment variables set while it is traced. Those variables select
the experiments of ``first_step_peel.patch`` (apply it first with ``git apply``):

    BFED_PEEL=1     the engine takes each client's first local step outside its step loop
    BFED_MASK=1     ... and keeps the initial state where that step is not real (padding, no budget)
    BFED_NOFIRST=1  ... without telling the step it is the first (so FOLA still computes its prior's pull,
                    which is zero there: the weights are the prior's centre)
    BFED_MAT=1      FOLA's total gradient (the batch gradient plus the prior's pull) materialised once,
                    behind an optimisation barrier, for the clip norm and the update to read
"""
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "session28_quick", "scripts"))
import fola_step  # noqa: E402  (session 28's variants, epoch function and alternation)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bfedjax as bf  # noqa: E402


def main(argv):
    fola_step.N = int(argv[0])
    fola_step.STEPS = fola_step.N // fola_step.B
    rng = np.random.default_rng(0)
    x = rng.normal(size=(fola_step.N, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, fola_step.N).astype(np.int32)
    fed = bf.data.stack_clients(x, y, [np.arange(fola_step.N)], x_test=x[:100], y_test=y[:100], num_classes=10,
                                name="p")
    fns = {}
    for spec in argv[1:]:
        label, variant, envs = (spec.split(":") + [""])[:3]
        saved = dict(os.environ)
        os.environ.update(kv.split("=") for kv in filter(None, envs.split(",")))
        fns[label] = fola_step.epoch_fn(variant, fed)  # traced and compiled here, under these variables
        os.environ.clear()
        os.environ.update(saved)
    for name, us in fola_step.alternated(fns, 200).items():
        print(f"{name:18s} {us:6.0f} us per step ({fola_step.STEPS} steps)")
    if os.environ.get("PROF"):
        for label, fn in fns.items():
            for op, us in profile(fn, 40).most_common(16)[1:]:  # the first is the whole loop
                print(f"{label:18s} {op:32s} {us / fola_step.STEPS:7.1f} us per step")


def profile(fn, calls: int) -> collections.Counter:
    """``{XLA operation: microseconds per call}`` of ``calls`` calls of ``fn`` under ``jax.profiler``."""
    out = tempfile.mkdtemp()
    with jax.profiler.trace(out):
        for _ in range(calls):
            fn()
    events = json.load(gzip.open(glob.glob(out + "/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(("$", "Thunk", "Pjit", "Common")):
            total[e["name"]] += e["dur"] / calls
    return total


if __name__ == "__main__":
    main(sys.argv[1:])
