"""Binary segmentation metrics and losses for 2-D images and 3-D volumes, usable inside ``jax.jit``.

Conventions (all functions):

* ``logits [B, *S]`` float, one logit per pixel (voxel), ``S`` the spatial shape ``(H, W)``
  or ``(D, H, W)``; the hard prediction is ``logits > 0``. Shapes below are written for
  images, ``[B, H, W]``; every function takes volumes alike.
* ``masks [B, *S]`` int/float/bool in {0, 1} (1 = foreground).
* ``weights [B]`` float, optional: 1 = real image, 0 = padding row of a padded batch.
  ``None`` means every image is real. Weighted means divide by ``sum(weights)`` and are 0
  when it is 0.
* Metrics return PER-IMAGE values ``[B]`` unless said otherwise; the caller averages.

Standard metrics: :func:`dice`, :func:`iou`, :func:`hausdorff95` (medpy's ``hd95``),
and the losses :func:`soft_dice_loss`, :func:`bce_dice_loss`.

The FedRef authors' metrics (:func:`authors_soft_dice`, :func:`authors_soft_iou`,
:func:`authors_hd95`) reproduce what their evaluation code computes, which is NOT the
standard metrics (an activation applied twice, and a "Hausdorff 95" that is a row-wise
L2 distance). Our model has one logit ``z`` per pixel; their network has C-channel
logits. We map ``z`` to the two-class logits ``[0, z]`` (our choice: it is the natural
two-class equivalent since ``softmax([0, z]) = [1 - sigmoid z, sigmoid z]``), then apply
their pipeline to those two channels.

Streaming over test batches: :func:`evaluate_batch` returns additive SUMS, so the caller
adds the dicts of all batches (``jax.tree.map(jnp.add, ...)``) and calls :func:`summarize`
once. The authors' soft Dice/IoU are batch-POOLED (sums over images and pixels before the
ratio), so they cannot be summed per image; instead ``evaluate_batch`` returns their pooled
per-class pieces (``authors_inter``, ``authors_card``, ``authors_target``, each ``[2]``),
which are additive too, and :func:`summarize` forms the ratios over the whole test set —
the same value as :func:`authors_soft_dice` applied to the whole test set as one batch.
(If the authors averaged per-batch scores over their test loader instead, that value
depends on their batch size; call :func:`authors_soft_dice` per batch to mimic it.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

AUTHORS_SMOOTH = 1e-5  # smp DiceLoss/JaccardLoss(smooth=1e-5, eps=1e-7) as the authors configure them
AUTHORS_EPS = 1e-7
PAIRWISE_EPS = 1e-6  # torch.nn.PairwiseDistance's default eps, added to the difference


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
    """Per-image fraction of pixels where hard masks ``pred``, ``target [B, H, W]`` agree; ``[B]``."""
    agree = jnp.asarray(pred).astype(bool) == jnp.asarray(target).astype(bool)
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

    Non-members are sorted to the end as +inf; the interpolation index
    ``0.95 * (n - 1)`` is formed in exact integer arithmetic from the member count n.
    Meaningless (but finite or inf, never used) when n == 0.
    """
    srt = jnp.sort(jnp.where(members, values, jnp.inf))
    n = jnp.sum(members).astype(jnp.int32)
    m = jnp.maximum(n - 1, 0)  # 95 m / 100 split so that 95 m cannot overflow int32 on large volumes
    lo = 95 * (m // 100) + (95 * (m % 100)) // 100
    frac = ((95 * (m % 100)) % 100).astype(values.dtype) / 100.0
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    a, b = srt[lo], srt[hi]
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


def _authors_probs(logits):
    """The authors' double activation on our two-class logits ``[0, z]``.

    ``logits [B, H, W]`` -> ``[B, 2, H, W]``: step 1 (their model output -> ``sigmoid``):
    ``sigmoid([0, z]) = [0.5, sigmoid z]``; step 2 (smp's ``from_logits=True``, multiclass):
    a softmax over the class axis of those, giving foreground probability
    ``sigmoid(sigmoid(z) - 0.5)``, which lies in ``(sigmoid(-0.5), sigmoid(0.5)) ≈ (0.378, 0.622)``.
    """
    z = jnp.asarray(logits, jnp.float32)
    two = jnp.stack([jnp.zeros_like(z), z], axis=1)
    return jax.nn.softmax(jax.nn.sigmoid(two), axis=1)


def _onehot(masks):
    """``masks [B, H, W]`` -> one-hot ``[B, 2, H, W]`` float32 (channel 0 background, 1 foreground)."""
    fg = jnp.asarray(masks).astype(bool).astype(jnp.float32)
    return jnp.stack([1.0 - fg, fg], axis=1)


@jax.jit
def authors_pooled_stats(logits, masks, weights=None):
    """Batch-pooled per-class pieces of the authors' soft Dice/IoU (additive over batches).

    Args:
      logits: ``[B, H, W]``; masks: ``[B, H, W]``; weights: ``[B]`` or None.
    Returns:
      ``(inter, card, target)``, each ``[2]`` (background, foreground): sums over the real
      images and all pixels of ``p * t``, ``p + t`` and ``t``, with ``p`` from
      :func:`_authors_probs` and ``t`` the one-hot mask.
    """
    p, t = _authors_probs(logits), _onehot(masks)
    w = _weights_or_ones(weights, p.shape[0]).reshape((-1,) + (1,) * (p.ndim - 1))
    total = lambda x: jnp.sum(x * w, axis=(0,) + tuple(range(2, p.ndim)))
    return total(p * t), total(p + t), total(t)


def _authors_scores(inter, card, target):
    """smp's multiclass Dice and Jaccard "scores" (1 - loss) from the pooled pieces ``[2]``.

    Per class: ``dice_c = (2 I + s) / max(card + s, eps)``, ``jacc_c = (I + s) / max(card - I + s, eps)``;
    ``loss_c = 1 - score_c``, zeroed for classes absent from the targets; loss = mean over
    classes; returned score = ``1 - loss``. Returns ``(dice, iou)`` scalars.
    """
    present = (target > 0).astype(jnp.float32)
    s, eps = AUTHORS_SMOOTH, AUTHORS_EPS
    dice_c = (2.0 * inter + s) / jnp.maximum(card + s, eps)
    jacc_c = (inter + s) / jnp.maximum(card - inter + s, eps)
    score = lambda c: 1.0 - jnp.mean((1.0 - c) * present)
    return score(dice_c), score(jacc_c)


@jax.jit
def authors_soft_dice(logits, masks, weights=None):
    """The FedRef authors' "Dice", as the FedRef authors' code computes it; not the standard metric.

    Their pipeline: ``sigmoid`` on the C-channel network output, then
    segmentation_models_pytorch ``DiceLoss(mode="multiclass", from_logits=True,
    smooth=1e-5, eps=1e-7)``, which applies a softmax over the classes AGAIN, and they
    report ``1 - loss``. Our one logit per pixel becomes the two-class logits ``[0, z]``
    (see :func:`_authors_probs`). smp pools over the batch AND all pixels jointly per
    class; classes absent from the batch's targets count as loss 0 (see :func:`_authors_scores`).

    Args:
      logits: ``[B, H, W]``; masks: ``[B, H, W]`` in {0, 1}; weights: ``[B]`` or None
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

    Steps, per image: ``pred_map = sigmoid([0, z])`` ``[2, H, W]`` (channel 0 is 0.5
    everywhere, channel 1 is ``sigmoid z``; no softmax here); ``label`` = one-hot of the
    mask ``[2, H, W]``; torch's ``nn.PairwiseDistance()(pred_map, label)`` =
    ``|| pred_map - label + 1e-6 ||_2`` along the LAST axis (image width) -> ``[2, H]``;
    the max over channels and rows. (The authors take the max over their whole batch,
    which is the max of these per-image values.)

    Args:
      logits: ``[B, H, W]``; masks: ``[B, H, W]`` in {0, 1}.
    Returns:
      ``[B]`` float32.
    """
    z = jnp.asarray(logits, jnp.float32)
    pred_map = jax.nn.sigmoid(jnp.stack([jnp.zeros_like(z), z], axis=1))
    dist = jnp.sqrt(jnp.sum(jnp.square(pred_map - _onehot(masks) + PAIRWISE_EPS), axis=-1))  # [B, 2, H] ([B, 2, D, H])
    return jnp.max(dist, axis=tuple(range(1, dist.ndim)))


# ---------------------------------------------------------------------------- losses


def _per_image_soft_dice_loss(logits, masks, smooth):
    """``[B]``: ``1 - (2 sum(p t) + smooth) / (sum p + sum t + smooth)``, ``p = sigmoid(logits)``."""
    p = jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))
    t = jnp.asarray(masks, jnp.float32)
    inter = jnp.sum(p * t, axis=_spatial(p))
    card = jnp.sum(p, axis=_spatial(p)) + jnp.sum(t, axis=_spatial(t))
    return 1.0 - (2.0 * inter + smooth) / (card + smooth)


