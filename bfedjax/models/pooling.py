"""Non-overlapping max-pooling for the zoo's models (as a reshape, which a client vmap batches cheaply)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def max_pool(x: jax.Array, size: int) -> jax.Array:
    """``[B, H, W, C] -> [B, H // size, W // size, C]``: the max over each ``size x size`` window (floor, VALID)."""
    b, h, w, c = x.shape
    x = x[:, :h // size * size, :w // size * size, :].reshape(b, h // size, size, w // size, size, c)
    return jnp.max(x, axis=(2, 4))


__all__ = ["max_pool"]
