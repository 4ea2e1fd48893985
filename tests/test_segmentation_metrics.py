"""bfedjax.metrics.segmentation: hand-made cases, a scipy hd95 reference, the FedRef authors' metrics."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import ndimage

from bfedjax.metrics import segmentation as S

B = 4  # one batch shape for the logits-based tests, so the jitted functions compile once
ONES = np.ones(B, np.float32)


def _square(h, w, top, left, side):
    m = np.zeros((h, w), bool)
    m[top:top + side, left:left + side] = True
    return m


def _blobs(n, *shape, seed):
    """``n`` random smooth blob masks ``[n, *shape]`` (images or volumes; some touch the border)."""
    rng = np.random.default_rng(seed)
    noise = ndimage.gaussian_filter(rng.normal(size=(n, *shape)), sigma=(0,) + (3,) * len(shape))
    axes = tuple(range(1, len(shape) + 1))
    return noise > np.quantile(noise, 0.6, axis=axes, keepdims=True)


def _hd95_reference(pred, target):
    """medpy's hd95 steps with scipy: face-connected erosion (border_value=0), EDT to the other border."""
    cross = ndimage.generate_binary_structure(pred.ndim, 1)
    bp = pred ^ ndimage.binary_erosion(pred, structure=cross)
    bg = target ^ ndimage.binary_erosion(target, structure=cross)
    d_pg = ndimage.distance_transform_edt(~bg)[bp]
    d_gp = ndimage.distance_transform_edt(~bp)[bg]
    return np.percentile(np.concatenate([d_pg, d_gp]), 95)


def test_identical_masks_are_perfect():
    m = _blobs(B, 32, 32, seed=0)
    chex.assert_trees_all_close(S.dice(m, m), jnp.ones(B))
    chex.assert_trees_all_close(S.iou(m, m), jnp.ones(B))
    chex.assert_trees_all_close(S.hausdorff95(m, m), jnp.zeros(B))


def test_disjoint_masks_score_zero():
    p = _square(32, 32, 2, 2, 6)[None]
    g = _square(32, 32, 20, 20, 6)[None]
    chex.assert_trees_all_close(S.dice(p, g), jnp.zeros(1))
    chex.assert_trees_all_close(S.iou(p, g), jnp.zeros(1))
    # Nearest boundary points: corners (7, 7) and (20, 20): hd95 is at most their worst distance and > 0.
    assert 13 * np.sqrt(2) <= float(S.hausdorff95(p, g)[0]) <= 18 * np.sqrt(2)


@pytest.mark.parametrize("axis", [0, 1])
def test_translated_square(axis):
    # P: 10x10 square at rows/cols 5..14; G: the same square shifted by k = 2 pixels.
    # Boundaries are 36-pixel rings. d(P->G), counted by hand (shift along columns):
    #   P's left column (10 px): 2 (to G's left column, or corner to G's top/bottom edge end);
    #   P's top/bottom rows: 2 px at distance 1, 16 px on G's edges (0);
    #   P's right column rows 1..8 (inside G): min(row offset to G's top/bottom, 2) -> 2 px at 1, 6 px at 2.
    # So 16 values of 2, 4 of 1, 16 of 0; d(G->P) is the mirror image. Pooled: 72 values, 32 of them 2;
    # numpy's index 0.95 * 71 = 67.45 lies within the top 32 (indices 40..71), so hd95 = 2 exactly.
    # Dice: |P∩G| = 10 * 8 = 80, |P| + |G| = 200 -> 0.8; IoU = 80 / 120 = 2/3;
    # pixel accuracy = 1 - (200 - 160) / 1024.
    p = _square(32, 32, 5, 5, 10)
    g = np.roll(p, 2, axis=axis)
    p, g = p[None], g[None]
    chex.assert_trees_all_close(S.hausdorff95(p, g), jnp.array([2.0]), atol=1e-6)
    chex.assert_trees_all_close(S.hausdorff95(g, p), jnp.array([2.0]), atol=1e-6)
    chex.assert_trees_all_close(S.dice(p, g), jnp.array([0.8]), atol=1e-6)
    chex.assert_trees_all_close(S.iou(p, g), jnp.array([2 / 3]), atol=1e-6)
    chex.assert_trees_all_close(S.pixel_accuracy(p, g), jnp.array([1 - 40 / 1024]), atol=1e-6)
    np.testing.assert_allclose(_hd95_reference(p[0], g[0]), 2.0)  # the reference agrees with the hand count


