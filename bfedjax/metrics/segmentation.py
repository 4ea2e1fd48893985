"""Segmentation metrics and losses for 2-D images and 3-D volumes, usable inside ``jax.jit``.

Conventions (all functions):

* ``logits`` float, either ``[B, *S]`` -- binary segmentation, one foreground logit per
  pixel (voxel), hard prediction ``logits > 0`` -- or ``[B, *S, C]`` -- ``C >= 2`` classes,
  one logit per class, hard prediction the argmax. ``S`` is the spatial shape ``(H, W)`` or
  ``(D, H, W)``; shapes below are written for images. A binary logit ``z`` is the
  two-class logits ``[0, z]`` wherever classes are needed (:func:`class_logits`; exact,
  since ``softmax([0, z]) = [1 - sigmoid z, sigmoid z]``), so every multi-class formula
  reduces to the binary one at ``C = 2``.
* ``masks [B, *S]`` int class labels in ``{0, ..., C-1}`` (0 = background; binary: {0, 1}).
* ``weights [B]`` float, optional: 1 = real image, 0 = padding row of a padded batch.
  ``None`` means every image is real. Weighted means divide by ``sum(weights)`` and are 0
  when it is 0.
* Metrics return PER-IMAGE values ``[B]`` unless said otherwise; the caller averages.

Standard metrics (the spec's default: hard argmax masks): :func:`dice`, :func:`iou`,
:func:`hausdorff95` (medpy's ``hd95``) of one binary mask pair, and :func:`pixel_accuracy`;
with ``C > 2`` classes, :func:`evaluate_batch` takes each foreground class ``1..C-1`` as its
own mask pair and reports the mean over those classes (and each class's Dice).

Losses (:data:`LOSSES`): ``"ce_dice"`` (:func:`ce_dice_loss`, cross-entropy + soft Dice, the
default), and the FedRef authors' ``"focal"`` (:func:`authors_focal_loss`, their DRIVE loss)
and ``"dice_focal"`` (:func:`dice_focal_loss`, their FeTS loss), segmentation_models_pytorch's
multiclass ``DiceLoss`` and ``FocalLoss`` as they configure them.

The FedRef authors' metrics (:func:`authors_soft_dice`, :func:`authors_soft_iou`,
:func:`authors_hd95`) reproduce what their evaluation code computes, which is NOT the
standard metrics (an activation applied twice, and a "Hausdorff 95" that is a row-wise
L2 distance), on the class logits (``[0, z]`` for one logit per pixel).

Streaming over test batches: :func:`evaluate_batch` returns additive SUMS, so the caller
adds the dicts of all batches (``jax.tree.map(jnp.add, ...)``) and calls :func:`summarize`
once. The authors' soft Dice/IoU are batch-POOLED (sums over images and pixels before the
ratio), so they cannot be summed per image; instead ``evaluate_batch`` returns their pooled
per-class pieces (``authors_inter``, ``authors_card``, ``authors_target``, each ``[C]``),
which are additive too, and :func:`summarize` forms the ratios over the whole test set --
the same value as :func:`authors_soft_dice` applied to the whole test set as one batch.
(If the authors averaged per-batch scores over their test loader instead, that value
depends on their batch size; call :func:`authors_soft_dice` per batch to mimic it.)
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import optax

from bfedjax.order_statistics import kth_smallest_pair

AUTHORS_SMOOTH = 1e-5  # smp DiceLoss/JaccardLoss(smooth=1e-5, eps=1e-7) as the authors configure them
AUTHORS_EPS = 1e-7
PAIRWISE_EPS = 1e-6  # torch.nn.PairwiseDistance's default eps, added to the difference
FOCAL_ALPHA = 0.1  # smp FocalLoss(mode="multiclass", alpha=0.1, gamma=4.5, normalized=True): the authors' DRIVE and FeTS
FOCAL_GAMMA = 4.5
FOCAL_NORM_EPS = 1e-6  # smp's clamp_min of the normaliser


# ---------------------------------------------------------------------------- helpers


def _weighted_mean(values, weights=None):
    """Mean of ``values [B]`` with ``weights [B]`` (None: all 1); 0 if the weights sum to 0."""
    if weights is None:
        return jnp.mean(values)
    weights = jnp.asarray(weights, values.dtype)
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(values * weights) / jnp.where(total > 0, total, 1.0), 0.0)


def _weights_or_ones(weights, batch: int):
    """``weights [B]`` as float32, or ones when None."""
    return jnp.ones((batch,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)


def _spatial(x) -> tuple[int, ...]:
    """The spatial axes of ``x [B, *S]``: every axis but the first."""
    return tuple(range(1, jnp.ndim(x)))


def class_logits(logits, masks):
    """Per-class logits ``[B, *S, C]``: one binary logit per pixel ``[B, *S]`` becomes ``[0, z]`` (C = 2);
    ``[B, *S, C]`` is returned as float32. ``masks [B, *S]`` gives the spatial rank."""
    z = jnp.asarray(logits, jnp.float32)
    if z.ndim == jnp.ndim(masks):
        return jnp.stack([jnp.zeros_like(z), z], axis=-1)
    if z.ndim != jnp.ndim(masks) + 1:
        raise ValueError(f"logits {z.shape} do not fit masks {jnp.shape(masks)}: need [B, *S] (one binary logit) "
                         "or [B, *S, C] (one logit per class)")
    return z


def hard_labels(logits, masks):
    """Hard prediction ``[B, *S]`` int32: ``logits > 0`` for one binary logit, else the argmax over classes."""
    z = jnp.asarray(logits)
    if z.ndim == jnp.ndim(masks):
        return (z > 0).astype(jnp.int32)
    return jnp.argmax(class_logits(z, masks), axis=-1).astype(jnp.int32)


def _onehot(masks, num_classes: int):
    """``masks [B, *S]`` labels -> one-hot ``[B, *S, C]`` float32."""
    return jax.nn.one_hot(jnp.asarray(masks, jnp.int32), num_classes, dtype=jnp.float32)


def _image_weights(weights, x):
    """``weights [B]`` (None: ones) shaped to broadcast against ``x [B, ...]``."""
    return _weights_or_ones(weights, x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))


def _counts(pred, target):
    """Per-image ``(|P∩G|, |P|, |G|)``, each ``[B]`` float, of hard masks ``[B, H, W]``."""
    p = jnp.asarray(pred).astype(bool)
    g = jnp.asarray(target).astype(bool)
    count = lambda m: jnp.sum(m, axis=_spatial(m)).astype(jnp.float32)
    return count(p & g), count(p), count(g)


# ---------------------------------------------------------------------------- overlap


@jax.jit
def dice(pred, target, smooth: float = 0.0):
    """Per-image Dice ``(2|P∩G| + smooth) / (|P| + |G| + smooth)`` of hard masks.

    Args:
      pred, target: ``[B, H, W]`` bool or 0/1.
      smooth: added to numerator and denominator (0: the plain Dice coefficient).
    Returns:
      ``[B]``. Both masks empty -> 1.0 (perfect agreement); exactly one empty -> 0.0
      (for ``smooth=0``; ``smooth / (|P| + |G| + smooth)`` otherwise). Never NaN.
    """
    inter, n_p, n_g = _counts(pred, target)
    den = n_p + n_g
    return jnp.where(den > 0, (2 * inter + smooth) / jnp.where(den > 0, den + smooth, 1.0), 1.0)


@jax.jit
def iou(pred, target):
    """Per-image intersection over union ``|P∩G| / |P∪G|`` of hard masks ``[B, H, W]``.

    Returns ``[B]``; both masks empty -> 1.0, exactly one empty -> 0.0. Never NaN.
    """
    inter, n_p, n_g = _counts(pred, target)
    union = n_p + n_g - inter
    return jnp.where(union > 0, inter / jnp.where(union > 0, union, 1.0), 1.0)


@jax.jit
def pixel_accuracy(pred, target):
    """Per-image fraction of pixels where hard masks or label maps ``pred``, ``target [B, H, W]`` agree; ``[B]``."""
    agree = jnp.asarray(pred).astype(jnp.int32) == jnp.asarray(target).astype(jnp.int32)
    return jnp.mean(agree, axis=_spatial(agree)).astype(jnp.float32)


# ---------------------------------------------------------------------------- Hausdorff 95


@jax.jit
def boundary(mask):
    """Inner boundary ``mask AND NOT erosion(mask)`` of one hard mask ``[H, W]`` (or ``[D, H, W]``), bool.

    The erosion uses the 4-connected cross (6-connected in 3-D: the face neighbours) and
    treats pixels outside the image as background, as medpy's ``hd95`` does (scipy
    ``binary_erosion`` with its default ``border_value=0``): a foreground pixel on the
    image edge is always a boundary pixel.
    """
    m = jnp.asarray(mask).astype(bool)
    pad = jnp.pad(m, 1, constant_values=False)
    eroded = m
    for axis in range(m.ndim):
        for shift in (0, 2):
            index = tuple(slice(shift, shift + m.shape[a]) if a == axis else slice(1, 1 + m.shape[a])
                          for a in range(m.ndim))
            eroded = eroded & pad[index]
    return m & ~eroded


# Above this many elements, one axis' min-plus pass loops over query positions instead of broadcasting.
_BROADCAST_DISTANCE_ELEMENTS = 2 ** 24


def _min_plus_squared_offsets(d, axis: int):
    """``out[..., i, ...] = min_j d[..., j, ...] + (i - j)^2`` along ``axis`` (one pass of the exact EDT)."""
    n = d.shape[axis]
    moved = jnp.moveaxis(d, axis, 0)  # [n, ...]
    positions = jnp.arange(n, dtype=jnp.float32)
    offsets = jnp.square(positions[:, None] - positions[None, :]).reshape((n, n) + (1,) * (moved.ndim - 1))
    if n * d.size <= _BROADCAST_DISTANCE_ELEMENTS:
        out = jnp.min(moved[None] + offsets, axis=1)
    else:  # one query position at a time: memory of one volume
        out = jax.lax.map(lambda row: jnp.min(moved + row, axis=0), offsets)
    return jnp.moveaxis(out, 0, axis)


def _sq_dist_to_set(member):
    """Squared Euclidean distance from every pixel to the nearest ``True`` of ``member [H, W]`` (or ``[D, H, W]``).

    Exact and separable: one min-plus pass of squared offsets per axis. ``+inf`` everywhere
    when ``member`` is empty. Returns the shape of ``member``.
    """
    d = jnp.where(member, 0.0, jnp.inf).astype(jnp.float32)
    for axis in range(member.ndim):
        d = _min_plus_squared_offsets(d, axis)
    return d


def _percentile95_of_members(values, members):
    """numpy's default (linear) 95th percentile of ``values[members]``; ``values, members [N]``.

    Non-members rank last as +inf; the interpolation index ``0.95 * (n - 1)`` is formed in exact integer
    arithmetic from the member count n, and its two neighbouring order statistics are found without a sort
    (``order_statistics.kth_smallest_pair``, one bisection: XLA:CPU sorts a volume's millions of distances slowly).
    Meaningless (but finite or inf, never used) when n == 0.
    """
    ranked = jnp.where(members, values, jnp.inf)
    n = jnp.sum(members).astype(jnp.int32)
    m = jnp.maximum(n - 1, 0)  # 95 m / 100 split so that 95 m cannot overflow int32 on large volumes
    lo = 95 * (m // 100) + (95 * (m % 100)) // 100
    frac = ((95 * (m % 100)) % 100).astype(values.dtype) / 100.0
    a, b = kth_smallest_pair(ranked, lo)  # frac > 0 only where lo + 1 <= n - 1: b is a member then
    return jnp.where(frac > 0, a + (b - a) * frac, a)


def _hd95_one(pred, target):
    """Hausdorff 95 of one pair of hard masks ``[H, W]`` or ``[D, H, W]`` -> scalar (see :func:`hausdorff95`)."""
    bp, bg = boundary(pred), boundary(target)
    d_pg = jnp.sqrt(_sq_dist_to_set(bg))  # for every pixel: distance to G's boundary
    d_gp = jnp.sqrt(_sq_dist_to_set(bp))
    pooled = jnp.concatenate([d_pg.ravel(), d_gp.ravel()])
    members = jnp.concatenate([bp.ravel(), bg.ravel()])
    hd = _percentile95_of_members(pooled, members)
    has_p, has_g = jnp.any(bp), jnp.any(bg)
    diagonal = jnp.sqrt(jnp.float32(sum(n * n for n in pred.shape)))
    return jnp.where(has_p & has_g, hd, jnp.where(has_p | has_g, diagonal, 0.0))


@jax.jit
def hausdorff95(pred, target):
    """Per-image 95th-percentile symmetric Hausdorff distance, in pixels (voxels), as medpy's ``hd95``.

    For each image: boundaries ``B_P``, ``B_G`` by :func:`boundary` (4-connected erosion,
    6-connected in 3-D, outside the image = background); directed distances ``d(P->G)`` =
    for every pixel of ``B_P`` the Euclidean distance to the nearest pixel of ``B_G``, and
    ``d(G->P)`` likewise; the result is ``numpy.percentile(concatenate(d(P->G), d(G->P)), 95)``
    (linear interpolation). Unit spacing in every axis.

    Args:
      pred, target: hard masks ``[B, H, W]`` or ``[B, D, H, W]`` (bool or 0/1).
    Returns:
      ``[B]`` float32. Both masks empty -> 0.0; exactly one empty -> the image diagonal
      ``sqrt(H^2 + W^2)`` (``sqrt(D^2 + H^2 + W^2)``), a finite worst-case penalty (medpy
      raises an error instead).
    """
    pred = jnp.asarray(pred).astype(bool)
    target = jnp.asarray(target).astype(bool)
    return jax.lax.map(lambda pt: _hd95_one(*pt), (pred, target))


# ---------------------------------------------------------------------------- FedRef authors' metrics


def _authors_probs(logits, masks):
    """The authors' double activation on the class logits ``[B, *S, C]`` (:func:`class_logits`).

    Step 1 (their model's eval-mode output): ``sigmoid``; step 2 (smp's ``from_logits=True``,
    multiclass): a softmax over the classes of those. For one binary logit ``z`` this gives
    foreground probability ``sigmoid(sigmoid(z) - 0.5)``, which lies in
    ``(sigmoid(-0.5), sigmoid(0.5)) ~ (0.378, 0.622)``. Returns ``[B, *S, C]``.
    """
    return jax.nn.softmax(jax.nn.sigmoid(class_logits(logits, masks)), axis=-1)


def _pooled(probs, onehot, weights):
    """smp's per-class pooled sums over the real images and all pixels: ``(sum p t, sum p + t, sum t)``, each ``[C]``."""
    w = _image_weights(weights, probs)
    total = lambda x: jnp.sum(x * w, axis=tuple(range(probs.ndim - 1)))
    return total(probs * onehot), total(probs + onehot), total(onehot)


@jax.jit
def authors_pooled_stats(logits, masks, weights=None):
    """Batch-pooled per-class pieces of the authors' soft Dice/IoU (additive over batches).

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]``; weights: ``[B]`` or None.
    Returns:
      ``(inter, card, target)``, each ``[C]`` (``C = 2`` for one binary logit): sums over the
      real images and all pixels of ``p * t``, ``p + t`` and ``t``, with ``p`` from
      :func:`_authors_probs` and ``t`` the one-hot mask.
    """
    p = _authors_probs(logits, masks)
    return _pooled(p, _onehot(masks, p.shape[-1]), weights)


def _smp_scores(inter, card, target):
    """smp 0.5.0's multiclass Dice and Jaccard LOSSES from the pooled pieces ``[C]``.

    smp 0.5.0 scores both as Tversky indices ``(I + s) / max(I + a FP + b FN + s, eps)``: Dice with
    ``a = b = 1/2``, so per class ``dice_c = (I + s) / max(card / 2 + s, eps)`` (the smoothing counts
    twice against ``(2 I + s) / (card + s)``), and Jaccard with ``a = b = 1``,
    ``jacc_c = (I + s) / max(card - I + s, eps)``; ``loss_c = 1 - score_c``, zeroed for classes absent
    from the targets; loss = mean over ALL classes (absent ones count as 0). Returns
    ``(dice_loss, jaccard_loss)`` scalars.
    """
    present = (target > 0).astype(jnp.float32)
    s, eps = AUTHORS_SMOOTH, AUTHORS_EPS
    dice_c = (inter + s) / jnp.maximum(0.5 * card + s, eps)
    jacc_c = (inter + s) / jnp.maximum(card - inter + s, eps)
    loss = lambda c: jnp.mean((1.0 - c) * present)
    return loss(dice_c), loss(jacc_c)


def _authors_scores(inter, card, target):
    """The authors' reported ``(dice, iou)``: ``1 -`` smp's losses (:func:`_smp_scores`)."""
    dice_loss, jaccard_loss = _smp_scores(inter, card, target)
    return 1.0 - dice_loss, 1.0 - jaccard_loss


@jax.jit
def authors_soft_dice(logits, masks, weights=None):
    """The FedRef authors' "Dice", as the FedRef authors' code computes it; not the standard metric.

    Their pipeline: ``sigmoid`` on the C-channel network output, then
    segmentation_models_pytorch ``DiceLoss(mode="multiclass", from_logits=True,
    smooth=1e-5, eps=1e-7)``, which applies a softmax over the classes AGAIN, and they
    report ``1 - loss``. One logit per pixel becomes the two-class logits ``[0, z]``
    (:func:`class_logits`). smp pools over the batch AND all pixels jointly per
    class; classes absent from the batch's targets count as loss 0 (see :func:`_smp_scores`).

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels; weights: ``[B]`` or None
        (zero-weight images are left out of the pooled sums).
    Returns:
      scalar: ONE value for the (real images of the) batch.
    """
    return _authors_scores(*authors_pooled_stats(logits, masks, weights))[0]


@jax.jit
def authors_soft_iou(logits, masks, weights=None):
    """The FedRef authors' "IoU", as the FedRef authors' code computes it; not the standard metric.

    smp ``JaccardLoss`` with the same settings, pipeline and pooling as :func:`authors_soft_dice`, with
    ``jaccard_c = (I + smooth) / max(card - I + smooth, eps)``. Shapes as there; returns a scalar.
    """
    return _authors_scores(*authors_pooled_stats(logits, masks, weights))[1]


@jax.jit
def authors_hd95(logits, masks):
    """The FedRef authors' "Hausdorff 95", as their code computes it; NOT a Hausdorff distance.

    Steps, per image: ``pred_map = sigmoid(class logits)`` (for one binary logit, ``sigmoid([0, z])``:
    channel 0 is 0.5 everywhere; no softmax here); ``label`` = one-hot of the mask; torch's
    ``nn.PairwiseDistance()(pred_map, label)`` = ``|| pred_map - label + 1e-6 ||_2`` along the
    LAST spatial axis (image width) -> ``[C, H]`` (``[C, D, H]``); the max over classes and rows.
    (The authors take the max over their whole batch, which is the max of these per-image values.)

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels.
    Returns:
      ``[B]`` float32.
    """
    pred_map = jax.nn.sigmoid(class_logits(logits, masks))  # [B, *S, C]
    diff = pred_map - _onehot(masks, pred_map.shape[-1]) + PAIRWISE_EPS
    dist = jnp.sqrt(jnp.sum(jnp.square(diff), axis=-2))  # the width axis: [B, *S[:-1], C]
    return jnp.max(dist, axis=tuple(range(1, dist.ndim)))


# ---------------------------------------------------------------------------- losses


def _per_image_ce(logits, masks):
    """``[B]``: the mean over pixels of the cross-entropy: binary with logits for one logit per pixel (optax's
    stable form), else softmax over the class logits."""
    if jnp.ndim(logits) == jnp.ndim(masks):
        ce = optax.sigmoid_binary_cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(masks, jnp.float32))
    else:
        z = class_logits(logits, masks)  # a one-hot product: the integer-label form's gradient is a scatter, which
        ce = -jnp.sum(jax.nn.log_softmax(z, axis=-1) * _onehot(masks, z.shape[-1]), axis=-1)  # XLA folds slowly
    return jnp.mean(ce, axis=_spatial(ce))


