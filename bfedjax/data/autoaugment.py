"""AutoAugment's CIFAR-10 policy and FOLA's Table I augmentation, inside the jitted round.

The FOLA paper trains its CIFAR-10 clients on (Table I; the authors' ``dirichlet_data.py``)::

    RandomCrop(32, padding=4, fill=128) -> RandomHorizontalFlip -> AutoAugment CIFAR10 policy
    -> ToTensor -> Cutout(1 hole, 16 px) -> Normalize((0.5,) * 3, (0.5,) * 3)

:func:`autoaugment_cutout` is that pipeline on a standardised batch ``[B, H, W, 3]``.
The policy is the 25 sub-policies of Cubuk et al. (2019, AutoAugment) in the Pillow
form the authors ship (their ``cnn_lab/autoaugment.py``):

- each image draws one sub-policy uniformly; each of its two operations runs with
  its probability, in order;
- a magnitude index 0..9 maps to a strength through the ranges in :data:`MAGNITUDES`;
- shears, translations and the four ``ImageEnhance`` operations draw a direction
  (+1 or -1) each time; rotate only turns counter-clockwise;
- geometric operations fill with grey level 128.

The operations are Pillow's (:mod:`bfedjax.data.pil_ops`), computed per image with
per-image strengths, so one call augments a batch whose images drew different
operations; the jitted round carries the whole pipeline.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.data import pil_ops

# (p1, op1, magnitude index 1, p2, op2, magnitude index 2): Cubuk et al.'s CIFAR-10 sub-policies.
CIFAR10_POLICY = (
    (0.1, "invert", 7, 0.2, "contrast", 6),
    (0.7, "rotate", 2, 0.3, "translateX", 9),
    (0.8, "sharpness", 1, 0.9, "sharpness", 3),
    (0.5, "shearY", 8, 0.7, "translateY", 9),
    (0.5, "autocontrast", 8, 0.9, "equalize", 2),
    (0.2, "shearY", 7, 0.3, "posterize", 7),
    (0.4, "color", 3, 0.6, "brightness", 7),
    (0.3, "sharpness", 9, 0.7, "brightness", 9),
    (0.6, "equalize", 5, 0.5, "equalize", 1),
    (0.6, "contrast", 7, 0.6, "sharpness", 5),
    (0.7, "color", 7, 0.5, "translateX", 8),
    (0.3, "equalize", 7, 0.4, "autocontrast", 8),
    (0.4, "translateY", 3, 0.2, "sharpness", 6),
    (0.9, "brightness", 6, 0.2, "color", 8),
    (0.5, "solarize", 2, 0.0, "invert", 3),
    (0.2, "equalize", 0, 0.6, "autocontrast", 0),
    (0.2, "equalize", 8, 0.6, "equalize", 4),
    (0.9, "color", 9, 0.6, "equalize", 6),
    (0.8, "autocontrast", 4, 0.2, "solarize", 8),
    (0.1, "brightness", 3, 0.7, "color", 0),
    (0.4, "solarize", 5, 0.9, "autocontrast", 3),
    (0.9, "translateY", 9, 0.7, "translateY", 9),
    (0.9, "autocontrast", 2, 0.8, "solarize", 3),
    (0.8, "equalize", 8, 0.1, "invert", 3),
    (0.7, "translateY", 9, 0.9, "autocontrast", 1),
)

# Magnitude index 0..9 -> strength (translations as a fraction of the image size; rotate in degrees).
MAGNITUDES = {
    "shearX": np.linspace(0, 0.3, 10),
    "shearY": np.linspace(0, 0.3, 10),
    "translateX": np.linspace(0, 150 / 331, 10),
    "translateY": np.linspace(0, 150 / 331, 10),
    "rotate": np.linspace(0, 30, 10),
    "color": np.linspace(0.0, 0.9, 10),
    "posterize": np.round(np.linspace(8, 4, 10), 0).astype(int),
    "solarize": np.linspace(256, 0, 10),
    "contrast": np.linspace(0.0, 0.9, 10),
    "sharpness": np.linspace(0.0, 0.9, 10),
    "brightness": np.linspace(0.0, 0.9, 10),
    "autocontrast": np.zeros(10),
    "equalize": np.zeros(10),
    "invert": np.zeros(10),
}

FILL = 128  # grey level of the pixels a geometric operation uncovers


class _Op(NamedTuple):
    """One Pillow operation: its per-image parameters and its batched application."""

    signed: bool  # draws a direction +-1 per use
    params: Callable[[float, int, int], Sequence[float]]  # (signed strength, H, W) -> parameters
    dtype: type  # of the parameters
    apply: Callable  # (levels [B, H, W, C], params [B, P], blend table) -> levels
    blend: bool = False  # the parameter is a blend factor, replaced by its row of the policy's blend table


def _enhance(fn) -> _Op:  # parameter: the blend factor 1 + strength
    return _Op(True, lambda s, h, w: (1.0 + s,), np.float64, lambda x, p, table: fn(x, p[:, 0], table), blend=True)


def _plain(fn) -> _Op:
    return _Op(False, lambda s, h, w: (), np.float32, lambda x, p, table: fn(x))


OPS = {
    "shearX": _Op(True, lambda s, h, w: pil_ops.shear_coordinates(s, "x", h, w).reshape(-1), np.float32,
                  lambda x, p, table: pil_ops.shear_bicubic(x, p.reshape(len(p), 3, x.shape[1], x.shape[2]), "x",
                                                            FILL)),
    "shearY": _Op(True, lambda s, h, w: pil_ops.shear_coordinates(s, "y", h, w).reshape(-1), np.float32,
                  lambda x, p, table: pil_ops.shear_bicubic(x, p.reshape(len(p), 3, x.shape[2], x.shape[1]), "y",
                                                            FILL)),
    "translateX": _Op(True, lambda s, h, w: (pil_ops.translate_offset(s * w), 0), np.int32,
                      lambda x, p, table: pil_ops.translate(x, p, FILL)),
    "translateY": _Op(True, lambda s, h, w: (0, pil_ops.translate_offset(s * h)), np.int32,
                      lambda x, p, table: pil_ops.translate(x, p, FILL)),
    "rotate": _Op(False, lambda s, h, w: pil_ops.rotate_coefficients(s, w, h), np.int32,
                  lambda x, p, table: pil_ops.affine_fixed(x, p, FILL)),
    "posterize": _Op(False, lambda s, h, w: (s,), np.int32, lambda x, p, table: pil_ops.posterize(x, p[:, 0])),
    "solarize": _Op(False, lambda s, h, w: (s,), np.float32, lambda x, p, table: pil_ops.solarize(x, p[:, 0])),
    "color": _enhance(pil_ops.color),
    "contrast": _enhance(pil_ops.contrast),
    "sharpness": _enhance(pil_ops.sharpness),
    "brightness": _enhance(pil_ops.brightness),
    "autocontrast": _plain(pil_ops.autocontrast),
    "equalize": _plain(pil_ops.equalize),
    "invert": _plain(pil_ops.invert),
}


class _Stage(NamedTuple):
    """One of a sub-policy's two slots, for every sub-policy at once."""

    op: np.ndarray  # [S] int: index into the stage's ``ops``
    probability: np.ndarray  # [S]
    ops: tuple[str, ...]  # the operation names this stage uses
    params: tuple[np.ndarray, ...]  # per op: [S, 2 directions (+1, -1), P]