def _per_image_bce_dice(logits, masks, dice_weight, smooth=1.0):
    """``[B]``: per-image mean pixel BCE-with-logits + ``dice_weight`` * per-image soft Dice loss."""
    bce = optax.sigmoid_binary_cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(masks, jnp.float32))
    return jnp.mean(bce, axis=_spatial(bce)) + dice_weight * _per_image_soft_dice_loss(logits, masks, smooth)


@jax.jit
def soft_dice_loss(logits, masks, weights=None, smooth: float = 1.0):
    """Standard soft Dice loss on sigmoid probabilities, averaged over the real images.

    Per image ``1 - (2 sum(p t) + smooth) / (sum p + sum t + smooth)`` with
    ``p = sigmoid(logits)``; ``logits, masks [B, H, W]``, ``weights [B]`` or None.
    Returns a differentiable scalar.
    """
    return _weighted_mean(_per_image_soft_dice_loss(logits, masks, smooth), weights)


@jax.jit
def bce_dice_loss(logits, masks, weights=None, dice_weight: float = 1.0):
    """Mean pixel binary cross-entropy with logits + ``dice_weight`` * :func:`soft_dice_loss`.

    Both terms are averaged over the real images (``weights [B]``, None = all);
    ``logits, masks [B, H, W]``. The BCE is optax's numerically stable form. Returns a
    differentiable scalar.
    """
    return _weighted_mean(_per_image_bce_dice(logits, masks, dice_weight), weights)