def _per_image_soft_dice(logits, masks, smooth):
    """``[B]``: the mean over foreground classes ``1..C-1`` of ``1 - (2 sum p t + smooth) / (sum p + sum t + smooth)``,
    ``p = softmax`` of the class logits (``sigmoid(z)`` for one logit per pixel, computed directly)."""
    if jnp.ndim(logits) == jnp.ndim(masks):
        p = jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))[..., None]
        t = jnp.asarray(masks, jnp.float32)[..., None]
    else:
        z = class_logits(logits, masks)
        p, t = jax.nn.softmax(z, axis=-1)[..., 1:], _onehot(masks, z.shape[-1])[..., 1:]
    pixels = tuple(range(1, p.ndim - 1))
    inter = jnp.sum(p * t, axis=pixels)  # [B, C-1]
    card = jnp.sum(p, axis=pixels) + jnp.sum(t, axis=pixels)
    return jnp.mean(1.0 - (2.0 * inter + smooth) / (card + smooth), axis=1)


@jax.jit
def ce_dice_loss(logits, masks, weights=None, dice_weight: float = 1.0):
    """Cross-entropy + ``dice_weight`` * soft Dice, each per image, averaged over the real images.

    Per image: the mean over pixels of the softmax cross-entropy of the class logits
    (for one binary logit ``z``: the binary cross-entropy with logits, optax's stable form),
    plus ``dice_weight`` times the mean over the foreground classes ``1..C-1`` of
    ``1 - (2 sum(p_c t_c) + 1) / (sum p_c + sum t_c + 1)`` with ``p = softmax`` (for one
    binary logit ``p_1 = sigmoid z``: the usual binary soft Dice loss).

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels; weights: ``[B]`` or None.
    Returns:
      a differentiable scalar.
    """
    return _weighted_mean(_per_image_ce(logits, masks) + dice_weight * _per_image_soft_dice(logits, masks, 1.0), weights)


