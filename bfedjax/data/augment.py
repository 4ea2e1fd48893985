"""Mini-batch augmentation inside the jitted round (CIFAR-10 shifts or crops and flips, AutoAugment).

``random_shift_flip`` (Fischer et al.) shifts every image by a random whole number
of pixels (up to ``max_shift`` of its height and width, the Keras ``width_shift_range``
/ ``height_shift_range`` of 0.1, about 3 px on 32x32), filling the border with the
nearest edge pixel, and mirrors it left-right with probability 1/2.
``random_crop_flip`` (the HBFL spec's CIFAR option) is the usual random crop of the
image padded by ``padding`` pixels on every side (a shift of up to ``padding``
pixels; the fill is 0 by default, the mean pixel of standardised inputs), then the same flip.
``autoaugment_cutout`` (:mod:`bfedjax.data.autoaugment`) is FOLA's Table I on 8-bit RGB levels.
``augmented(algorithm, fn)`` makes any algorithm augment each local batch with
a key split from that step's key, and the data its final pass reads (offline Fisher
passes, reported losses), so augmentation works for every client type (SGD,
variational, FedReg) without touching its training step.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.core.types import Algorithm
from bfedjax.data.autoaugment import autoaugment_cutout

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
    _check_images(x)
    return _shifted(x, key, round(max_shift * x.shape[1]), round(max_shift * x.shape[2]), flip, "edge")


def random_crop_flip(x: jax.Array, key: jax.Array, *, padding: int = 4, flip: bool = True,
                     fill: float = 0) -> jax.Array:
    """Random ``H x W`` crops of the images padded by ``padding`` pixels, half the time mirrored.

    Args:
      x: ``[B, H, W, C]`` images.
      key: PRNG key.
      padding: border of ``fill`` added on every side before cropping (4 on CIFAR's 32x32).
      flip: mirror along W with probability 1/2 per image.
      fill: value of the border (0; FOLA's Table I pads 8-bit levels with grey 128).
    Returns:
      ``[B, H, W, C]``.
    """
    _check_images(x)
    if int(padding) < 0:
        raise ValueError(f"padding={padding} must be >= 0, e.g. 4")
    return _shifted(x, key, int(padding), int(padding), flip, "constant", fill)


def _check_images(x: jax.Array) -> None:
    if x.ndim != 4:
        raise ValueError(f"shift/crop/flip augmentation needs image batches [B, H, W, C], got shape {x.shape}; "
                         "fix: --augment=none for flat inputs")


def _shifted(x: jax.Array, key: jax.Array, dh: int, dw: int, flip: bool, mode: str, fill: float = 0) -> jax.Array:
    """Every image shifted by ``U{-dh..dh} x U{-dw..dw}`` pixels, the border filled by ``jnp.pad``'s ``mode``
    (``fill`` for ``"constant"``)."""
    b, h, w, c = x.shape
    k_y, k_x, k_flip = jax.random.split(key, 3)
    shift_y = jax.random.randint(k_y, (b,), -dh, dh + 1)
    shift_x = jax.random.randint(k_x, (b,), -dw, dw + 1)
    pads = ((0, 0), (dh, dh), (dw, dw), (0, 0))
    padded = jnp.pad(x, pads, mode=mode, constant_values=fill) if mode == "constant" else jnp.pad(x, pads, mode=mode)

    def crop(image, sy, sx):  # output pixel (i, j) = input pixel (i - sy, j - sx), or the fill
        return jax.lax.dynamic_slice(image, (dh - sy, dw - sx, 0), (h, w, c))

    out = jax.vmap(crop)(padded, shift_y, shift_x)
    if flip:
        mirror = jax.random.bernoulli(k_flip, 0.5, (b,))
        out = jnp.where(mirror[:, None, None, None], out[:, :, ::-1], out)
    return out


# name -> (x [B, H, W, C], key) -> x'; entries that take ``pixel_norm`` get the data set's (see ``augmentation``;
# called directly, autoaugment_cutout assumes FOLA's CIFAR-10 standardisation, 0.5 / 0.5).
AUGMENTATIONS = {"none": None, "shift_flip": random_shift_flip, "crop_flip": random_crop_flip,
                 "autoaugment_cutout": autoaugment_cutout}
NEEDS_PIXEL_LEVELS = ("autoaugment_cutout",)


def augmentation(name: str, input_shape: tuple[int, ...], pixel_norm=None) -> AugmentFn | None:
    """The registry's augmentation ``name`` for images of ``input_shape``, checked.

    Args:
      name: a key of :data:`AUGMENTATIONS`.
      input_shape: one input's shape, ``(H, W, C)`` for images.
      pixel_norm: the data set's ``(mean, std)`` (``Dataset.pixel_norm``); needed by
        the augmentations that work on 8-bit levels (``autoaugment_cutout``: FOLA's
        Table I, crop with grey fill, flip, AutoAugment's CIFAR-10 policy, Cutout 16).
    Returns:
      ``(x, key) -> x'`` or None for ``"none"``.
    """
    if name not in AUGMENTATIONS:
        raise ValueError(f"augmentation {name!r} is not one of {sorted(AUGMENTATIONS)}; fix: pick one of those")
    fn = AUGMENTATIONS[name]
    if fn is None:
        return None
    if len(input_shape) != 3:
        raise ValueError(f"--augment={name} needs image data [N, H, W, C]; the inputs have shape "
                         f"{tuple(input_shape)}; fix: --augment=none")
    if name not in NEEDS_PIXEL_LEVELS:
        return fn
    if input_shape[-1] != 3 or pixel_norm is None:
        why = (f"{input_shape[-1]} channel(s)" if input_shape[-1] != 3 else
               "inputs whose 8-bit pixel levels are unknown (the data set has no pixel_norm)")
        raise ValueError(f"--augment={name} runs AutoAugment's Pillow operations on 8-bit RGB levels, but got {why}; "
                         "fix: use it on CIFAR-style RGB data (cifar10, cifar100), or --augment=crop_flip")
    return functools.partial(fn, pixel_norm=pixel_norm)


_FINAL_KEY_SALT = 0x61756766  # folds a client's round key into the key of its final pass's augmentation
_INIT_KEY_SALT = 0x61756769  # ... and into the key of the augmentation its client_init sees


class AugmentedLocal(NamedTuple):
    """An augmented algorithm's local state: the inner algorithm's, and the key of its final pass's augmentation.

    Attribute reads it does not have (``.params``, ``.loss``, ...) go to ``inner``, so wrappers that read the
    inner algorithm's local state (e.g. FedRef's ``loss_report="last_batch"``) work on either side of
    :func:`augmented`.
    """

    inner: Any
    final_key: jax.Array

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _augment_in_batches(augment: AugmentFn, x: jax.Array, key: jax.Array, batch_size: int) -> jax.Array:
    """``augment`` over ``x [n, ...]`` a batch of ``batch_size`` rows at a time (``lax.map``), chunk ``i`` with
    ``jax.random.split(key, chunks)[i]``: the temporaries of one batch, not of the whole set."""
    n = x.shape[0]
    size = max(1, min(batch_size, n))
    chunks = -(-n // size)
    padded = jnp.pad(x, [(0, chunks * size - n)] + [(0, 0)] * (x.ndim - 1))
    out = jax.lax.map(lambda pair: augment(*pair),
                      (padded.reshape((chunks, size) + x.shape[1:]), jax.random.split(key, chunks)))
    return out.reshape((chunks * size,) + x.shape[1:])[:n]


def augmented(algorithm: Algorithm, augment: AugmentFn) -> Algorithm:
    """``algorithm`` whose every local step first augments ``batch.x`` (padded rows stay masked), and whose
    ``client_init`` and ``client_final`` each see the client's data augmented once (a fresh draw each, per round).

    The initial pass reads ``ctx.data`` where an algorithm prepares data before its steps: FedReg builds its
    pseudo and perturbed batches there, from a pass over the authors' augmenting loader (FedReg spec 2.3).

    The final pass reads ``ctx.data``: offline curvature (FOLA's ``fisher="offline"``, FedCurv's
    Fisher), SCAFFOLD option I's control variate, FedRef's client loss (which its server step uses)
    and reported losses. It gets augmented data, as the authors' data loaders, which augment every
    pass, give it, so these algorithms train differently under augmentation than before this was
    added. The data are augmented ``algorithm.batch_size`` rows at a time
    (:func:`_augment_in_batches`) with a key folded from the client's ``client_init`` key, carried in
    the local state (:class:`AugmentedLocal`); the inner algorithm's keys are unchanged. An inner
    ``client_final`` that does not read ``ctx.data.x`` leaves the augmentation unused, and
    ``jax.jit`` drops it.
    """
    inner_init, inner_step, inner_final = algorithm.client_init, algorithm.client_step, algorithm.client_final

    def seen(ctx, key):
        """``ctx`` with the client's data augmented once, ``algorithm.batch_size`` rows at a time."""
        x = _augment_in_batches(augment, ctx.data.x, key, algorithm.batch_size)
        return dataclasses.replace(ctx, data=ctx.data._replace(x=x))

    def client_init(ctx, key):
        # an init that reads no data values (only shapes, as BFL's) leaves the pass unused and jit drops it
        inner = inner_init(seen(ctx, jax.random.fold_in(key, _INIT_KEY_SALT)), key)
        return AugmentedLocal(inner, jax.random.fold_in(key, _FINAL_KEY_SALT))

    def client_step(local, batch, ctx, key):
        k_augment, k_step = jax.random.split(key)
        return local._replace(inner=inner_step(local.inner, batch._replace(x=augment(batch.x, k_augment)), ctx, k_step))

    def client_final(local, ctx):
        return inner_final(local.inner, seen(ctx, local.final_key))

    return algorithm.replace(client_init=client_init, client_step=client_step, client_final=client_final)
