"""Random draws of any shape, generated flat and reshaped: the same numbers, compiled faster on XLA:CPU.

JAX's threefry bits for ``shape`` (its default keys, partitionable or not) are the hash of each element's
row-major index, so ``prod(shape)`` values drawn flat and reshaped are bitwise the draw of ``shape``
(``tests/test_flat_random.py``). XLA:CPU compiles the hash over a multi-dimensional shape, such as a
client-vmapped 3x3 kernel ``[K, 3, 3, C_in, C_out]``, into a loop nest that LLVM takes seconds to compile,
the same hash over one dimension in a fraction of that: one vmapped ``[10, 3, 3, 64, 64]`` normal compiled in
2.29 s shaped and 0.26 s flat, at the same speed (``results/bench/session31_scanned_blocks/README.md``). Every
draw the library's own code makes inside a round goes through here (NumPyro's Normal samples through
``vi.flat_normal.FlatDrawNormal``; Flax's dropout masks stay Flax's). (With another PRNG implementation, such as
``rbg``, the flat draw is a different, equally valid stream.)
"""
from __future__ import annotations

import math

import jax


def _flat(shape) -> tuple[int]:
    return (math.prod(shape),)


def normal(key, shape, dtype=float) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)``, drawn flat."""
    return jax.random.normal(key, _flat(shape), dtype).reshape(shape)


def rademacher(key, shape, dtype=int) -> jax.Array:
    """``jax.random.rademacher(key, shape, dtype)`` (+-1), drawn flat."""
    return jax.random.rademacher(key, _flat(shape), dtype).reshape(shape)


__all__ = ["normal", "rademacher"]
