"""XLA compile time (CPU) of the variational ResNet-20 round (BFL, K = 10, B = 32, ``ctime.resnet20_round``) with the
engine's per-leaf robustness work stubbed out, for diagnosis only: ``python ctime_variant.py head`` or
``python ctime_variant.py stubbed`` from the repository root. ``stubbed`` replaces the finite check (every client
finite), the zeroing of non-finite rows and the keep-if-nobody-counts select by no-ops, the three per-leaf passes
of the round's server half that this round (full participation, one vmap) runs."""
import sys
import time

sys.path.insert(0, "results/bench/gpu_h200_session16/scripts")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bfedjax.core.engine as engine  # noqa: E402
import bfedjax.core.server_half as server_half  # noqa: E402

variant = sys.argv[1]
if variant == "stubbed":
    engine.finite_rows = lambda tree, slots: jnp.ones((slots,), bool)  # the name _vmapped_round calls
    server_half.zero_rows = lambda tree, keep: tree
    server_half._kept_if_nobody_counts = lambda new, old, weights, mask: new
from ctime import resnet20_round  # noqa: E402
from bfedjax.core.layout import random_bits_lowering  # noqa: E402
_, step, state, arrays, hp = resnet20_round()
with random_bits_lowering():
    t0 = time.perf_counter(); traced = step.trace(state, arrays, jax.random.PRNGKey(0), hp)
    t1 = time.perf_counter(); lowered = traced.lower(); t2 = time.perf_counter()
    compiled = lowered.compile(); t3 = time.perf_counter()
text = compiled.as_text().splitlines()
print(f"{variant}: trace {t1-t0:.2f}s lower {t2-t1:.2f}s xla {t3-t2:.2f}s hlo_lines {len(text)} fusions {sum(' fusion(' in l for l in text)}", flush=True)