@jax.jit
def soft_dice_loss(logits, masks, weights=None, smooth: float = 1.0):
    """The soft Dice part of :func:`ce_dice_loss` alone (with ``smooth``), averaged over the real images; a scalar."""
    return _weighted_mean(_per_image_soft_dice(logits, masks, smooth), weights)


@jax.jit
def authors_dice_loss(logits, masks, weights=None):
    """segmentation_models_pytorch's ``DiceLoss(mode="multiclass", from_logits=True, smooth=1e-5, eps=1e-7)``.

    ``p = softmax(class logits)`` (no sigmoid first: in training the authors' U-Nets output raw
    logits); per class ``1 - (sum p t + 1e-5) / max(sum (p + t) / 2 + 1e-5, 1e-7)``, summed over the
    real images AND pixels jointly (batch-pooled), zero for classes absent from the batch's masks,
    then the mean over all ``C`` classes (:func:`_smp_scores`).

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels; weights: ``[B]`` or None.
    Returns:
      a differentiable scalar.
    """
    z = class_logits(logits, masks)
    p = jax.nn.softmax(z, axis=-1)
    return _smp_scores(*_pooled(p, _onehot(masks, z.shape[-1]), weights))[0]


@jax.jit
def authors_focal_loss(logits, masks, weights=None, alpha: float = FOCAL_ALPHA, gamma: float = FOCAL_GAMMA):
    """segmentation_models_pytorch's ``FocalLoss(mode="multiclass", alpha, gamma, normalized=True)``.

    smp's multiclass mode is a SUM over classes ``c`` of a binary focal loss of the class's own
    logit ``z_c`` (a sigmoid, not a softmax) against ``t_c = [mask == c]``:
    ``l = (1 - pt)^gamma * bce(z_c, t_c) * (alpha t_c + (1 - alpha)(1 - t_c))`` with
    ``pt = exp(-bce)``; normalised by ``max(sum (1 - pt)^gamma, 1e-6)`` and then averaged over the
    elements (smp's ``reduction="mean"`` after the normalisation, so the loss scales as one over the
    number of pixels). Sums and counts run over the real images only. One binary logit is
    ``[0, z]``: class 0's term is then a constant (no gradient).

    Args:
      logits: ``[B, H, W]`` or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels; weights: ``[B]`` or None;
      alpha, gamma: the authors' 0.1 and 4.5 by default.
    Returns:
      a differentiable scalar.
    """
    z = class_logits(logits, masks)
    t = _onehot(masks, z.shape[-1])
    bce = optax.sigmoid_binary_cross_entropy(z, t)
    focal_term = jnp.power(1.0 - jnp.exp(-bce), gamma)
    loss = focal_term * bce * (alpha * t + (1.0 - alpha) * (1.0 - t))
    w = _image_weights(weights, z)
    per_class = lambda x: jnp.sum(x * w, axis=tuple(range(z.ndim - 1)))  # [C]
    elements = jnp.sum(w) * (z.size // (z.shape[0] * z.shape[-1]))
    per_class_loss = per_class(loss) / jnp.maximum(per_class(focal_term), FOCAL_NORM_EPS)
    return jnp.sum(per_class_loss) / jnp.maximum(elements, 1.0)


@jax.jit
def dice_focal_loss(logits, masks, weights=None):
    """The FedRef authors' FeTS loss: :func:`authors_dice_loss` + :func:`authors_focal_loss` (weights 1 and 1)."""
    return authors_dice_loss(logits, masks, weights) + authors_focal_loss(logits, masks, weights)


# name -> loss(logits, masks, weights) -> scalar; tasks.segmentation(loss=...) and --segmentation_loss.
LOSSES = {
    "ce_dice": ce_dice_loss,  # cross-entropy + soft Dice per image (the default)
    "focal": authors_focal_loss,  # the FedRef authors' DRIVE loss (smp normalised focal, alpha 0.1, gamma 4.5)
    "dice_focal": dice_focal_loss,  # the FedRef authors' FeTS loss (smp multiclass Dice + the same focal)
}


def loss_fn(name: str):
    """The loss :data:`LOSSES` names; a one-line ``ValueError`` naming the choices otherwise."""
    if name not in LOSSES:
        raise ValueError(f"unknown segmentation loss {name!r}; fix: one of {', '.join(LOSSES)}")
    return LOSSES[name]


# ---------------------------------------------------------------------------- streaming evaluation


# BraTS / FeTS's evaluated regions in the FedRef authors' classes (FeTS's labels 1, 2, 4 as 1, 2, 3).
FETS_REGIONS = (("whole_tumour", (1, 2, 3)), ("tumour_core", (1, 3)), ("enhancing_tumour", (3,)))


def checked_regions(regions) -> tuple:
    """``((name, classes), ...)`` as hashable tuples (jit-static), checked: names distinct identifiers that
    do not shadow the per-class Dice (``class<c>`` would make ``dice_class<c>`` twice), classes non-empty
    foreground labels (>= 1). A ``ValueError`` naming the fix otherwise."""
    out = tuple((str(name), tuple(int(c) for c in classes)) for name, classes in regions)
    names = [name for name, _ in out]
    for name, classes in out:
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"region name {name!r} is not an identifier (it names the metrics dice_<name>, "
                             "hd95_<name>); fix: a Python identifier such as 'whole_tumour'")
        if re.fullmatch(r"class\d+", name):
            raise ValueError(f"region name {name!r} would overwrite the per-class metric dice_{name}; fix: "
                             "another name (e.g. 'whole_tumour')")
        if names.count(name) > 1:
            raise ValueError(f"region name {name!r} is given {names.count(name)} times; fix: one name per region")
        if not classes or min(classes) < 1:
            raise ValueError(f"region {name!r} has classes {classes}; fix: one or more foreground labels >= 1")
    return out


