"""Mini-batch augmentation inside the jitted round (Fischer et al.'s CIFAR-10 shifts and flips).

``random_shift_flip`` shifts every image by a random whole number of pixels
(up to ``max_shift`` of its height and width, the Keras ``width_shift_range`` /
``height_shift_range`` of 0.1, about 3 px on 32x32), filling the border with the
nearest edge pixel, and mirrors it left-right with probability 1/2.
``augmented(algorithm, fn)`` makes any algorithm augment each local batch with
a key split from that step's key, so augmentation works for every client type
(SGD, variational, FedReg) without touching its training step.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from bfedjax.core.types import Algorithm

AugmentFn = Callable[[jax.Array, jax.Array], jax.Array]  # (x [B, H, W, C], key) -> x'


def random_shift_flip(x: jax.Array, key: jax.Array, *, max_shift: float = 0.1, flip: bool = True) -> jax.Array:
    """Randomly shifted (edge fill) and, with ``flip``, half the time mirrored images.

    Args:
      x: ``[B, H, W, C]`` images.
      key: PRNG key.
      max_shift: largest shift as a fraction of H and W (rounded to whole pixels).
      flip: mirror along W with probability 1/2 per image.
    Returns:
      ``[B, H, W, C]``.
    """
    if x.ndim != 4:
        raise ValueError(f"shift/flip augmentation needs image batches [B, H, W, C], got shape {x.shape}; "
                         "fix: --augment=none for flat inputs")
    b, h, w, c = x.shape
    dh, dw = round(max_shift * h), round(max_shift * w)
    k_y, k_x, k_flip = jax.random.split(key, 3)
    shift_y = jax.random.randint(k_y, (b,), -dh, dh + 1)
    shift_x = jax.random.randint(k_x, (b,), -dw, dw + 1)
    padded = jnp.pad(x, ((0, 0), (dh, dh), (dw, dw), (0, 0)), mode="edge")

    def crop(image, sy, sx):  # output pixel (i, j) = input pixel (i - sy, j - sx), clamped to the edge
        return jax.lax.dynamic_slice(image, (dh - sy, dw - sx, 0), (h, w, c))

    out = jax.vmap(crop)(padded, shift_y, shift_x)
    if flip:
        mirror = jax.random.bernoulli(k_flip, 0.5, (b,))
        out = jnp.where(mirror[:, None, None, None], out[:, :, ::-1], out)
    return out


AUGMENTATIONS = {"none": None, "shift_flip": random_shift_flip}


def augmented(algorithm: Algorithm, augment: AugmentFn) -> Algorithm:
    """``algorithm`` whose every local step first augments ``batch.x`` (padded rows stay masked)."""
    inner_step = algorithm.client_step

    def client_step(local, batch, ctx, key):
        k_augment, k_step = jax.random.split(key)
        return inner_step(local, batch._replace(x=augment(batch.x, k_augment)), ctx, k_step)

    return algorithm.replace(client_step=client_step)