def test_empty_mask_conventions():
    h, w = 32, 48
    empty = np.zeros((1, h, w), bool)
    full = _square(h, w, 3, 4, 5)[None]
    chex.assert_trees_all_close(S.dice(empty, empty), jnp.ones(1))
    chex.assert_trees_all_close(S.iou(empty, empty), jnp.ones(1))
    chex.assert_trees_all_close(S.hausdorff95(empty, empty), jnp.zeros(1))
    for a, b in [(empty, full), (full, empty)]:
        chex.assert_trees_all_close(S.dice(a, b), jnp.zeros(1))
        chex.assert_trees_all_close(S.iou(a, b), jnp.zeros(1))
        chex.assert_trees_all_close(S.hausdorff95(a, b), jnp.array([np.hypot(h, w)]), rtol=1e-6)


def test_boundary_treats_outside_as_background():
    m = _blobs(1, 24, 24, seed=3)[0]
    m[:, :3] = True  # certainly touches the border
    cross = ndimage.generate_binary_structure(2, 1)
    expected = m & ~ndimage.binary_erosion(m, structure=cross, border_value=0)
    np.testing.assert_array_equal(S.boundary(m), expected)
    full = np.ones((6, 7), bool)
    ring = full.copy()
    ring[1:-1, 1:-1] = False
    np.testing.assert_array_equal(S.boundary(full), ring)


@pytest.mark.parametrize("shape,seed", [((32, 32), 1), ((40, 56), 2)])
def test_hd95_matches_scipy_reference(shape, seed):
    p = _blobs(4, *shape, seed=seed)
    g = _blobs(4, *shape, seed=seed + 100)
    g[0] = ndimage.binary_dilation(p[0], iterations=2)  # one near-identical pair
    got = jax.jit(S.hausdorff95)(p, g)
    expected = np.array([_hd95_reference(a, b) for a, b in zip(p, g)])
    assert len(set(np.round(expected, 3))) > 1  # distinct, non-trivial values
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("shape,seed,elements", [((12, 20, 16), 3, None), ((9, 14, 11), 4, 1)])
def test_volume_metrics_match_scipy_and_numpy(shape, seed, elements, monkeypatch):
    """3-D masks: 6-connected boundaries, exact 3-D distances (elements=1: the query-by-query pass)."""
    if elements is not None:
        monkeypatch.setattr(S, "_BROADCAST_DISTANCE_ELEMENTS", elements)
    p = _blobs(3, *shape, seed=seed)
    g = _blobs(3, *shape, seed=seed + 100)
    g[0] = ndimage.binary_dilation(p[0], iterations=1)
    expected = np.array([_hd95_reference(a, b) for a, b in zip(p, g)])
    assert len(set(np.round(expected, 3))) > 1
    np.testing.assert_allclose(S.hausdorff95(p, g), expected, atol=1e-4)
    inter = (p & g).sum(axis=(1, 2, 3))
    np.testing.assert_allclose(S.dice(p, g), 2 * inter / (p.sum(axis=(1, 2, 3)) + g.sum(axis=(1, 2, 3))), rtol=1e-6)
    np.testing.assert_allclose(S.iou(p, g), inter / (p | g).sum(axis=(1, 2, 3)), rtol=1e-6)
    empty = np.zeros_like(p[:1])
    np.testing.assert_allclose(S.hausdorff95(empty, g[:1]), np.sqrt(sum(n * n for n in shape)), rtol=1e-6)
    logits = np.where(p, 2.0, -2.0).astype(np.float32)
    sums = S.evaluate_batch(logits, g)
    np.testing.assert_allclose(sums["hd95"], expected.sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["pixel_accuracy"], (p == g).mean(axis=(1, 2, 3)).sum(), rtol=1e-6)


def _smp_tversky(p, t, a, smooth=1e-5, eps=1e-7):
    """smp 0.5.0's soft_tversky_score pooled over everything: TP from the L1 difference, Dice at a = 1/2,
    Jaccard at a = 1."""
    tp = (p.sum() + t.sum() - np.abs(p - t).sum()) / 2
    return (tp + smooth) / max(tp + a * (p.sum() - tp) + a * (t.sum() - tp) + smooth, eps)


