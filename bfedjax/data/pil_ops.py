"""Pillow's 8-bit image operations as batched, jittable JAX functions.

AutoAugment's policies (:mod:`bfedjax.data.autoaugment`) were published as sequences
of Pillow calls. This module re-creates those calls on ``[B, H, W, C]`` int32 batches
holding 0..255, with per-image parameters, so that one call serves a batch whose
images each drew a different strength or direction.

Pillow's own arithmetic decides the results:

- the lookups (``invert``, ``posterize``, ``solarize``, ``equalize``), the grey,
  mean and smoothing images behind ``ImageEnhance``, and the nearest-neighbour
  geometry (``translate``, and ``rotate`` through Pillow's 16.16 fixed-point affine
  loop) are integer arithmetic, so they agree with Pillow bit for bit;
- blends (``ImageEnhance``'s ``Image.blend``) read a table computed exactly as
  Pillow's C code computes them (:func:`blend_table`), and ``autocontrast`` corrects
  the exact integer lookup where Pillow's float64 one falls a level short
  (:func:`autocontrast_corrections`), so they agree too;
- the bicubic ``shear_bicubic`` takes its sample positions from the host in float64
  (:func:`shear_coordinates`), as Pillow computes them, but interpolates in float32
  where Pillow uses float64 and then truncates: an output lands one level off where
  Pillow's value lies within float32's error of a whole number.

Fill colours and every parameter below are in 0..255 pixel levels.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# ITU-R 601-2 luma in Pillow's 16.16 fixed point (libImaging/Convert.c, rgb2l).
_LUMA_WEIGHTS = (19595, 38470, 7471)


# --------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------


def histogram(images: jax.Array) -> jax.Array:
    """Per-image, per-channel histograms: ``[B, H, W, C]`` -> ``[B, C, 256]`` int32."""
    b, h, w, c = images.shape
    slots = images + _channel_offsets(b, c)[:, None, None, :]
    counts = jnp.zeros(b * c * 256, jnp.int32).at[slots.reshape(-1)].add(1)
    return counts.reshape(b, c, 256)


def apply_lut(images: jax.Array, lut: jax.Array) -> jax.Array:
    """``out[b, y, x, c] = lut[b, c, images[b, y, x, c]]``; ``lut`` is ``[B, C, 256]``."""
    b, _, _, c = images.shape
    return lut.reshape(-1)[images + _channel_offsets(b, c)[:, None, None, :]]


def _channel_offsets(b: int, c: int) -> jax.Array:
    return (jnp.arange(b)[:, None] * c + jnp.arange(c)[None, :]) * 256  # [B, C]


def invert(images: jax.Array) -> jax.Array:
    """``ImageOps.invert``: ``255 - v``."""
    return 255 - images


def posterize(images: jax.Array, bits: jax.Array) -> jax.Array:
    """``ImageOps.posterize``: keep the top ``bits [B]`` (1..8) bits of every level."""
    mask = 256 - jnp.left_shift(1, 8 - bits.astype(jnp.int32))  # ~(2**(8-bits) - 1) within 8 bits
    return images & mask[:, None, None, None]


def solarize(images: jax.Array, threshold: jax.Array) -> jax.Array:
    """``ImageOps.solarize``: levels at or above ``threshold [B]`` are inverted."""
    return jnp.where(images < threshold[:, None, None, None], images, 255 - images)


def equalize(images: jax.Array) -> jax.Array:
    """``ImageOps.equalize`` per image and channel (Pillow's integer lookup, bit-exact)."""
    hist = histogram(images)  # [B, C, 256]
    present = hist > 0
    top = 255 - jnp.argmax(present[..., ::-1], axis=-1)  # highest level present [B, C]
    count_top = jnp.take_along_axis(hist, top[..., None], axis=-1)[..., 0]
    step = (hist.sum(-1) - count_top) // 255
    below = jnp.cumsum(hist, axis=-1) - hist  # pixels strictly below each level
    lut = jnp.minimum((step[..., None] // 2 + below) // jnp.maximum(step, 1)[..., None], 255)
    keep = (present.sum(-1) <= 1) | (step == 0)
    return apply_lut(images, jnp.where(keep[..., None], jnp.arange(256), lut))


def autocontrast(images: jax.Array) -> jax.Array:
    """``ImageOps.autocontrast()`` (no cutoff): stretch each channel's levels ``lo..hi`` to 0..255, bit-exact.

    Pillow's lookup is ``int(v * s - lo * s)`` with ``s = 255.0 / (hi - lo)`` in float64: the exact
    ``(255 (v - lo)) // (hi - lo)``, except at some levels where the division is exact and float64
    lands just below the whole number. Those (lo, hi, v) are listed once on the host
    (:func:`autocontrast_corrections`) and subtract one here.
    """
    present = histogram(images) > 0
    lo = jnp.argmax(present, axis=-1)[..., None]  # [B, C, 1]
    hi = (255 - jnp.argmax(present[..., ::-1], axis=-1))[..., None]
    levels = jnp.arange(256)
    exact = jnp.clip(255 * (levels - lo) // jnp.maximum(hi - lo, 1), 0, 255)
    bits = jnp.asarray(_autocontrast_correction_bits())
    query = (lo * 256 + hi) * 256 + levels
    lut = exact - ((bits[query >> 3] >> (query & 7)) & 1).astype(exact.dtype)
    return apply_lut(images, jnp.where(hi <= lo, levels, lut))


@functools.lru_cache(maxsize=1)
def autocontrast_corrections() -> np.ndarray:
    """Sorted keys ``(lo * 256 + hi) * 256 + v`` (int32) where Pillow's float64 autocontrast lookup is one
    below the exact ``(255 (v - lo)) // (hi - lo)`` (12,094 of the levels ``lo <= v <= hi``)."""
    keys = []
    v = np.arange(256)[None, :]
    for lo in range(255):
        hi = np.arange(lo + 1, 256)[:, None]
        scale = 255.0 / (hi - lo)
        pillow = np.trunc(v * scale + -lo * scale)  # Python's ``int(ix * scale + offset)``, offset = -lo * scale
        low = (np.floor_divide(255 * (v - lo), hi - lo) - pillow == 1) & (v >= lo) & (v <= hi)
        rows, cols = np.nonzero(low)
        keys.append((lo * 256 + hi[rows, 0]) * 256 + cols)
    return np.sort(np.concatenate(keys)).astype(np.int32)


@functools.lru_cache(maxsize=1)
def _autocontrast_correction_bits() -> np.ndarray:
    """:func:`autocontrast_corrections` as a bit set over all ``2^24`` keys, packed little-endian: ``[2^21]`` uint8."""
    bits = np.zeros(2 ** 24, np.uint8)
    bits[autocontrast_corrections()] = 1
    return np.packbits(bits, bitorder="little")


# --------------------------------------------------------------------------
# ImageEnhance: blends with a degenerate image
# --------------------------------------------------------------------------


def blend_table(factors: Sequence[float]) -> np.ndarray:
    """``Image.blend(degenerate, image, factor)`` for every pair of levels: ``[F, 256, 256]`` uint8.

    ``table[f, d, v]`` is Pillow's result for degenerate level ``d`` and image level
    ``v``, computed as libImaging/Blend.c does: ``ImagingBlend`` takes the factor as
    a C ``float``, so ``d + factor * (v - d)`` is float32 arithmetic (a separate
    multiply and add, as numpy does it here), truncated, and clipped to 0..255 for
    factors outside [0, 1].
    """
    levels = np.arange(256, dtype=np.float32)
    degenerate, image = levels[:, None], levels[None, :]
    rows = []
    for factor in factors:
        value = degenerate + np.float32(factor) * (image - degenerate)  # float32 throughout
        rows.append(np.trunc(np.clip(value, 0.0, 255.0)).astype(np.uint8))
    return np.stack(rows)


def blend(degenerate: jax.Array, images: jax.Array, rows: jax.Array, table: jax.Array) -> jax.Array:
    """Pillow's blend of ``degenerate`` towards ``images`` with factor row ``rows [B]`` of ``table``.

    Args:
      degenerate: ``[B, H, W, C]`` or broadcastable levels.
      images: ``[B, H, W, C]`` levels.
      rows: ``[B]`` int rows of ``table`` (from :func:`blend_table`).
      table: ``[F, 256, 256]`` uint8.
    """
    index = rows.astype(jnp.int32)[:, None, None, None] * 65536 + degenerate * 256 + images
    return table.reshape(-1)[index].astype(jnp.int32)


def grey(images: jax.Array) -> jax.Array:
    """``image.convert("L")`` of RGB ``[B, H, W, 3]`` -> ``[B, H, W, 1]`` (Pillow's fixed-point luma)."""
    if images.shape[-1] != 3:
        raise ValueError(f"grey levels need RGB images [B, H, W, 3], got shape {images.shape}")
    r, g, b = (images[..., i:i + 1] for i in range(3))
    return (r * _LUMA_WEIGHTS[0] + g * _LUMA_WEIGHTS[1] + b * _LUMA_WEIGHTS[2] + 0x8000) >> 16


def mean_grey(images: jax.Array) -> jax.Array:
    """``ImageEnhance.Contrast``'s level: ``int(mean(grey) + 0.5)`` -> ``[B, 1, 1, 1]``."""
    g = grey(images)
    n = g.shape[1] * g.shape[2]
    return (2 * g.sum(axis=(1, 2, 3), keepdims=True) + n) // (2 * n)


def smooth(images: jax.Array) -> jax.Array:
    """``image.filter(ImageFilter.SMOOTH)``: 3x3 kernel (1 1 1 / 1 5 1 / 1 1 1) / 13, rounded; border kept."""
    padded = jnp.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = images.shape[1:3]
    total = 4 * images
    for dy in range(3):
        for dx in range(3):
            total = total + padded[:, dy:dy + h, dx:dx + w]
    rounded = (2 * total + 13) // 26
    rows = jnp.arange(h)[:, None]
    cols = jnp.arange(w)[None, :]
    interior = ((rows > 0) & (rows < h - 1) & (cols > 0) & (cols < w - 1))[None, :, :, None]
    return jnp.where(interior, rounded, images)


def color(images: jax.Array, rows: jax.Array, table: jax.Array) -> jax.Array:
    """``ImageEnhance.Color(img).enhance(f)``: blend from the grey image."""
    return blend(grey(images), images, rows, table)


def contrast(images: jax.Array, rows: jax.Array, table: jax.Array) -> jax.Array:
    """``ImageEnhance.Contrast(img).enhance(f)``: blend from the mean grey level."""
    return blend(mean_grey(images), images, rows, table)


def brightness(images: jax.Array, rows: jax.Array, table: jax.Array) -> jax.Array:
    """``ImageEnhance.Brightness(img).enhance(f)``: blend from black."""
    return blend(jnp.zeros_like(images), images, rows, table)


def sharpness(images: jax.Array, rows: jax.Array, table: jax.Array) -> jax.Array:
    """``ImageEnhance.Sharpness(img).enhance(f)``: blend from the smoothed image."""
    return blend(smooth(images), images, rows, table)


# --------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------


def _sample(images: jax.Array, ys: jax.Array, xs: jax.Array) -> jax.Array:
    """``images[b, ys, xs]`` for ``ys, xs [B, H', W']`` (clamped into range) -> ``[B, H', W', C]``."""
    h, w = images.shape[1:3]
    batch = jnp.arange(images.shape[0])[:, None, None]
    return images[batch, jnp.clip(ys, 0, h - 1), jnp.clip(xs, 0, w - 1)]


def _filled(images: jax.Array, ys: jax.Array, xs: jax.Array, fill: int) -> jax.Array:
    h, w = images.shape[1:3]
    inside = ((ys >= 0) & (ys < h) & (xs >= 0) & (xs < w))[..., None]
    return jnp.where(inside, _sample(images, ys, xs), fill)


def translate_offset(shift: float) -> int:
    """The whole-pixel source offset of Pillow's nearest ``AFFINE (1, 0, shift, 0, 1, 0)``.

    Output pixel ``x`` reads input ``floor(x + 0.5 + shift) = x + floor(shift + 0.5)``.
    """
    return math.floor(shift + 0.5)


def translate(images: jax.Array, offsets: jax.Array, fill: int = 0) -> jax.Array:
    """Output ``(y, x)`` reads input ``(y + dy, x + dx)``, ``fill`` outside; ``offsets [B, 2]`` = (dx, dy)."""
    h, w = images.shape[1:3]
    offsets = offsets.astype(jnp.int32)
    ys = jnp.arange(h)[None, :, None] + offsets[:, 1, None, None]
    xs = jnp.arange(w)[None, None, :] + offsets[:, 0, None, None]
    return _filled(images, jnp.broadcast_to(ys, (len(offsets), h, w)), jnp.broadcast_to(xs, (len(offsets), h, w)),
                   fill)


def rotate_coefficients(angle: float, width: int, height: int) -> np.ndarray:
    """Pillow's ``Image.rotate(angle)`` (nearest, centre, no expand) as 16.16 fixed-point ``[6]`` int64.

    ``a0..a5`` such that output ``(x, y)`` reads input
    ``((a2 + x*a0 + y*a1) >> 16, (a5 + x*a3 + y*a4) >> 16)``, as libImaging's
    ``affine_fixed`` computes it.
    """
    radians = -math.radians(angle % 360.0)
    a = [round(math.cos(radians), 15), round(math.sin(radians), 15), 0.0,
         round(-math.sin(radians), 15), round(math.cos(radians), 15), 0.0]
    cx, cy = width / 2, height / 2
    a[2] = a[0] * -cx + a[1] * -cy + a[2] + cx
    a[5] = a[3] * -cx + a[4] * -cy + a[5] + cy

    def fix(v: float) -> int:
        return math.floor(v * 65536.0 + 0.5)

    return np.array([fix(a[0]), fix(a[1]), fix(a[2] + a[0] * 0.5 + a[1] * 0.5),
                     fix(a[3]), fix(a[4]), fix(a[5] + a[3] * 0.5 + a[4] * 0.5)], np.int64)


def affine_fixed(images: jax.Array, coefficients: jax.Array, fill: int = 0) -> jax.Array:
    """Nearest-neighbour affine map in 16.16 fixed point, ``coefficients [B, 6]`` from :func:`rotate_coefficients`."""
    b, h, w = images.shape[:3]
    a = coefficients.astype(jnp.int32)[:, :, None, None]
    x = jnp.arange(w)[None, None, :]
    y = jnp.arange(h)[None, :, None]
    xs = (a[:, 2] + x * a[:, 0] + y * a[:, 1]) >> 16
    ys = (a[:, 5] + x * a[:, 3] + y * a[:, 4]) >> 16
    return _filled(images, ys, xs, fill)


def _cubic(v1, v2, v3, v4, d):
    """libImaging's BICUBIC macro (a = -1 cubic convolution) at offset ``d`` past ``v2``."""
    p2 = -v1 + v3
    p3 = 2 * (v1 - v2) + v3 - v4
    p4 = -v1 + v2 - v3 + v4
    return v2 + d * (p2 + d * (p3 + d * p4))


def shear_coordinates(shear: float, axis: str, height: int, width: int) -> np.ndarray:
    """Pillow's sample positions for a bicubic shear, computed in float64 as libImaging does.

    Args:
      shear: the factor ``m``.
      axis: ``"x"``: ``transform(AFFINE, (1, m, 0, 0, 1, 0))``, output ``(x, y)`` samples input
        ``(x + 1/2 + m (y + 1/2), y + 1/2)``; ``"y"``: ``(1, 0, 0, m, 1, 0)``, input
        ``(x + 1/2, y + 1/2 + m (x + 1/2))``.
      height, width: image size.
    Returns:
      ``[3, rows, size]`` float32 along the sheared axis (``rows, size = H, W`` for ``"x"``,
      ``W, H`` for ``"y"``): the first of the four taps plus one (``floor(s - 1/2)``), the
      fraction past it, and 1 where the sample point ``s`` lies inside the image (else the fill).
    """
    if axis not in ("x", "y"):
        raise ValueError(f"axis={axis!r}; fix: 'x' or 'y'")
    rows, size = (height, width) if axis == "x" else (width, height)
    along = np.arange(size, dtype=np.float64)[None, :] + 0.5
    across = np.arange(rows, dtype=np.float64)[:, None] + 0.5
    source = along + float(shear) * across
    start = np.floor(source - 0.5)
    inside = (source >= 0) & (source < size)
    return np.stack([start, source - 0.5 - start, inside]).astype(np.float32)


def shear_bicubic(images: jax.Array, coordinates: jax.Array, axis: str, fill: int = 0) -> jax.Array:
    """Pillow's bicubic shear: ``transform(size, AFFINE, matrix, BICUBIC, fillcolor=fill)``.

    Args:
      images: ``[B, H, W, C]`` levels.
      coordinates: ``[B, 3, rows, size]`` from :func:`shear_coordinates` (per image).
      axis: ``"x"`` or ``"y"``, as there.
      fill: level of outputs whose sample point falls outside the image.
    Returns:
      ``[B, H, W, C]`` int32: libImaging's 4x4 cubic interpolation, taps clamped to the
      border, clipped to 0..255 and truncated. The other axis' sample point lands on
      a pixel centre, where Pillow's cubic reduces to that pixel, so one 4-tap cubic
      along ``axis`` is the same computation; float32 where Pillow uses float64.
    """
    if axis not in ("x", "y"):
        raise ValueError(f"axis={axis!r}; fix: 'x' or 'y'")
    moved = images if axis == "x" else jnp.swapaxes(images, 1, 2)  # shear along the last spatial axis
    size = moved.shape[2]
    start = coordinates[:, 0].astype(jnp.int32)[..., None]  # [B, rows, size, 1]
    d = coordinates[:, 1].astype(jnp.float32)[..., None]
    inside = coordinates[:, 2][..., None] > 0
    values = moved.astype(jnp.float32)
    taps = [jnp.take_along_axis(values, jnp.clip(start + i, 0, size - 1), axis=2) for i in (-1, 0, 1, 2)]
    out = jnp.where(inside, jnp.clip(jnp.floor(_cubic(*taps, d)), 0, 255).astype(jnp.int32), fill)
    return out if axis == "x" else jnp.swapaxes(out, 1, 2)