@functools.partial(jax.jit, static_argnames=("loss", "regions"))
def evaluate_batch(logits, masks, weights=None, loss: str = "ce_dice", regions: tuple = ()) -> dict:
    """Additive SUMS over the real images of one test batch (see the module docstring).

    Args:
      logits: ``[B, H, W]`` (one binary logit) or ``[B, H, W, C]``; masks: ``[B, H, W]`` labels;
        weights: ``[B]`` (1 real, 0 padding) or None; loss: a :data:`LOSSES` name; regions: ``((name,
        classes), ...)``, unions of classes scored as one mask each (:data:`FETS_REGIONS`: BraTS's whole
        tumour, tumour core and enhancing tumour).
    Returns:
      dict of scalars: ``dice``, ``iou``, ``hd95`` (sums over images of the per-image metric of the
      hard prediction, averaged over the foreground classes ``1..C-1``; binary: the foreground),
      ``pixel_accuracy``, ``loss`` (the batch's ``loss`` times its real images, so ``loss / count``
      is the loss over the set for per-image losses such as ``ce_dice``, and the image-weighted mean of
      the batches' values for the batch-pooled ``focal`` and ``dice_focal``), ``authors_hd95`` (sum of
      per-image :func:`authors_hd95`), ``count`` (number of real images); with ``C > 2`` classes also
      ``dice_class1`` .. ``dice_class{C-1}``; ``dice_<name>`` and ``hd95_<name>`` per region (of the
      masks "label in classes"); and the authors' pooled pieces ``authors_inter``,
      ``authors_card``, ``authors_target`` (each ``[C]``). Add these dicts over batches and pass
      the total to :func:`summarize`.
    """
    w = _weights_or_ones(weights, logits.shape[0])
    num_classes = logits.shape[-1] if logits.ndim == jnp.ndim(masks) + 1 else 2  # one binary logit: 2 classes
    pred, target = hard_labels(logits, masks), jnp.asarray(masks, jnp.int32)
    pairs = [(pred == c, target == c) for c in range(1, num_classes)]  # the foreground classes' masks
    wsum = lambda v: jnp.sum(v * w)
    per_class = lambda metric: jnp.stack([metric(p, t) for p, t in pairs], axis=1)  # [B, C-1]
    dice_c = per_class(dice)
    inter, card, tsum = authors_pooled_stats(logits, masks, w)
    out = {
        "dice": wsum(jnp.mean(dice_c, axis=1)),
        "iou": wsum(jnp.mean(per_class(iou), axis=1)),
        "hd95": wsum(jnp.mean(per_class(hausdorff95), axis=1)),
        "pixel_accuracy": wsum(pixel_accuracy(pred, target)),
        "loss": loss_fn(loss)(logits, masks, w) * jnp.sum(w),
        "authors_hd95": wsum(authors_hd95(logits, masks)),
        "count": jnp.sum(w),
        "authors_inter": inter,
        "authors_card": card,
        "authors_target": tsum,
    }
    if num_classes > 2:
        out.update({f"dice_class{c}": wsum(dice_c[:, c - 1]) for c in range(1, num_classes)})
    for name, classes in checked_regions(regions):  # names and lower bounds; the upper bound needs the logits
        if max(classes) >= num_classes:
            raise ValueError(f"region {name!r} has classes {classes}, but the logits have {num_classes} classes; "
                             f"fix: labels 1..{num_classes - 1}")
        inside = lambda labels: jnp.isin(labels, jnp.asarray(classes))  # noqa: E731
        out[f"dice_{name}"] = wsum(dice(inside(pred), inside(target)))
        out[f"hd95_{name}"] = wsum(hausdorff95(inside(pred), inside(target)))
    return out


@jax.jit
def summarize(sums: dict) -> dict:
    """Final metrics from the (batch-summed) output of :func:`evaluate_batch`.

    Returns the means over images of ``dice``, ``iou``, ``hd95``, ``pixel_accuracy``,
    ``loss``, ``authors_hd95`` and any ``dice_class*`` (0 when ``count`` is 0), plus
    ``authors_dice`` and ``authors_iou`` pooled over the whole set, and ``count``.
    """
    count = sums["count"]
    safe = jnp.where(count > 0, count, 1.0)
    pooled = ("count", "authors_inter", "authors_card", "authors_target")
    out = {k: jnp.where(count > 0, v / safe, 0.0) for k, v in sums.items() if k not in pooled}
    out["authors_dice"], out["authors_iou"] = _authors_scores(
        sums["authors_inter"], sums["authors_card"], sums["authors_target"])
    out["count"] = count
    return out