def _authors_dice_iou_numpy(logits, masks):
    """smp multiclass DiceLoss / JaccardLoss (smooth 1e-5, eps 1e-7) on softmax(sigmoid([0, z])), as 1 - loss."""
    z = np.asarray(logits, np.float64)
    s = 1.0 / (1.0 + np.exp(-np.stack([np.zeros_like(z), z], axis=1)))  # their sigmoid, [B, 2, H, W]
    e = np.exp(s)
    probs = e / e.sum(axis=1, keepdims=True)  # smp's softmax (from_logits=True)
    losses_d, losses_j = [], []
    for c in range(2):
        t = (masks == c).astype(np.float64)
        d, j = (_smp_tversky(probs[:, c], t, a) for a in (0.5, 1.0))
        present = float(t.sum() > 0)
        losses_d.append((1 - d) * present)
        losses_j.append((1 - j) * present)
    return 1 - np.mean(losses_d), 1 - np.mean(losses_j)


def test_authors_soft_dice_iou_match_numpy_reference():
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=3.0, size=(B, 16, 16)).astype(np.float32)
    masks = _blobs(B, 16, 16, seed=5).astype(np.int32)
    d_ref, j_ref = _authors_dice_iou_numpy(logits, masks)
    np.testing.assert_allclose(S.authors_soft_dice(logits, masks, ONES), d_ref, rtol=1e-5)
    np.testing.assert_allclose(S.authors_soft_iou(logits, masks, ONES), j_ref, rtol=1e-5)
    np.testing.assert_allclose(S.authors_soft_dice(logits, masks), d_ref, rtol=1e-5)  # weights=None
    # An all-background batch: the foreground class is absent, so its loss counts as 0.
    zeros = np.zeros_like(masks)
    d0, j0 = _authors_dice_iou_numpy(logits, zeros)
    np.testing.assert_allclose(S.authors_soft_dice(logits, zeros, ONES), d0, rtol=1e-5)
    np.testing.assert_allclose(S.authors_soft_iou(logits, zeros, ONES), j0, rtol=1e-5)
    assert d0 > d_ref  # the absent class's free "perfect" score


def test_authors_dice_of_perfect_prediction_is_squashed():
    # Hard-perfect logits (+-20): the true class gets probability a = sigmoid(sigmoid(20) - 0.5) ~ sigmoid(0.5)
    # = 0.6225 at every pixel. Per class, dice_c = 2 a n_c / (a n_c + (1 - a) n_other + n_c) <= 2a / (1 + a)
    # ~ 0.767, and with n_0 = n_1 it is exactly a.
    a = 1.0 / (1.0 + np.exp(-(1.0 / (1.0 + np.exp(-20.0)) - 0.5)))
    masks = np.zeros((B, 16, 16), np.int32)
    masks[:, :, :8] = 1  # equal class counts
    logits = np.where(masks == 1, 20.0, -20.0).astype(np.float32)
    np.testing.assert_allclose(S.authors_soft_dice(logits, masks, ONES), a, rtol=1e-5)
    blob = _blobs(B, 16, 16, seed=6).astype(np.int32)
    d = float(S.authors_soft_dice(np.where(blob == 1, 20.0, -20.0).astype(np.float32), blob, ONES))
    assert d <= 2 * a / (1 + a) + 1e-6
    assert float(S.dice(blob, blob).mean()) == 1.0


def test_authors_hd95_by_hand():
    # Image 0, row 0: mask [1, 0], logits [0, log 3] -> sigmoid [0.5, 0.75].
    #   channel 1: pred [0.5, 0.75] - label [1, 0] + eps -> sqrt((-0.5 + eps)^2 + (0.75 + eps)^2) ~ 0.901 (the max);
    #   channel 0: pred [0.5, 0.5] - label [0, 1] + eps -> ~0.707. Row 1: mask [0, 0], logits 0 -> ~0.707.
    # Image 1: all logits 0, mask all 1: channel 0 pred 0.5 - label 0 -> sqrt(2) * (0.5 + eps).
    eps = 1e-6
    logits = np.array([[[0.0, np.log(3.0)], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]], np.float32)
    masks = np.array([[[1, 0], [0, 0]], [[1, 1], [1, 1]]])
    expected = [np.hypot(-0.5 + eps, 0.75 + eps), np.sqrt(2) * (0.5 + eps)]
    np.testing.assert_allclose(S.authors_hd95(logits, masks), expected, rtol=1e-6)


