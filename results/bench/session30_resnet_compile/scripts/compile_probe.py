"""Compile time (CPU) of the variational ResNet round (BFL, K = 10, B = 32, ``ctime.resnet20_round``), for diagnosis
only; from the repository root, ``python results/bench/session30_resnet_compile/scripts/compile_probe.py VARIANT``:

``head``       the round as the library builds it;
``stubbed``    with the finite check (every client finite), the zeroing of non-finite rows and the
               keep-if-nobody-counts select replaced by no-ops: the robustness layer's per-leaf passes that this
               round (full participation, one vmap) runs;
``blocks=K``   with ``ResNet20(blocks_per_stage=K)`` (3K residual blocks; ResNet-20 is K = 3), and for ``K = 0`` an
               MLP (hidden 200-200) on the same 32x32x3 images;
``unscanned``, ``scanned`` (session 31) ``ResNet20(scan_blocks=False / True)``: each stage's shape-keeping
               blocks as one ``nn.scan`` stack or not; needs the library with
               ``session31_scanned_blocks/scanned_blocks.patch`` applied (``PYTHONPATH`` at such a tree).

``... compile_probe.py VARIANT ROUNDS`` also runs ROUNDS rounds after a first and prints their median.
Prints tracing, lowering and XLA's time and the optimised HLO's lines and fusions."""
import statistics
import sys
import time

sys.path.insert(0, "results/bench/gpu_h200_session16/scripts")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bfedjax as bf  # noqa: E402
import bfedjax.core.engine as engine  # noqa: E402
import bfedjax.core.server_half as server_half  # noqa: E402
from bfedjax.core.layout import random_bits_lowering  # noqa: E402
from ctime import resnet20_round, timed_compile  # noqa: E402


def model_and_label(variant):
    if variant in ("head", "stubbed"):
        return None, variant
    if variant in ("unscanned", "scanned"):
        return bf.models.ResNet20(10, scan_blocks=variant == "scanned"), variant
    k = int(variant.split("=", 1)[1])
    model = bf.models.ResNet20(10, blocks_per_stage=k) if k > 0 else bf.models.get_model("mlp", 10, hidden=(200, 200))
    return model, f"blocks_per_stage={k} ({3 * k} blocks)"


def main(variant, rounds=0):
    if variant == "stubbed":
        engine.finite_rows = lambda tree, slots: jnp.ones((slots,), bool)  # the name _vmapped_round calls
        server_half.zero_rows = lambda tree, keep: tree
        server_half._kept_if_nobody_counts = lambda new, old, weights, mask: new
    model, label = model_and_label(variant)
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
    print(f"{label}: trace {trace_s:.2f}s lower {lower_s:.2f}s xla {xla_s:.2f}s hlo_lines {len(text)} "
          f"fusions {sum(' fusion(' in line for line in text)}{rounds_text}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