# ---------------------------------------------------------------------------- streaming evaluation


@jax.jit
def evaluate_batch(logits, masks, weights=None) -> dict:
    """Additive SUMS over the real images of one test batch (see the module docstring).

    Args:
      logits: ``[B, H, W]``; masks: ``[B, H, W]`` in {0, 1}; weights: ``[B]`` (1 real, 0 padding) or None.
    Returns:
      dict of scalars: ``dice``, ``iou``, ``hd95``, ``pixel_accuracy`` (sums of the per-image
      metrics of ``logits > 0``), ``loss`` (sum of per-image BCE + soft Dice, so
      ``loss / count`` is :func:`bce_dice_loss` over the set), ``authors_hd95`` (sum of
      per-image :func:`authors_hd95`), ``count`` (number of real images); and the authors'
      pooled pieces ``authors_inter``, ``authors_card``, ``authors_target`` (each ``[2]``).
      Add these dicts over batches and pass the total to :func:`summarize`.
    """
    w = _weights_or_ones(weights, logits.shape[0])
    pred, target = logits > 0, jnp.asarray(masks).astype(bool)
    wsum = lambda v: jnp.sum(v * w)
    inter, card, tsum = authors_pooled_stats(logits, masks, w)
    return {
        "dice": wsum(dice(pred, target)),
        "iou": wsum(iou(pred, target)),
        "hd95": wsum(hausdorff95(pred, target)),
        "pixel_accuracy": wsum(pixel_accuracy(pred, target)),
        "loss": wsum(_per_image_bce_dice(logits, masks, 1.0)),
        "authors_hd95": wsum(authors_hd95(logits, masks)),
        "count": jnp.sum(w),
        "authors_inter": inter,
        "authors_card": card,
        "authors_target": tsum,
    }


@jax.jit
def summarize(sums: dict) -> dict:
    """Final metrics from the (batch-summed) output of :func:`evaluate_batch`.

    Returns the means over images of ``dice``, ``iou``, ``hd95``, ``pixel_accuracy``,
    ``loss``, ``authors_hd95`` (0 when ``count`` is 0), plus ``authors_dice`` and
    ``authors_iou`` pooled over the whole set, and ``count``.
    """
    count = sums["count"]
    safe = jnp.where(count > 0, count, 1.0)
    keys = ("dice", "iou", "hd95", "pixel_accuracy", "loss", "authors_hd95")
    out = {k: jnp.where(count > 0, sums[k] / safe, 0.0) for k in keys}
    out["authors_dice"], out["authors_iou"] = _authors_scores(
        sums["authors_inter"], sums["authors_card"], sums["authors_target"])
    out["count"] = count
    return out
