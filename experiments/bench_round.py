"""Times one library round configuration: the median of 20 rounds (after a warm-up round).

    python -m experiments.bench_round 100:1:fedavg:fedreg_cnn:2 100:1:fola:fola_cnn:4:bfloat16

Each argument is ``K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype]``: K clients of 100
procedural samples each, B = 10, one vmap over the cohort; ``fixed`` 1 takes fixed local steps
(``RoundConfig.fixed_local_steps``), 0 the per-step loop; ``matmul_conv_MiB`` sets this platform's
``models.conv.MATMUL_CONV_MAX_BYTES`` (0: XLA's convolutions only). It prints the compile time and
the median and fastest round in milliseconds (``--rounds=N`` times N rounds instead of 20); the
compile time splits into JAX's tracing and lowering and XLA's compilation. ``experiments.bench`` is the benchmark; this is the
finer tool its layout choices were made with (issue 18, on an H100).
"""
from __future__ import annotations

import sys

import numpy as np

SHAPES = {"mlp": (28, 28, 1), "fedreg_cnn": (28, 28, 1), "fola_cnn": (32, 32, 3), "resnet20": (32, 32, 3)}


def federation(k: int, shape, n: int = 100):
    import bfedjax as bf
    rng = np.random.default_rng(0)
    x = rng.normal(size=(k * n,) + tuple(shape)).astype(np.float32)
    y = rng.integers(0, 10, k * n).astype(np.int32)
    return bf.data.stack_clients(x, y, [np.arange(i * n, (i + 1) * n) for i in range(k)], x_test=x[:100],
                                 y_test=y[:100], num_classes=10, name="procedural")


def time_round(k: int, fixed: bool, name: str, model_name: str, matmul_conv_mib: float, dtype: str = "float32",
               rounds: int = 20) -> dict:
    """``bench.time_library``'s dict for one configuration: ``trace_s``, ``lower_s``, ``compile_only_s`` (the
    three together), ``median_round_s`` and ``round_s`` (the fastest)."""
    import jax
    import bfedjax as bf
    from experiments.bench import Config, time_library
    bf.models.conv.MATMUL_CONV_MAX_BYTES[jax.default_backend()] = int(matmul_conv_mib * 2**20)
    fed = federation(k, SHAPES[model_name])
    model = bf.models.get_model(model_name, 10, hidden=(200, 200), compute_dtype=dtype)
    options = {} if name == "bfl" else {"lr": 0.01}
    algorithm = bf.algorithms.build(name, model, fed, batch_size=10, **options).replace(evaluate=None)
    return time_library(algorithm, fed, Config("bench_round", "uniform", k, 10), "vmap", rounds, fixed)


def main(args: list[str]) -> None:
    from experiments.bench import time_compilations_afresh
    time_compilations_afresh()
    rounds = [a.split("=", 1)[1] for a in args if a.startswith("--rounds=")]
    specs = [a for a in args if not a.startswith("--rounds=")]
    if rounds and not (rounds[-1].isdigit() and int(rounds[-1]) >= 1):
        raise SystemExit(f"--rounds={rounds[-1]}: fix: a whole number of timed rounds >= 1, e.g. --rounds=3")
    if not specs:
        raise SystemExit("give one or more K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype] (and optionally "
                         "--rounds=N), e.g. 100:1:fedavg:mlp:0")
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (5, 6):
            raise SystemExit(f"{spec!r}: fix: write K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype]")
        k, fixed, name, model, mib = int(parts[0]), parts[1] == "1", parts[2], parts[3], float(parts[4])
        dtype = parts[5] if len(parts) == 6 else "float32"
        t = time_round(k, fixed, name, model, mib, dtype, rounds=int(rounds[-1]) if rounds else 20)
        xla_s = t["compile_only_s"] - t["trace_s"] - t["lower_s"]
        print(f"{model} K={k} {name} fixed={fixed} matmul_conv={mib:g}MiB {dtype}: compile {t['compile_only_s']:.1f}s "
              f"(trace {t['trace_s']:.1f}s, lower {t['lower_s']:.1f}s, XLA {xla_s:.1f}s) "
              f"median {1e3 * t['median_round_s']:.2f} ms fastest {1e3 * t['round_s']:.2f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