class _Compiled(NamedTuple):
    stages: tuple[_Stage, _Stage]
    blend_table: np.ndarray  # [F, 256, 256] uint8


@functools.lru_cache(maxsize=None)
def _compile(policy: tuple, height: int, width: int) -> _Compiled:
    """The policy's parameters for ``height x width`` images, computed once in float64 (Pillow's precision)."""
    factors: list[float] = []
    stages = []
    for slot in (0, 1):
        names = tuple(dict.fromkeys(sub[3 * slot + 1] for sub in policy))
        params = []
        for name in names:
            op = OPS[name]
            rows = np.zeros((len(policy), 2, len(op.params(0.0, height, width))), op.dtype)
            for s, sub in enumerate(policy):
                if sub[3 * slot + 1] != name:
                    continue
                strength = float(MAGNITUDES[name][sub[3 * slot + 2]])
                for d, direction in enumerate((1.0, -1.0) if op.signed else (1.0, 1.0)):
                    rows[s, d] = op.params(strength * direction, height, width)
            if op.blend:  # blend factors -> rows of one shared table
                for factor in rows.reshape(-1):
                    if factor not in factors:
                        factors.append(float(factor))
            params.append(rows)
        stages.append(_Stage(np.array([names.index(sub[3 * slot + 1]) for sub in policy]),
                             np.array([sub[3 * slot] for sub in policy], np.float32), names, tuple(params)))
    index = {f: i for i, f in enumerate(factors)}
    for stage in stages:
        for i, name in enumerate(stage.ops):
            if OPS[name].blend:
                stage.params[i][...] = np.vectorize(index.__getitem__)(stage.params[i])
    table = pil_ops.blend_table(factors) if factors else np.zeros((1, 256, 256), np.uint8)
    return _Compiled(tuple(stages), table)


def _check_policy(policy: Sequence[tuple]) -> tuple:
    policy = tuple(tuple(sub) for sub in policy)
    for sub in policy:
        if (len(sub) != 6 or sub[1] not in OPS or sub[4] not in OPS
                or not all(isinstance(sub[i], (int, np.integer)) and 0 <= sub[i] <= 9 for i in (2, 5))):
            raise ValueError(f"sub-policy {sub} is not (p1, op1, 0..9, p2, op2, 0..9) with ops from {sorted(OPS)}")
    return policy


