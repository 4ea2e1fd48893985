"""Compile of the variational ResNet-20 round (BFL, K = 10, B = 32, ``ctime.resnet20_round``) or of its server
half alone (``Algorithm.aggregate`` jitted on 10 stacked copies of the server state), with the optimised HLO's
size; ``round`` also runs 1 round (``--rounds=N``: N). Session 28, on the 2-core CPU:

    python results/bench/gpu_h200_session16/scripts/resnet_compile_split.py round
    python results/bench/gpu_h200_session16/scripts/resnet_compile_split.py server

and ``round`` again in a tree with ``optax_flatten.patch`` applied (the comparison in ``next_call.sh``).
"""
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from ctime import resnet20_round, timed_compile  # noqa: E402


def main(argv):
    what = argv[0]
    rounds = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--rounds=")), 1))
    algo, step, state, arrays, hparams = resnet20_round()
    if what == "round":
        fn, args = step, (state, arrays, jax.random.PRNGKey(0), hparams)
    else:
        messages = jax.tree.map(lambda x: jnp.stack([x] * 10), state.server)
        fn = jax.jit(lambda server, messages, hparams: algo.aggregate(
            server, messages, jnp.full((10,), 0.1), jnp.ones((10,)), {**hparams, "cohort_weight": jnp.float32(1)},
            jax.random.PRNGKey(0)))
        args = (state.server, messages, hparams)
    compiled, trace_s, lower_s, xla_s = timed_compile(fn, *args)
    text = compiled.as_text().splitlines()
    round_s = []
    if what == "round":
        state = args[0]
        for r in range(rounds):
            start = time.perf_counter()
            state, _ = compiled(state, arrays, jax.random.PRNGKey(r), hparams)
            jax.block_until_ready(state)
            round_s.append(round(time.perf_counter() - start, 2))
    print(f"{what}: trace {trace_s:.2f}s lower {lower_s:.2f}s xla {xla_s:.2f}s hlo_lines {len(text)} "
          f"fusions {sum(' fusion(' in line for line in text)} rounds_s {round_s}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