def _bce_dice_numpy(logits, masks):
    x, t = np.asarray(logits, np.float64), np.asarray(masks, np.float64)
    bce = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))
    p = 1 / (1 + np.exp(-x))
    soft = 1 - (2 * (p * t).sum((1, 2)) + 1) / (p.sum((1, 2)) + t.sum((1, 2)) + 1)
    return bce.mean((1, 2)) + soft  # per image


def test_ce_dice_loss_value_and_descent():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(B, 16, 16)), jnp.float32)
    masks = _blobs(B, 16, 16, seed=8).astype(np.int32)
    np.testing.assert_allclose(S.ce_dice_loss(logits, masks, ONES), _bce_dice_numpy(logits, masks).mean(),
                               rtol=1e-5)
    loss_fn = jax.jit(lambda l: S.ce_dice_loss(l, masks, ONES))
    g = jax.grad(loss_fn)(logits)
    assert np.all(np.isfinite(g)) and float(jnp.abs(g).max()) > 0
    assert float(loss_fn(logits - 1.0 * g)) < float(loss_fn(logits))
    # The soft Dice part alone is differentiable too, and descends as well.
    gd = jax.grad(lambda l: S.soft_dice_loss(l, masks, ONES))(logits)
    assert float(S.soft_dice_loss(logits - 10.0 * gd, masks, ONES)) < float(S.soft_dice_loss(logits, masks, ONES))


def test_zero_weight_removes_padding_image():
    # Three real images plus one garbage padding row (weight 0): every batch-level value equals that of the
    # three real images alone (numpy references), and differs when the padding row is counted.
    rng = np.random.default_rng(9)
    logits = rng.normal(scale=2.0, size=(B, 16, 16)).astype(np.float32)
    masks = _blobs(B, 16, 16, seed=10).astype(np.int32)
    logits[-1], masks[-1] = 5.0, 0
    w = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
    x, t = logits[:3], masks[:3]
    p = 1 / (1 + np.exp(-x.astype(np.float64)))
    soft = np.mean(1 - (2 * (p * t).sum((1, 2)) + 1) / (p.sum((1, 2)) + t.sum((1, 2)) + 1))
    cases = [(S.soft_dice_loss, soft), (S.ce_dice_loss, _bce_dice_numpy(x, t).mean()),
             (S.authors_soft_dice, _authors_dice_iou_numpy(x, t)[0]),
             (S.authors_soft_iou, _authors_dice_iou_numpy(x, t)[1])]
    for fn, expected in cases:
        np.testing.assert_allclose(fn(logits, masks, w), expected, rtol=1e-5)
        assert abs(float(fn(logits, masks, ONES)) - expected) > 1e-3  # the padding row does matter
    np.testing.assert_allclose(S.soft_dice_loss(logits, masks, np.zeros(B, np.float32)), 0.0)  # no real image


