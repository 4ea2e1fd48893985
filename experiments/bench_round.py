"""Times one library round configuration: the median of 20 rounds (after two warm-up rounds).

    python -m experiments.bench_round 100:1:fedavg:fedreg_cnn:2 100:1:fola:fola_cnn:4:bfloat16

Each argument is ``K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype]``: K clients of 100
procedural samples each, B = 10, one vmap over the cohort; ``fixed`` 1 takes fixed local steps
(``RoundConfig.fixed_local_steps``), 0 the per-step loop; ``matmul_conv_MiB`` sets this platform's
``models.conv.MATMUL_CONV_MAX_BYTES`` (0: XLA's convolutions only). It prints the compile time and
the median and fastest round in milliseconds. ``experiments.bench`` is the benchmark; this is the
finer tool its layout choices were made with (issue 18, on an H100).
"""
from __future__ import annotations

import statistics
import sys
import time

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
               rounds: int = 20) -> tuple[float, float, float]:
    """``(compile seconds, median round seconds, fastest round seconds)``."""
    import jax
    import bfedjax as bf
    from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
    from bfedjax.core.simulate import round_arrays, traced_hparams
    bf.models.conv.MATMUL_CONV_MAX_BYTES[jax.default_backend()] = int(matmul_conv_mib * 2**20)
    fed = federation(k, SHAPES[model_name])
    model = bf.models.get_model(model_name, 10, hidden=(200, 200), compute_dtype=dtype)
    options = {} if name == "bfl" else {"lr": 0.01}
    algorithm = bf.algorithms.build(name, model, fed, batch_size=10, **options).replace(evaluate=None)
    arrays = round_arrays(fed)
    config = RoundConfig(k, k, evaluate_local=False)
    if fixed:
        config = with_fixed_local_steps(config, arrays)
    params = algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = with_own_buffers(init_state(algorithm, params, config), params)
    start = time.perf_counter()
    step = make_round_step(algorithm, config, "vmap", donate_state=True).lower(
        state, arrays, jax.random.PRNGKey(0), traced_hparams(algorithm, 1)).compile()
    compile_s = time.perf_counter() - start
    times = []
    for r in range(rounds + 2):
        start = time.perf_counter()
        state, metrics = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algorithm, r + 1))
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times[2:]), min(times[2:])


def main(specs: list[str]) -> None:
    if not specs:
        raise SystemExit("give one or more K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype], e.g. "
                         "100:1:fedavg:mlp:0")
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (5, 6):
            raise SystemExit(f"{spec!r}: fix: write K:fixed:algorithm:model:matmul_conv_MiB[:compute_dtype]")
        k, fixed, name, model, mib = int(parts[0]), parts[1] == "1", parts[2], parts[3], float(parts[4])
        dtype = parts[5] if len(parts) == 6 else "float32"
        compile_s, median_s, best_s = time_round(k, fixed, name, model, mib, dtype)
        print(f"{model} K={k} {name} fixed={fixed} matmul_conv={mib:g}MiB {dtype}: compile {compile_s:.1f}s "
              f"median {1e3 * median_s:.2f} ms fastest {1e3 * best_s:.2f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
