"""Compile time (CPU) of a client-vmapped kernel-shaped normal draw, drawn in its shape or flat and reshaped
(``bfedjax.flat_random``); from the repository root,
``env -u JAX_COMPILATION_CACHE_DIR python results/bench/session31_scanned_blocks/scripts/flat_draw_compile.py``.
Each variant is lowered and compiled twice in turn (the second compile of each is served from JAX's in-memory
cache), then timed over 20 calls; the last line says whether the two draws are bitwise equal."""
import math
import time

import jax

SHAPE = (3, 3, 64, 64)
KEYS = jax.random.split(jax.random.PRNGKey(0), 10)
VARIANTS = {"shaped": jax.jit(jax.vmap(lambda k: jax.random.normal(k, SHAPE))),
            "flat": jax.jit(jax.vmap(lambda k: jax.random.normal(k, (math.prod(SHAPE),)).reshape(SHAPE)))}

for name in ("shaped", "flat", "shaped", "flat"):
    lowered = VARIANTS[name].lower(KEYS)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    compiled(KEYS).block_until_ready()
    start = time.perf_counter()
    for _ in range(20):
        compiled(KEYS).block_until_ready()
    print(f"{name}: compile {compile_s:.2f} s, run {1e3 * (time.perf_counter() - start) / 20:.2f} ms", flush=True)
print("bitwise equal:", bool((VARIANTS["shaped"](KEYS) == VARIANTS["flat"](KEYS)).all()))