def test_evaluate_batch_streams_to_whole_set_means():
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(5, 16, 16)) + 4 * (_blobs(5, 16, 16, seed=12) - 0.5)).astype(np.float32)
    masks = _blobs(5, 16, 16, seed=13).astype(np.int32)
    # Two batches of 4, the second padded with three garbage images of weight 0.
    lb = np.concatenate([logits, np.ones((3, 16, 16), np.float32)]).reshape(2, B, 16, 16)
    mb = np.concatenate([masks, np.ones((3, 16, 16), np.int32)]).reshape(2, B, 16, 16)
    wb = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    sums = jax.tree.map(jnp.add, S.evaluate_batch(lb[0], mb[0], wb[0]), S.evaluate_batch(lb[1], mb[1], wb[1]))
    out = S.summarize(sums)
    pred = logits > 0
    expected = {
        "dice": S.dice(pred, masks).mean(), "iou": S.iou(pred, masks).mean(),
        "hd95": np.mean([_hd95_reference(p, m.astype(bool)) for p, m in zip(pred, masks)]),
        "pixel_accuracy": (pred == masks.astype(bool)).mean(),
        "loss": _bce_dice_numpy(logits, masks).mean(),
        "authors_hd95": S.authors_hd95(logits, masks).mean(),
        "authors_dice": _authors_dice_iou_numpy(logits, masks)[0],
        "authors_iou": _authors_dice_iou_numpy(logits, masks)[1],
        "count": 5.0,
    }
    assert set(out) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(out[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert 0.0 < float(out["dice"]) < 1.0


# ---------------------------------------------------------------------------- classes (C logits per pixel)

C = 4  # FeTS's classes, the multi-class tests' one shape [B, 16, 16, C]


def _label_maps(seed):
    """``[B, 16, 16]`` label maps in 0..C-1 whose foreground classes all occur in every image."""
    a, b, c = (_blobs(B, 16, 16, seed=seed + i) for i in range(3))
    labels = np.where(a, 1, 0)
    labels = np.where(b & ~a, 2, labels)
    labels = np.where(c & ~a & ~b, 3, labels)
    assert all(set(np.unique(m)) == set(range(C)) for m in labels)
    return labels.astype(np.int32)


def _logits_of(labels, scale=4.0, noise=0.0, seed=0):
    """Class logits ``[B, 16, 16, C]`` whose argmax is ``labels`` (for ``noise`` small)."""
    onehot = np.eye(C, dtype=np.float32)[labels]
    return (scale * onehot + noise * np.random.default_rng(seed).normal(size=onehot.shape)).astype(np.float32)


def test_one_binary_logit_equals_its_two_class_logits():
    rng = np.random.default_rng(11)
    z = rng.normal(scale=2.0, size=(B, 16, 16)).astype(np.float32)
    masks = _blobs(B, 16, 16, seed=12).astype(np.int32)
    two = np.stack([np.zeros_like(z), z], axis=-1)
    np.testing.assert_array_equal(S.hard_labels(z, masks), S.hard_labels(two, masks))
    for loss in S.LOSSES:
        one, pair = S.evaluate_batch(z, masks, ONES, loss=loss), S.evaluate_batch(two, masks, ONES, loss=loss)
        assert set(one) == set(pair) and "dice_class1" not in one  # per-class Dice only above two classes
        for name in one:
            np.testing.assert_allclose(one[name], pair[name], rtol=2e-5, atol=1e-6, err_msg=f"{loss} {name}")
    with pytest.raises(ValueError, match=r"\[B, \*S, C\]"):
        S.class_logits(z[..., None, None], masks)


def test_classes_metrics_average_the_foreground_classes():
    target = _label_maps(20)
    pred = np.roll(target, 2, axis=2)  # every class shifted two columns: all still present
    pred[:, :, :2] = target[:, :, :2]
    sums = S.evaluate_batch(_logits_of(pred, noise=0.5, seed=1), target, ONES)
    dice_c = np.array([[2 * ((p == c) & (t == c)).sum() / ((p == c).sum() + (t == c).sum()) for c in range(1, C)]
                       for p, t in zip(pred, target)])  # [B, C-1]
    iou_c = np.array([[((p == c) & (t == c)).sum() / ((p == c) | (t == c)).sum() for c in range(1, C)]
                      for p, t in zip(pred, target)])
    hd_c = np.array([[_hd95_reference(p == c, t == c) for c in range(1, C)] for p, t in zip(pred, target)])
    np.testing.assert_allclose(sums["dice"], dice_c.mean(axis=1).sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["iou"], iou_c.mean(axis=1).sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["hd95"], hd_c.mean(axis=1).sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["pixel_accuracy"], (pred == target).mean(axis=(1, 2)).sum(), rtol=1e-6)
    for c in range(1, C):
        np.testing.assert_allclose(sums[f"dice_class{c}"], dice_c[:, c - 1].sum(), rtol=1e-5)
    assert "dice_class4" not in sums and sums["authors_inter"].shape == (C,)
    assert float(sums["dice"]) < B and float(sums["hd95"]) > 0  # the shift costs something
    perfect = S.summarize(S.evaluate_batch(_logits_of(target), target, ONES))
    assert float(perfect["dice"]) == 1.0 and float(perfect["hd95"]) == 0.0 and float(perfect["dice_class3"]) == 1.0


def _ce_dice_numpy(logits, labels):
    """Per image: mean softmax cross-entropy + mean over classes 1..C-1 of 1 - (2 sum p t + 1) / (sum p + sum t + 1)."""
    x = np.asarray(logits, np.float64)
    log_p = x - x.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    t = np.eye(x.shape[-1])[labels]
    ce = -(log_p * t).sum(-1).mean(axis=(1, 2))
    p = np.exp(log_p)
    soft = 1 - (2 * (p * t).sum((1, 2)) + 1) / (p.sum((1, 2)) + t.sum((1, 2)) + 1)  # [B, C]
    return ce + soft[:, 1:].mean(axis=1)


def _smp_dice_focal_numpy(logits, labels, alpha=0.1, gamma=4.5):
    """segmentation_models_pytorch 0.5.0's multiclass DiceLoss(from_logits, smooth 1e-5, eps 1e-7) and
    FocalLoss(alpha, gamma, normalized=True), their steps in float64 (results/fedref_losses_check compares
    bfedjax with smp's own classes)."""
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    dice_losses, focal = [], 0.0
    for c in range(x.shape[-1]):
        t = (labels == c).astype(np.float64)
        dice_losses.append((1 - _smp_tversky(p[..., c], t, 0.5)) * float(t.sum() > 0))
        z = x[..., c]
        bce = np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))
        term = (1 - np.exp(-bce)) ** gamma
        focal += np.mean(term * bce * (alpha * t + (1 - alpha) * (1 - t)) / max(term.sum(), 1e-6))
    return np.mean(dice_losses), focal