def apply_policy(levels: jax.Array, subpolicy: jax.Array, applied: jax.Array, negative: jax.Array,
                 policy: Sequence[tuple] = CIFAR10_POLICY) -> jax.Array:
    """Runs drawn sub-policies.

    Args:
      levels: ``[B, H, W, 3]`` int32 in 0..255.
      subpolicy: ``[B]`` int: each image's sub-policy.
      applied: ``[B, 2]`` bool: whether each of its two operations runs.
      negative: ``[B, 2]`` bool: direction -1 for the signed operations.
      policy: sub-policies ``(p1, op1, index1, p2, op2, index2)``.
    Returns:
      ``[B, H, W, 3]`` int32 levels.
    """
    compiled = _compile(_check_policy(policy), levels.shape[1], levels.shape[2])
    table = jnp.asarray(compiled.blend_table)
    direction = negative.astype(jnp.int32)
    for slot, stage in enumerate(compiled.stages):
        chosen = jnp.asarray(stage.op)[subpolicy]
        out = levels
        for i, name in enumerate(stage.ops):
            params = jnp.asarray(stage.params[i])[subpolicy, direction[:, slot]]
            runs = (chosen == i) & applied[:, slot]
            out = jnp.where(runs[:, None, None, None], OPS[name].apply(levels, params, table), out)
        levels = out
    return levels


def random_policy(levels: jax.Array, key: jax.Array, policy: Sequence[tuple] = CIFAR10_POLICY) -> jax.Array:
    """AutoAugment: every image of ``levels [B, H, W, 3]`` (int32 0..255) gets one random sub-policy."""
    policy = _check_policy(policy)
    compiled = _compile(policy, levels.shape[1], levels.shape[2])
    b = levels.shape[0]
    k_sub, k_apply, k_sign = jax.random.split(key, 3)
    subpolicy = jax.random.randint(k_sub, (b,), 0, len(policy))
    probability = jnp.stack([jnp.asarray(stage.probability)[subpolicy] for stage in compiled.stages], axis=1)
    applied = jax.random.uniform(k_apply, (b, 2)) < probability
    negative = jax.random.bernoulli(k_sign, 0.5, (b, 2))
    return apply_policy(levels, subpolicy, applied, negative, policy)


def cutout(x: jax.Array, key: jax.Array, *, length: int = 16, value: float = 0.0) -> jax.Array:
    """DeVries & Taylor's Cutout: one square per image set to ``value``.

    The square's centre is uniform over the image; rows and columns
    ``[centre - length // 2, centre + length // 2)`` are clipped to the image, so a
    square near the border is smaller (and an odd ``length`` gives ``length - 1`` sides,
    as the authors' Cutout does).

    Args:
      x: ``[B, H, W, C]``.
      key: PRNG key.
    Returns:
      ``[B, H, W, C]``.
    """
    b, h, w, _ = x.shape
    k_y, k_x = jax.random.split(key)
    cy = jax.random.randint(k_y, (b, 1), 0, h)
    cx = jax.random.randint(k_x, (b, 1), 0, w)
    half = length // 2
    rows = jnp.arange(h)[None, :]
    cols = jnp.arange(w)[None, :]
    in_rows = (rows >= cy - half) & (rows < cy + half)
    in_cols = (cols >= cx - half) & (cols < cx + half)
    hole = in_rows[:, :, None, None] & in_cols[:, None, :, None]
    return jnp.where(hole, jnp.asarray(value, x.dtype), x)


def autoaugment_cutout(x: jax.Array, key: jax.Array, *, pixel_norm=((0.5,) * 3, (0.5,) * 3),
                       padding: int = 4, cutout_length: int = 16,
                       policy: Sequence[tuple] = CIFAR10_POLICY) -> jax.Array:
    """FOLA's Table I augmentation of a standardised batch.

    Recovers the 8-bit levels, then: random crop of the image padded by ``padding``
    grey (128) pixels, horizontal flip with probability 1/2, one random sub-policy of
    ``policy``, Cutout of a ``cutout_length`` square (set to level 0, as the authors'
    Cutout zeroes the [0, 1] tensor), and the same standardisation again.

    Args:
      x: ``[B, H, W, 3]`` float, ``(level / 255 - mean) / std``.
      key: PRNG key.
      pixel_norm: ``(mean, std)`` of ``x`` (floats or per-channel), e.g. a
        :class:`~bfedjax.data.Dataset`'s ``pixel_norm``; FOLA's CIFAR-10 default.
    Returns:
      ``[B, H, W, 3]`` float like ``x``.
    """
    from bfedjax.data.augment import random_crop_flip

    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"AutoAugment needs RGB image batches [B, H, W, 3], got shape {x.shape}; "
                         "fix: --augment=crop_flip (or shift_flip) for other images")
    mean, std = (jnp.asarray(v, jnp.float32) for v in pixel_norm)
    levels = jnp.clip(jnp.round((x.astype(jnp.float32) * std + mean) * 255.0), 0, 255).astype(jnp.int32)
    k_crop, k_policy, k_cut = jax.random.split(key, 3)
    levels = random_crop_flip(levels, k_crop, padding=padding, fill=FILL)
    levels = random_policy(levels, k_policy, policy)
    unit = cutout(levels.astype(jnp.float32) / 255.0, k_cut, length=cutout_length)
    return ((unit - mean) / std).astype(x.dtype)
