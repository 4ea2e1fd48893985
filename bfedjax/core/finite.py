"""Which clients' rows hold only finite values (``finite_rows``), and those rows kept while the others are
zeroed (``zero_rows``): how a round leaves out a client whose message or new state holds NaN or Inf, on the
client side (the engine's chunks, the Flower client) and the server side (after an attack) alike."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.tree import zero_products_per_row


def finite_rows(tree, slots: int) -> jax.Array:
    """``[C]`` bool: every floating leaf of ``tree`` (leaves ``[C, ...]``) is finite in row ``c``."""
    # x * 0 is 0 where x is finite and NaN where it is not (inf * 0 too), so a row's sum is 0 exactly when the
    # row is finite and cannot overflow; tree.zero_products_per_row reads x once (a matrix-vector product on a
    # CPU, where all(isfinite(x)) is a slow tree reduction of flags: results/bench/reductions.md)
    rows = [zero_products_per_row(x, slots) == 0 for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not rows:
        return jnp.ones((slots,), bool)
    # One count over the stacked [C, L] flags. Chained per-leaf ``&`` (or ``all`` over the stack, which XLA
    # turns back into the chain) was copied into every per-leaf select that reads the result: with a BFL
    # ResNet-20's 214 message leaves a quarter of the compiled round's HLO (``experiments.bench_round``).
    return jnp.sum(jnp.stack(rows, axis=1).astype(jnp.float32), axis=1) == len(rows)


def zero_rows(tree, keep):
    """``tree`` (leaves ``[C, ...]``) with the rows where ``keep [C]`` is False set to 0."""
    return jax.tree.map(lambda m: jnp.where(jnp.reshape(keep, (-1,) + (1,) * (m.ndim - 1)), m, jnp.zeros_like(m)),
                        tree)


__all__ = ["finite_rows", "zero_rows"]