def test_classes_losses_match_numpy_references_and_descend():
    target = _label_maps(30)
    logits = np.random.default_rng(31).normal(scale=2.0, size=(B, 16, 16, C)).astype(np.float32)
    np.testing.assert_allclose(S.ce_dice_loss(logits, target, ONES), _ce_dice_numpy(logits, target).mean(), rtol=1e-5)
    dice_ref, focal_ref = _smp_dice_focal_numpy(logits, target)
    np.testing.assert_allclose(S.authors_dice_loss(logits, target, ONES), dice_ref, rtol=1e-5)
    np.testing.assert_allclose(S.authors_focal_loss(logits, target, ONES), focal_ref, rtol=1e-5)
    np.testing.assert_allclose(S.dice_focal_loss(logits, target), dice_ref + focal_ref, rtol=1e-5)
    # a zero-weight (padding) image drops out of every sum and count, the focal loss's element count included
    w = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
    dice3, focal3 = _smp_dice_focal_numpy(logits[:3], target[:3])
    np.testing.assert_allclose(S.dice_focal_loss(logits, target, w), dice3 + focal3, rtol=1e-5)
    np.testing.assert_allclose(S.ce_dice_loss(logits, target, w), _ce_dice_numpy(logits[:3], target[:3]).mean(),
                               rtol=1e-5)
    # an absent class counts as zero Dice loss but stays in smp's mean over all C classes
    no_three = np.where(target == 3, 0, target)
    np.testing.assert_allclose(S.authors_dice_loss(logits, no_three, ONES), _smp_dice_focal_numpy(logits, no_three)[0],
                               rtol=1e-5)
    for name in ("ce_dice", "dice_focal"):
        fn = jax.jit(lambda l, name=name: S.LOSSES[name](l, target, ONES))
        g = jax.grad(fn)(logits)
        assert float(fn(logits - 0.5 * g / float(jnp.abs(g).max()))) < float(fn(logits)), name
    with pytest.raises(ValueError, match="fix: one of ce_dice, focal, dice_focal"):
        S.loss_fn("bce")


def test_authors_focal_loss_shrinks_with_the_pixel_count_unlike_ce_dice():
    """smp's normalised Focal loss is a weighted mean of BCE divided once more by the number of elements, so the
    same images tiled 2x2 (4x the pixels, the same per-pixel errors) give a quarter of the loss, while ce_dice, a
    per-pixel mean, stays put: at the authors' lr a U-Net barely trains (results/fedref.md, section (d))."""
    target = _label_maps(41)
    logits = np.random.default_rng(42).normal(size=(B, 16, 16, C)).astype(np.float32)
    tiled = lambda a: np.tile(a, (1, 2, 2) + (1,) * (a.ndim - 3))
    focal, focal_tiled = (float(S.authors_focal_loss(l, t, ONES)) for l, t in ((logits, target),
                                                                              (tiled(logits), tiled(target))))
    np.testing.assert_allclose(focal_tiled, focal / 4, rtol=1e-5)
    np.testing.assert_allclose(S.ce_dice_loss(tiled(logits), tiled(target), ONES),
                               S.ce_dice_loss(logits, target, ONES), rtol=1e-2)  # Dice's smoothing term: 0.2%


