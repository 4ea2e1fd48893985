"""Compile and round time (CPU) of the variational ResNet-20 round (BFL, K = 10, B = 32, ``ctime.resnet20_round``)
with and without scanned residual blocks; from the repository root,
``python results/bench/session31_scanned_blocks/scripts/scan_probe.py VARIANT [ROUNDS]``:

``unscanned``  ``ResNet20(scan_blocks=False)``: nine residual blocks, each compiled;
``scanned``    ``ResNet20(scan_blocks=True)``: each stage's shape-keeping blocks as one ``nn.scan`` stack (five
               distinct blocks compiled).

Prints tracing, lowering and XLA's time, the optimised HLO's lines and fusions, and the median of ROUNDS
rounds (default 5) after the first (none with ROUNDS 0). ``scanned`` needs the library with
``scanned_blocks.patch`` applied (``PYTHONPATH`` at such a tree)."""
import statistics
import sys
import time

sys.path.insert(0, "results/bench/gpu_h200_session16/scripts")
import jax  # noqa: E402

import bfedjax as bf  # noqa: E402
from bfedjax.core.layout import random_bits_lowering  # noqa: E402
from ctime import resnet20_round, timed_compile  # noqa: E402


def main(variant, rounds=5):
    model = bf.models.ResNet20(10, scan_blocks={"unscanned": False, "scanned": True}[variant])
    _, step, state, arrays, hparams = resnet20_round(model)
    with random_bits_lowering():
        compiled, trace_s, lower_s, xla_s = timed_compile(step, state, arrays, jax.random.PRNGKey(0), hparams)
    text = compiled.as_text().splitlines()
    times = []
    for r in range(rounds + 1 if rounds else 0):
        start = time.perf_counter()
        state, metrics = compiled(state, arrays, jax.random.PRNGKey(r), hparams)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    rounds_text = f" round median {statistics.median(times[1:]):.3f}s" if rounds else ""
    print(f"{variant}: trace {trace_s:.2f}s lower {lower_s:.2f}s xla {xla_s:.2f}s hlo_lines {len(text)} "
          f"fusions {sum(' fusion(' in line for line in text)}{rounds_text}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
