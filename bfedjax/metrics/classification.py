"""Classification metrics computed inside jit, in fixed-size test batches."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bfedjax.losses import cross_entropy


def padded_batches(x, y, batch_size: int):
    """Reshapes ``x [T, ...]``, ``y [T, ...]`` to ``[nb, b, ...]`` plus a ``[nb, b]`` mask."""
    t = y.shape[0]
    b = min(batch_size, t)
    nb = math.ceil(t / b)
    pad = nb * b - t
    xp = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
    yp = jnp.concatenate([y, jnp.zeros((pad,) + y.shape[1:], y.dtype)]) if pad else y
    mask = (jnp.arange(nb * b) < t).astype(jnp.float32)
    return xp.reshape((nb, b) + x.shape[1:]), yp.reshape((nb, b) + y.shape[1:]), mask.reshape(nb, b)


def evaluate(apply_fn, params, x, y, batch_size: int = 1000, mask=None) -> dict:
    """``{"accuracy", "loss"}``: top-1 accuracy and mean cross-entropy of ``params`` on ``x [T, ...]``, ``y [T]``.

    ``mask [T]`` (optional, 1 real / 0 padding) restricts both to the real examples
    (a padded per-client test split); with no real example both are 0.
    """
    xb, yb, mb = padded_batches(x, y, batch_size)
    if mask is not None:
        mb = mb * padded_batches(jnp.zeros_like(y), jnp.asarray(mask, jnp.float32), batch_size)[1]

    def one(args):
        xi, yi, mi = args
        logits = apply_fn(params, xi)
        correct = jnp.sum((jnp.argmax(logits, -1) == yi) * mi)
        loss = jnp.sum(cross_entropy(logits, yi) * mi)
        return correct, loss

    correct, loss = jax.lax.map(one, (xb, yb, mb))
    t = y.shape[0] if mask is None else jnp.maximum(jnp.sum(mask), 1.0)
    return {"accuracy": jnp.sum(correct) / t, "loss": jnp.sum(loss) / t}


def accuracy(logits, labels):
    """Top-1 accuracy of ``logits [T, K]`` against ``labels [T]``."""
    return jnp.mean(jnp.argmax(logits, -1) == labels)