def test_classes_absent_from_an_image_follow_the_binary_conventions():
    target = _label_maps(40)
    pred = target.copy()
    target[0][target[0] == 3], pred[0][pred[0] == 3] = 0, 0  # image 0: class 3 in neither -> Dice 1, HD95 0
    pred[1][pred[1] == 2] = 0  # image 1: class 2 only in the target -> Dice 0, HD95 the diagonal
    sums = S.evaluate_batch(_logits_of(pred), target, ONES)
    per_image_dice = np.array([1.0, (1 + 0 + 1) / 3, 1.0, 1.0])
    np.testing.assert_allclose(sums["dice"], per_image_dice.sum(), rtol=1e-6)
    np.testing.assert_allclose(sums["dice_class2"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(sums["dice_class3"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(sums["hd95"], np.sqrt(2 * 16.0 ** 2) / 3, rtol=1e-6)
    np.testing.assert_allclose(sums["iou"], per_image_dice.sum(), rtol=1e-6)


def test_regions_score_unions_of_classes():
    # BraTS's regions in FeTS's labels 1, 2, 4 (mapped to 1, 2, 3): whole tumour 1+2+4, core 1+4, enhancing 4
    assert S.FETS_REGIONS == (("whole_tumour", (1, 2, 3)), ("tumour_core", (1, 3)), ("enhancing_tumour", (3,)))
    target = _label_maps(50)
    pred = np.roll(target, 1, axis=1)
    sums = S.evaluate_batch(_logits_of(pred), target, ONES, regions=S.FETS_REGIONS)
    for name, classes in S.FETS_REGIONS:
        p, t = np.isin(pred, classes), np.isin(target, classes)
        expected = 2 * (p & t).sum((1, 2)) / (p.sum((1, 2)) + t.sum((1, 2)))
        np.testing.assert_allclose(sums[f"dice_{name}"], expected.sum(), rtol=1e-5, err_msg=name)
        hd = sum(_hd95_reference(a, b) for a, b in zip(p, t))
        np.testing.assert_allclose(sums[f"hd95_{name}"], hd, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(sums["dice_enhancing_tumour"], sums["dice_class3"], rtol=1e-6)
    assert float(sums["dice_whole_tumour"]) > float(sums["dice_enhancing_tumour"])  # a larger mask, a smaller shift


@pytest.mark.parametrize("regions,fix", [
    ((("class1", (1, 2)),), "another name"),  # would overwrite dice_class1
    ((("core", (1,)), ("core", (1, 3))), "one name per region"),
    ((("whole tumour", (1, 2)),), "a Python identifier"),
    ((("core", ()),), "foreground labels >= 1"),
    ((("all", (0, 1)),), "foreground labels >= 1"),
])
def test_segmentation_task_refuses_regions_whose_metrics_would_collide(regions, fix):
    from bfedjax import models, tasks
    assert S.checked_regions([["core", [1, 3]]]) == (("core", (1, 3)),)  # lists in, hashable tuples out
    with pytest.raises(ValueError, match=f"fix: .*{re.escape(fix)}"):
        tasks.segmentation(models.UNet(out_channels=4), regions=regions)
    with pytest.raises(ValueError, match=r"'vessel' has classes \(2,\), but the logits have 2 classes; fix: labels 1..1"):
        S.evaluate_batch(np.zeros((1, 4, 4), np.float32), np.zeros((1, 4, 4), np.int32), regions=(("vessel", (2,)),))


def test_authors_hd95_on_class_logits_of_volumes():
    """Their torch layout [B, C, D, H, W]: PairwiseDistance along the last axis (W), then the max."""
    rng = np.random.default_rng(60)
    logits = rng.normal(scale=2.0, size=(2, 3, 4, 5, C)).astype(np.float32)  # [B, D, H, W, C], no two sizes equal
    masks = rng.integers(0, C, size=(2, 3, 4, 5))
    pred_map = 1 / (1 + np.exp(-np.moveaxis(logits.astype(np.float64), -1, 1)))  # [B, C, D, H, W]
    onehot = np.moveaxis(np.eye(C)[masks], -1, 1)
    expected = np.sqrt(np.square(pred_map - onehot + 1e-6).sum(axis=-1)).max(axis=(1, 2, 3))
    np.testing.assert_allclose(S.authors_hd95(logits, masks), expected, rtol=1e-6)
    wrong_axis = np.sqrt(np.square(pred_map - onehot + 1e-6).sum(axis=-2)).max(axis=(1, 2, 3))
    assert not np.allclose(expected, wrong_axis, rtol=1e-3)
