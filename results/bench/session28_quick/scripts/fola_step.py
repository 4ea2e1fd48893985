"""One client's local epoch (MLP 784-200-200-10, 600 procedural samples, B = 50: 12 steps), jitted, for
FedAvg, FOLA and FOLA without its clip or its prior pull; the variants' calls alternate, 60 each.

    taskset -c 0 python results/bench/session28_quick/scripts/fola_step.py fedavg,fola,fola_noclip,fola_noprior
    taskset -c 0 python results/bench/session28_quick/scripts/fola_step.py --profile fola

``--profile``: one variant's XLA operations from a ``jax.profiler`` trace of 20 epochs, in microseconds per
local step (the first layer's kernel is ``f32[784,200]``). FOLA's server precision is 3 everywhere, round 2.
``--fusions``: the loop fusions XLA makes of FOLA's update and Fisher sum written as one jitted function of
two outputs (two: XLA:CPU makes no multi-output fusion of them).
"""
import collections
import glob
import gzip
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import bfedjax as bf
from bfedjax.core.client_half import local_training
from bfedjax.core.types import ClientContext, ClientData

VARIANTS = {"fedavg": ("fedavg", {}), "fola": ("fola", {}), "fola_noclip": ("fola", {"clip_norm": None}),
            "fola_noprior": ("fola", {"prior_grad": False})}
N, B = 600, 50
STEPS = N // B


def epoch_fn(name, fed):
    base, options = VARIANTS[name]
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    algo = bf.algorithms.build(base, model, fed, batch_size=B, lr=0.01, **options).replace(evaluate=None)
    server = algo.server_init(algo.init_params(jax.random.PRNGKey(0), fed.input_shape))
    if base == "fola":
        server = {**server, "precision": jax.tree.map(lambda p: jnp.full_like(p, 3.0), server["precision"])}
    hparams = {"round": jnp.int32(2), **{k: jnp.float32(v) for k, v in algo.hparams.items()}}
    data = ClientData(jnp.asarray(fed.x[0]), jnp.asarray(fed.y[0]), jnp.int32(N))
    fn = jax.jit(lambda server, data, hparams, key: local_training(
        algo, ClientContext(server, (), data, hparams), key, fixed_steps=True)[0])
    args = (server, data, hparams, jax.random.PRNGKey(1))
    jax.block_until_ready(fn(*args))
    return lambda: jax.block_until_ready(fn(*args))


def main(argv):
    if "--fusions" in argv:
        def update_and_fisher(t, g, w, c, fisher, step):
            return t - step * (g + w * (t - c)), fisher + 0.5 * g * g
        arrays = [jnp.full((784, 200), i, jnp.float32) for i in range(5)] + [jnp.float32(0.1)]
        text = jax.jit(update_and_fisher).lower(*arrays).compile().as_text()
        print("fusions:", [line.split("=")[0].strip() for line in text.splitlines() if " fusion(" in line])
        return
    profile = "--profile" in argv
    names = [a for a in argv if not a.startswith("--")][0].split(",")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, N).astype(np.int32)
    fed = bf.data.stack_clients(x, y, [np.arange(N)], x_test=x[:100], y_test=y[:100], num_classes=10, name="p")
    fns = {name: epoch_fn(name, fed) for name in names}
    if profile:
        out = tempfile.mkdtemp()
        with jax.profiler.trace(out):
            for _ in range(20):
                fns[names[0]]()
        events = json.load(gzip.open(glob.glob(out + "/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
        total = collections.Counter()
        for e in events:
            if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(("$", "Thunk", "Pjit", "Common")):
                total[e["name"]] += e["dur"]
        for op, us in total.most_common(20):
            print(f"{names[0]} {op:32s} {us / 20 / STEPS:7.1f} us per step")
        return
    for name, us in alternated(fns, 60).items():
        print(f"{name}: {us:.0f} us per step (median of 60 epochs of {STEPS} steps)")


def alternated(fns: dict, epochs: int) -> dict:
    """``{name: median microseconds a step}`` of the epochs ``fns`` (name -> call), ``epochs`` each, taken in turn."""
    times = {name: [] for name in fns}
    for _ in range(epochs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) / STEPS for name, t in times.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
