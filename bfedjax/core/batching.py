"""Shuffling and batching of a padded client inside jit.

A client holds ``count`` real samples in rows ``[0, count)`` of arrays padded
to ``max_n`` rows. Every epoch draws a permutation that puts the real rows
first in random order; batch ``j`` takes positions ``[j*B, (j+1)*B)`` of it,
and positions ``>= count`` are masked. The random score of row ``i`` depends
only on ``(key, epoch, i)``, so a client padded to any ``max_n`` sees exactly
the batches it would see unpadded.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bfedjax.core.types import Batch, ClientData


def steps_per_epoch(max_n: int, batch_size: int) -> int:
    """Number of batch slots per epoch for a client padded to ``max_n``."""
    return max(1, math.ceil(max_n / batch_size))


def epoch_permutation(key: jax.Array, count: jax.Array, max_n: int, epoch) -> jax.Array:
    """``[max_n]`` int32 permutation: real rows first (random order), then padding."""
    epoch_key = jax.random.fold_in(key, epoch)
    rows = jnp.arange(max_n)
    scores = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(epoch_key, i)))(rows)
    scores = jnp.where(rows < count, scores, 2.0 + rows)  # padding sorts last, in order
    return jnp.argsort(scores).astype(jnp.int32)


def take_batch(data: ClientData, order: jax.Array, j, batch_size: int) -> Batch:
    """Batch ``j`` of an epoch ordered by ``order`` (``[max_n]``); returns a masked ``Batch``.

    x: ``[B, ...]``, y: ``[B]``, mask: ``[B]``.
    """
    max_n = order.shape[0]
    positions = j * batch_size + jnp.arange(batch_size)
    rows = order[jnp.minimum(positions, max_n - 1)]
    mask = (positions < data.count).astype(jnp.float32)
    return Batch(x=data.x[rows], y=data.y[rows], mask=mask)


def batch_is_real(data: ClientData, j, batch_size: int) -> jax.Array:
    """True when batch ``j`` holds at least one real sample."""
    return j * batch_size < data.count


def ordered_pass(fn, carry, data: ClientData, batch_size: int):
    """One pass over the client's real samples in storage order (no shuffling).

    ``fn(carry, batch) -> carry`` is applied to every batch with a real sample;
    all-padding batches leave ``carry`` unchanged. Used for offline Fisher
    passes and evaluation of a client's data.
    """
    max_n = data.y.shape[0]
    order = jnp.arange(max_n, dtype=jnp.int32)

    def body(c, j):
        batch = take_batch(data, order, j, batch_size)
        new = fn(c, batch)
        keep = batch_is_real(data, j, batch_size)
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, c), None

    carry, _ = jax.lax.scan(body, carry, jnp.arange(steps_per_epoch(max_n, batch_size)))
    return carry
