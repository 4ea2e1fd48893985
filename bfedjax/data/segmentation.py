"""Binary segmentation data sets: procedural "vessels", noisy digits' foregrounds, real DRIVE retinas and
Oxford-IIIT Pet.

All return the :class:`~bfedjax.data.sources.Dataset` of classification sets
with per-pixel labels: ``x_* [n, H, W, C]`` float32 (``C = 1`` for vessels and
DRIVE, 3 for the pets) and ``y_* [n, H, W]`` int32 masks in {0, 1}
(1 = vessel / pet), ``num_classes = 2``. They are reached through
``bfedjax.data.load("vessels" | "drive" | "oxford_iiit_pet", ...)``, which skips
the stratified label subsampling of the classification sets (it needs ``[n]``
labels).

* :func:`vessels`: an offline, seeded stand-in for retinal-vessel
  segmentation. Each image holds a few smooth curves (cubic Bezier curves,
  some branching off the first one) 1-2 px wide; the image is a smooth
  illumination field (linear gradient, vignette, a faint low-frequency wave)
  plus the vessels, all darker or all brighter than their surroundings with a
  contrast drawn per curve, plus Gaussian noise. The illumination varies more
  across an image than the weakest vessels' contrast, so no global threshold
  separates them (tested); local structure does.
* :func:`foreground`: FedRef spec section 7c's packaged-data proxy, the
  foreground (clean pixel > 0.5) of MNIST-5k, Fashion-MNIST or MNIST images
  given with Gaussian noise (std 0.3) added; ``load("mnist_5k_foreground")``.
* :func:`load_drive`: the DRIVE data set (40 colour fundus photographs,
  565x584, with manual vessel annotations) from its standard folder layout.
* :func:`load_tfds_segmentation`: Oxford-IIIT Pet (7,349 photographs of cats
  and dogs with pet / background / border trimaps) read from prepared TFDS
  ``array_record`` data; the mask is pet-or-border vs background.
* :func:`load_fets`: FeTS 2021/2022 brain-tumour MRI (one folder per subject,
  institutions from ``partitioning_1.csv``) reduced to 2-D: axial FLAIR slices
  with whole-tumour masks; the set also records each training slice's
  institution (``Dataset.client_ids``), which :func:`institution_parts` turns
  into one client per institution. :func:`load_fets_volumes` keeps each subject's
  whole FLAIR volume instead (``x [n, D, H, W, 1]``, ``y [n, D, H, W]``), for
  :class:`~bfedjax.models.UNet3D`.
"""
from __future__ import annotations

import csv
import glob
import os
import re

import numpy as np

from bfedjax.data.sources import (FOREGROUND_SOURCES, PIXELS, Dataset, DataUnavailableError, _get_many, _short,
                                  _tfds_remedy, tfds_quiet)

__all__ = ["vessels", "foreground", "load_drive", "load_fets", "load_fets_volumes", "fets_config", "FETS_LABELS", "institution_parts", "load_tfds_segmentation", "load_segmentation",
           "trimap_to_mask"]

_DRIVE_FIX = ("fix: pass --data_dir=DIR holding DRIVE's training/ and test/ folders "
              "(download from the DRIVE challenge site)")


# --------------------------------------------------------------------------
# Shared packing
# --------------------------------------------------------------------------


_STATS_CHUNK_ELEMENTS = 2 ** 24  # rows are promoted to float64 about this many values at a time (one row at least)


def _mean_std(x: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 mean and standard deviation of float32 ``x [n, ...]`` (over everything, or per last-axis
    channel), as float32; the std floored at 1e-12. Rows are promoted to float64 a chunk at a time, so no
    float64 copy of the whole set is made (300 native FeTS volumes are about 11 GB in float32, 21 GB in float64)."""
    axes = tuple(range(x.ndim - 1)) if per_channel else None
    mean = x.mean(axis=axes, dtype=np.float64)
    rows = max(1, _STATS_CHUNK_ELEMENTS // max(1, x[:1].size))
    squares = sum(np.sum(np.square(x[i:i + rows].astype(np.float64) - mean), axis=axes)
                  for i in range(0, len(x), rows))
    std = np.sqrt(squares / (x.size // (x.shape[-1] if per_channel else 1)))
    return np.asarray(mean, np.float32), np.asarray(np.maximum(std, 1e-12), np.float32)


def _standardised(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(x - mean) / std`` as one new float32 array (the division in place: the peak is ``x`` and one copy)."""
    out = np.subtract(x, mean, dtype=np.float32)
    out /= std
    return out


def _pack(name: str, x_train, y_train, x_test, y_test, source: str, pixels: str, client_ids=None,
          num_classes: int = 2) -> Dataset:
    """Images ``[n, H, W]`` or ``[n, H, W, C]`` (or volumes ``[n, D, H, W, 1]``) in [0, 1] and masks ``[n, H, W]``
    (``[n, D, H, W]``) -> a segmentation :class:`Dataset`.

    ``pixels="standardised"`` applies ``(x - mean) / std`` with the training
    set's statistics to both splits: one scalar mean and std for ``[n, H, W]``
    images and for volumes, one per channel for ``[n, H, W, C]``; ``"unit"`` keeps [0, 1].
    ``[n, H, W]`` images get a trailing channel axis. ``client_ids`` (optional,
    ``[n_train]``) becomes ``Dataset.client_ids`` as int32; masks hold labels ``0..num_classes-1``.
    An empty training split is a ``ValueError`` (with either ``pixels``).
    """
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; choose one of {PIXELS}")
    x_train, x_test = (np.asarray(x, np.float32) for x in (x_train, x_test))
    if len(x_train) == 0:
        raise ValueError(f"{name}: the training split is empty; fix: a --data_dir whose training split holds "
                         "images (volumes), or a larger --max_train")
    if pixels == "standardised":
        mean, std = _mean_std(x_train, per_channel=x_train.ndim == 4)  # per channel, else one scalar
        x_train, x_test = (_standardised(x, mean, std) for x in (x_train, x_test))
    if x_train.ndim == 3:
        x_train, x_test = x_train[..., None], x_test[..., None]
    return Dataset(name=name, x_train=np.ascontiguousarray(x_train, np.float32),
                   y_train=np.ascontiguousarray(y_train, np.int32),
                   x_test=np.ascontiguousarray(x_test, np.float32),
                   y_test=np.ascontiguousarray(y_test, np.int32), num_classes=int(num_classes), source=source,
                   client_ids=None if client_ids is None else np.ascontiguousarray(client_ids, np.int32))


# --------------------------------------------------------------------------
# Procedural vessels
# --------------------------------------------------------------------------


def _bezier(ctrl: np.ndarray, steps: int) -> np.ndarray:
    """Cubic Bezier points: control points ``[..., 4, 2]`` -> ``[..., steps, 2]``."""
    t = np.linspace(0.0, 1.0, steps)[:, None]
    basis = np.concatenate([(1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t ** 2 * (1 - t), t ** 3], axis=1)  # [T, 4]
    return basis @ ctrl


def _curves(rng: np.random.Generator, n: int, k: int, size: int) -> np.ndarray:
    """``[n, k, T, 2]`` points (row, col) of ``k`` curves per image; curves >= 1 branch off curve 0 half the time."""
    steps = 8 * size  # a curve is rarely longer than ~2 * size: spacing well under 0.5 px keeps it connected
    ctrl = rng.uniform(-0.1, 1.1, size=(n, k, 4, 2)) * (size - 1)
    first = _bezier(ctrl[:, 0], steps)  # [n, T, 2]
    at = rng.integers(steps // 8, steps - steps // 8, size=(n, k))
    branch = rng.random((n, k)) < 0.5
    branch[:, 0] = False
    ctrl[:, :, 0] = np.where(branch[..., None], first[np.arange(n)[:, None], at], ctrl[:, :, 0])
    return _bezier(ctrl, steps)


def _rasterise(points: np.ndarray, radius: np.ndarray, size: int) -> np.ndarray:
    """Curve index map ``[n, size, size]`` int8: 1 + the last curve within ``radius`` of a pixel centre, else 0.

    Args:
      points: ``[n, k, T, 2]`` densely sampled curve points (pixel centres are integer coordinates).
      radius: ``[n, k]`` half widths (<= 1.5, so the 3x3 pixels around a point suffice); 0 draws nothing.
    """
    n, k, steps, _ = points.shape
    keep = np.broadcast_to((radius > 0)[..., None], (n, k, steps)) & ((points > -2) & (points < size + 1)).all(-1)
    img, curve, _ = np.nonzero(keep)  # one entry per drawn point, flat
    p, r2 = points[keep], radius[img, curve] ** 2
    centre = np.rint(p).astype(np.int64)
    frac = p - centre
    out = np.zeros(n * size * size, np.int8)
    for dr in (-1, 0, 1):
        for dc in (-1, 0, 1):
            row, col = centre[:, 0] + dr, centre[:, 1] + dc
            hit = ((dr - frac[:, 0]) ** 2 + (dc - frac[:, 1]) ** 2 <= r2) & (row >= 0) & (row < size) & (
                col >= 0) & (col < size)
            out[(img[hit] * size + row[hit]) * size + col[hit]] = curve[hit] + 1
    return out.reshape(n, size, size)


def _illumination(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``[n, size, size]`` smooth background: level + linear gradient (slope 0.25-0.6) - vignette + a low-frequency wave."""
    u = np.linspace(-0.5, 0.5, size)
    rows, cols = u[None, :, None], u[None, None, :]
    draw = lambda lo, hi: rng.uniform(lo, hi, size=(n, 1, 1))  # noqa: E731
    level, slope, angle, vignette = draw(0.35, 0.65), draw(0.25, 0.6), draw(0.0, 2 * np.pi), draw(0.0, 0.8)
    g_r, g_c = slope * np.cos(angle), slope * np.sin(angle)  # the gradient is never flat
    f_r, f_c, phase, wave = draw(-2.0, 2.0), draw(-2.0, 2.0), draw(0.0, 2 * np.pi), draw(0.0, 0.1)
    return (level + g_r * rows + g_c * cols - vignette * (rows ** 2 + cols ** 2)
            + wave * np.cos(2 * np.pi * (f_r * rows + f_c * cols) + phase))


def _draw_vessels(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images ``[n, size, size]`` float32 in [0, 1] and masks ``[n, size, size]`` int32.

    Per image: 2-4 curves (scaled by ``size / 32``), half widths U(0.5, 0.95) px
    (1-2 px lines), contrasts U(0.12, 0.45) per curve, one polarity per image
    (70% dark vessels, as in DRIVE's green channel), noise sd U(0.02, 0.06).
    """
    scale = size / 32
    lo, hi = max(1, round(2 * scale)), max(2, round(4 * scale))
    count = rng.integers(lo, hi + 1, size=n)
    active = np.arange(hi)[None, :] < count[:, None]  # [n, hi]
    radius = np.where(active, rng.uniform(0.5, 0.95, size=(n, hi)), 0.0)
    which = _rasterise(_curves(rng, n, hi, size), radius, size)  # [n, size, size], 0 = background
    contrast = np.concatenate([np.zeros((n, 1)), rng.uniform(0.12, 0.45, size=(n, hi))], axis=1)
    polarity = np.where(rng.random((n, 1, 1)) < 0.7, -1.0, 1.0)
    vessel = np.take_along_axis(contrast, which.reshape(n, -1).astype(np.int64), axis=1).reshape(which.shape)
    noise = rng.normal(size=(n, size, size)) * rng.uniform(0.02, 0.06, size=(n, 1, 1))
    x = np.clip(_illumination(rng, n, size) + polarity * vessel + noise, 0.0, 1.0)
    return x.astype(np.float32), (which > 0).astype(np.int32)


def vessels(num_train: int = 400, num_test: int = 100, size: int = 32, seed: int = 0,
            pixels: str = "standardised") -> Dataset:
    """Procedural thin-vessel segmentation set (a seeded, offline DRIVE stand-in; see the module docstring).

    Train and test come from the independent streams ``default_rng([seed, 0])``
    and ``default_rng([seed, 1])``; vessels cover about 5-15% of the pixels.

    Args:
      num_train, num_test: number of images per split (>= 1).
      size: image side ``S`` (>= 8).
      seed: generator seed; the same arguments always give the same arrays.
      pixels: ``"standardised"`` (training mean/std) or ``"unit"`` ([0, 1]).

    Returns:
      ``Dataset(name="vessels")`` with ``x_* [n, S, S, 1]`` float32, ``y_* [n, S, S]`` int32 in {0, 1}.
    """
    if min(num_train, num_test) < 1 or size < 8:
        raise ValueError(f"vessels: need num_train, num_test >= 1 and size >= 8, got "
                         f"{num_train}, {num_test}, {size}")
    train = _draw_vessels(np.random.default_rng([seed, 0]), int(num_train), int(size))
    test = _draw_vessels(np.random.default_rng([seed, 1]), int(num_test), int(size))
    return _pack("vessels", *train, *test, f"procedural:vessels(seed={seed})", pixels)


# --------------------------------------------------------------------------
# Foreground masks of classification images (FedRef spec section 7c)
# --------------------------------------------------------------------------

FOREGROUND_THRESHOLD, FOREGROUND_NOISE_STD = 0.5, 0.3  # FedRef spec section 7c


def foreground(dataset: Dataset, threshold: float = FOREGROUND_THRESHOLD, noise_std: float = FOREGROUND_NOISE_STD,
               seed: int = 0, pixels: str = "standardised") -> Dataset:
    """Foreground segmentation of grey images (FedRef spec section 7c's packaged-data proxy for DRIVE).

    The mask is ``clean pixel > threshold``; the input is the clean image plus Gaussian noise of std
    ``noise_std``, so thresholding the input misses pixels a net can recover from their neighbours (at the
    defaults, cutting the 100 noisy test digits of ``experiments.fedref_table``'s section (d) at 0.5 gives
    Dice 0.762 and HD95 6.6 pixels, its "threshold" row). The noise of the two splits comes from the
    independent streams ``default_rng([seed, 0])`` and ``default_rng([seed, 1])``.

    Args:
      dataset: a classification set loaded with ``pixels="unit"``: ``x_* [n, H, W, 1]`` in [0, 1].
      threshold: foreground level of the clean pixels, in (0, 1).
      noise_std: std of the added noise (>= 0; 0 gives the clean images).
      seed: noise seed; the same arguments always give the same arrays.
      pixels: of the noisy inputs, ``"standardised"`` (training mean / std) or ``"unit"`` (left unscaled,
        so noisy pixels leave [0, 1]).

    Returns:
      ``Dataset(name=f"{dataset.name}_foreground")`` with ``x_* [n, H, W, 1]`` float32 and ``y_* [n, H, W]``
      int32 in {0, 1}, ``num_classes = 2``.
    """
    if dataset.x_train.ndim != 4 or dataset.x_train.shape[-1] != 1:
        raise ValueError(f"foreground: needs grey images [n, H, W, 1], got {dataset.name}'s x_train of shape "
                         f"{dataset.x_train.shape}; fix: use one of {', '.join(FOREGROUND_SOURCES)}")
    if any(x.size and (x.min() < 0.0 or x.max() > 1.0) for x in (dataset.x_train, dataset.x_test)):
        raise ValueError(f"foreground: {dataset.name}'s pixels leave [0, 1]; fix: load it with pixels='unit'")
    if not 0.0 < threshold < 1.0 or noise_std < 0.0:
        raise ValueError(f"foreground: threshold={threshold}, noise_std={noise_std}; fix: a threshold in (0, 1) and "
                         "noise_std >= 0 (the spec's 0.5 and 0.3)")
    splits = []
    for index, clean in enumerate((dataset.x_train[..., 0], dataset.x_test[..., 0])):
        noise = np.random.default_rng([seed, index]).standard_normal(clean.shape, dtype=np.float32)
        splits += [clean + np.float32(noise_std) * noise, (clean > threshold).astype(np.int32)]
    return _pack(f"{dataset.name}_foreground", *splits,
                 f"{dataset.source}:foreground(threshold={threshold}, noise_std={noise_std}, seed={seed})", pixels)


# --------------------------------------------------------------------------
# DRIVE
# --------------------------------------------------------------------------


def _drive_split(folder: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One DRIVE split folder -> (green channel ``[n, size, size]`` in [0, 1], masks ``[n, size, size]``).

    Image ``images/<id>_<split>.tif`` pairs with ``1st_manual/<id>_manual1.gif``.
    The green channel is DRIVE practice: it has the best vessel contrast.
    Images are resized bilinearly, masks nearest-neighbour and then ``> 127``.
    """
    from PIL import Image

    manual = os.path.join(folder, "1st_manual")
    images = sorted(glob.glob(os.path.join(folder, "images", "*.tif")))
    pairs = [(p, glob.glob(os.path.join(manual, os.path.basename(p).split("_")[0] + "_*.gif"))) for p in images]
    missing = [os.path.basename(p) for p, m in pairs if not m]
    if missing:
        raise DataUnavailableError(
            f"drive: no manual annotation in {manual} for {missing[:3]} ({len(missing)} of {len(images)} images; "
            f"some DRIVE copies ship without test/1st_manual); {_DRIVE_FIX}")
    xs, ys = [], []
    for image, (mask, *_) in pairs:
        with Image.open(image) as im:
            green = im.convert("RGB").getchannel("G").resize((size, size), Image.BILINEAR)
        with Image.open(mask) as m:
            mask_arr = np.asarray(m.convert("L").resize((size, size), Image.NEAREST))
        xs.append(np.asarray(green, np.float32) / 255.0)
        ys.append((mask_arr > 127).astype(np.int32))
    return np.stack(xs), np.stack(ys)


def load_drive(data_dir: str | None, size: int = 64, *, pixels: str = "standardised") -> Dataset:
    """The DRIVE retinal-vessel set from ``data_dir`` (``training/`` and ``test/`` folders).

    Layout: ``{training,test}/images/*.tif`` and ``{training,test}/1st_manual/*.gif``
    (other folders, e.g. the field-of-view ``mask/``, are ignored).

    Args:
      data_dir: the folder holding ``training/`` and ``test/``.
      size: side ``S`` the images and masks are resized to.
      pixels: ``"standardised"`` (training mean/std) or ``"unit"``.

    Returns:
      ``Dataset(name="drive")``: ``x_* [n, S, S, 1]`` float32 (green channel), ``y_* [n, S, S]`` int32 in {0, 1}
      (20 + 20 images in the full set).

    Raises:
      DataUnavailableError: a folder is missing or empty, or an image has no manual annotation
        (e.g. a copy without ``test/1st_manual``).
    """
    root = os.path.expanduser(data_dir) if data_dir else None
    for split in ("training", "test"):
        for sub in ("images", "1st_manual"):
            folder = os.path.join(root, split, sub) if root else None
            if folder is None or not os.path.isdir(folder) or not os.listdir(folder):
                what = "no --data_dir given" if root is None else f"{folder} is missing or empty"
                hint = " (some DRIVE copies ship without the test annotations)" if (split, sub) == (
                    "test", "1st_manual") and root else ""
                raise DataUnavailableError(f"drive: {what}{hint}; {_DRIVE_FIX}")
    train = _drive_split(os.path.join(root, "training"), int(size))
    test = _drive_split(os.path.join(root, "test"), int(size))
    return _pack("drive", *train, *test, f"drive:{root}", pixels)


def _subset(n: int, max_n: int | None, seed: int, split: int) -> np.ndarray | None:
    """Sorted indices of a seeded random subset of ``max_n`` of ``n`` items (``default_rng([seed, split])``);
    None (keep all) when ``max_n`` is None or ``>= n``."""
    if max_n is not None and max_n < 1:
        raise ValueError(f"max_train/max_test must be >= 1, got {max_n}; fix: pass a positive count or None")
    if max_n is None or max_n >= n:
        return None
    return np.sort(np.random.default_rng([seed, split]).choice(n, size=max_n, replace=False))


def _limit(dataset: Dataset, max_train: int | None, max_test: int | None, seed: int) -> Dataset:
    """A seeded random subset of at most ``max_train`` / ``max_test`` images (order kept); None keeps all.

    ``client_ids`` (when set) keeps the rows of the kept training images.
    """
    arrays = {"client_ids": dataset.client_ids}
    for index, (split, max_n) in enumerate(zip(("train", "test"), (max_train, max_test))):
        x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
        keep = _subset(len(y), max_n, seed, index)
        if keep is not None:
            x, y = x[keep], y[keep]
            if split == "train" and dataset.client_ids is not None:
                arrays["client_ids"] = dataset.client_ids[keep]
        arrays.update({f"x_{split}": x, f"y_{split}": y})
    return Dataset(name=dataset.name, num_classes=dataset.num_classes, source=dataset.source, **arrays)


# --------------------------------------------------------------------------
# FeTS 2021/2022 (brain-tumour MRI, institutions as clients)
# --------------------------------------------------------------------------

_FETS_FIX = ("fix: pass --data_dir=DIR holding FeTS's training folder (its subject folders and partitioning_1.csv, "
             "from the FeTS challenge / Synapse)")
_FETS_CSV = "partitioning_1.csv"


FETS_LABELS = ("whole_tumour", "classes")  # masks: seg > 0, or the authors' 4 classes
# FeTS / BraTS label values: 0 background, 1 necrotic and non-enhancing tumour core, 2 peritumoral oedema,
# 4 enhancing tumour; "classes" maps them to 0, 1, 2, 3 as the FedRef authors do.
FETS_CLASS_VALUES = (0, 1, 2, 4)


def fets_config(name: str) -> tuple[tuple[int, int, int] | None, str]:
    """``"fets[/LABELS]"`` or ``"fets_volumes[/DxHxW][/LABELS]"`` -> ``(size or None, labels)``.

    ``LABELS`` is one of :data:`FETS_LABELS` (default ``whole_tumour``); the size, volumes only,
    resizes every volume; the parts may come in either order. A one-line ``ValueError`` naming the fix for
    anything else.
    """
    base, *tokens = name.strip().lower().split("/")
    size, labels, labels_given = None, "whole_tumour", False
    form = "fets_volumes[/DxHxW][/classes]" if base == "fets_volumes" else "fets[/classes]"
    for token in tokens:
        is_size = base == "fets_volumes" and re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", token)
        if token in FETS_LABELS and labels_given:
            raise ValueError(f"{name!r}: a second label scheme {token!r}; fix: one of {', '.join(FETS_LABELS)}, {form}")
        if token in FETS_LABELS:
            labels, labels_given = token, True
        elif is_size and size is None:
            size = tuple(int(v) for v in token.split("x"))
        elif is_size:
            raise ValueError(f"{name!r}: a second volume size {token!r}; fix: one size, {form}")
        else:
            what = "neither a label scheme" if base == "fets_volumes" else "not a label scheme"
            raise ValueError(f"{name!r}: {token!r} is {what} ({', '.join(FETS_LABELS)})"
                             f"{' nor a volume size D x H x W' if base == 'fets_volumes' else ''}; fix: {form}, "
                             f"e.g. {base}/{'48x64x64/' if base == 'fets_volumes' else ''}classes")
    return size, labels


def _fets_labels(seg: np.ndarray, labels: str, subject: str) -> np.ndarray:
    """A FeTS ``seg`` volume -> int32 masks: ``seg > 0`` (``whole_tumour``) or the values 0, 1, 2, 4 as 0..3."""
    seg = np.asarray(seg)
    if labels == "whole_tumour":
        return (seg > 0).astype(np.int32)
    values = np.unique(seg)
    unknown = sorted(set(values.tolist()) - set(FETS_CLASS_VALUES))
    if unknown:
        raise ValueError(f"fets: {subject}'s seg holds label values {unknown[:5]} outside FeTS's {FETS_CLASS_VALUES}; "
                         "fix: --fets_labels=whole_tumour (labels='whole_tumour': seg > 0), or a FeTS seg file")
    lookup = np.zeros(max(FETS_CLASS_VALUES) + 1, np.int32)
    lookup[list(FETS_CLASS_VALUES)] = np.arange(len(FETS_CLASS_VALUES))
    return lookup[seg.astype(np.int64)]


def _fets_num_classes(labels: str) -> int:
    if labels not in FETS_LABELS:
        raise ValueError(f"fets: labels={labels!r}; fix: one of {FETS_LABELS}")
    return 2 if labels == "whole_tumour" else len(FETS_CLASS_VALUES)


def _fets_partitions(root: str, num_partitions: int) -> dict[int, list[str]]:
    """``partitioning_1.csv`` -> ``{partition: sorted subject ids}`` for partitions ``1..num_partitions`` whose
    subject folder exists in ``root`` (other rows are skipped)."""
    path = os.path.join(root, _FETS_CSV)
    if not os.path.isfile(path):
        raise DataUnavailableError(f"fets: no {_FETS_CSV} in {root}; {_FETS_FIX}")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [name.strip() for name in reader.fieldnames or []]
        if not {"Partition_ID", "Subject_ID"} <= set(header):
            raise DataUnavailableError(f"fets: {path} has columns {header}, not Partition_ID,Subject_ID; {_FETS_FIX}")
        rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    parts: dict[int, list[str]] = {p: [] for p in range(1, num_partitions + 1)}
    for row in rows:
        try:
            partition = int(row["Partition_ID"])
        except ValueError:
            raise DataUnavailableError(f"fets: {path} has Partition_ID {row['Partition_ID']!r} (not an integer); "
                                       f"{_FETS_FIX}") from None
        subject = row["Subject_ID"]
        if partition in parts and subject and os.path.isdir(os.path.join(root, subject)):
            parts[partition].append(subject)
    empty = [p for p, subjects in parts.items() if not subjects]
    if empty:
        raise DataUnavailableError(f"fets: no subject folder of partition(s) {empty} of {_FETS_CSV} in {root} "
                                   f"(a partial copy?); {_FETS_FIX}")
    return {p: sorted(set(subjects)) for p, subjects in parts.items()}


def _fets_volume(root: str, subject: str, modality: str, nib):
    """``<root>/<subject>/<subject>_<modality>.nii.gz`` (or ``.nii``) as a 3-D numpy array."""
    stem = os.path.join(root, subject, f"{subject}_{modality}")
    path = next((stem + ext for ext in (".nii.gz", ".nii") if os.path.isfile(stem + ext)), None)
    if path is None:
        raise DataUnavailableError(f"fets: {stem}.nii.gz is missing (a partial copy?); {_FETS_FIX}")
    try:
        image = nib.load(path)
        volume = image.get_fdata(dtype=np.float32) if modality == "flair" else np.asanyarray(image.dataobj)
    except Exception as err:  # nibabel raises several types for truncated / foreign files
        raise DataUnavailableError(f"fets: cannot read {path} ({_short(err)}); {_FETS_FIX}") from None
    if volume.ndim != 3:
        raise DataUnavailableError(f"fets: {path} has shape {volume.shape}, not a 3-D volume; {_FETS_FIX}")
    return volume


def _fets_slices(area: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the ``k`` axial slices to keep, given the tumour area of each slice ``[D]``.

    Slices with tumour first, largest area first; equal areas go to the slice
    nearer the middle of the volume (then the lower index). When fewer than
    ``k`` slices hold tumour the rest are empty slices, each the free one
    nearest to one of ``k - t`` evenly spaced positions over the central half
    of the volume (``D/4 .. 3D/4 - 1``; equally near: the more central one).
    """
    depth = len(area)
    centre = (depth - 1) / 2
    order = np.lexsort((np.arange(depth), np.abs(np.arange(depth) - centre), -area))  # last key sorts first
    chosen = [int(z) for z in order[:k] if area[z] > 0]
    if len(chosen) < k:  # then every tumour slice is chosen and depth - len(chosen) >= k - len(chosen) are free
        free = [z for z in range(depth) if area[z] == 0]
        for target in np.linspace(depth / 4, 3 * depth / 4 - 1, k - len(chosen)):
            z = min(free, key=lambda z: (abs(z - target), abs(z - centre), z))
            chosen.append(z)
            free.remove(z)
    return np.sort(np.asarray(chosen, np.int64))


def _fets_subject(root: str, subject: str, size: int, k: int, nib,
                  labels: str = "whole_tumour") -> tuple[np.ndarray, np.ndarray]:
    """One subject -> (FLAIR slices ``[k, size, size]`` float32 in [0, 1], masks ``[k, size, size]`` int32 of
    ``labels``)."""
    from PIL import Image

    flair = _fets_volume(root, subject, "flair", nib)
    seg = _fets_volume(root, subject, "seg", nib)
    if flair.shape != seg.shape:
        raise DataUnavailableError(f"fets: {subject}'s FLAIR {flair.shape} and seg {seg.shape} differ in shape; "
                                   f"{_FETS_FIX}")
    if k > flair.shape[2]:
        raise ValueError(f"fets: slices_per_subject={k} but {subject} has {flair.shape[2]} axial slices")
    classes = _fets_labels(seg, labels, subject)
    tumour = classes > 0
    scaled = _fets_scaled_flair(flair)
    xs, ys = np.empty((k, size, size), np.float32), np.empty((k, size, size), np.int32)
    for i, z in enumerate(_fets_slices(tumour.sum(axis=(0, 1)), k)):
        image = Image.fromarray(scaled[:, :, z], mode="F")
        mask = Image.fromarray(classes[:, :, z].astype(np.uint8), mode="L")
        xs[i] = np.asarray(image.resize((size, size), Image.BILINEAR), np.float32)
        ys[i] = np.asarray(mask.resize((size, size), Image.NEAREST))
    return xs, ys


def load_fets(data_dir: str | None, size: int = 64, slices_per_subject: int = 8, test_fraction: float = 0.2,
              num_partitions: int = 10, seed: int = 0, pixels: str = "standardised",
              labels: str = "whole_tumour") -> Dataset:
    """FeTS 2021/2022 brain-tumour MRI as a 2-D binary segmentation set with one client per institution.

    Layout of ``data_dir`` (FeTS's training folder): ``<Subject_ID>/<Subject_ID>_flair.nii.gz`` and
    ``<Subject_ID>_seg.nii.gz`` per subject (``_t1``, ``_t1ce``, ``_t2`` are not read; ``.nii`` works too)
    and ``partitioning_1.csv`` with columns ``Partition_ID,Subject_ID`` (the institutions).

    A documented 2-D reduction of the FedRef authors' 3-D setting:

    * subjects: those of partitions ``1..num_partitions`` whose folder exists (other rows are skipped);
    * slices: per subject the ``slices_per_subject`` axial slices (last volume axis) with the largest
      tumour area; ties go to the more central slice, and a subject with fewer tumour slices is filled up
      with empty slices near evenly spaced positions over the central half of the volume;
    * intensities: FLAIR divided by the subject's 99th percentile of its non-zero (brain) voxels and
      clipped to [0, 1] (the brightest 1% saturate);
    * masks (``labels``): ``"whole_tumour"``, ``seg > 0`` (labels 1, 2 and 4), or ``"classes"``, the
      FedRef authors' 4 classes: FeTS's values 0 (background), 1 (necrotic and non-enhancing core),
      2 (oedema), 4 (enhancing tumour) as 0, 1, 2, 3;
    * resizing: slices to ``size x size`` with PIL, bilinear for images, nearest neighbour for masks
      (rows follow the first voxel axis, as stored);
    * split: per partition, ``test_fraction * n`` (rounded half up) of its ``n`` subjects (a seeded permutation,
      ``default_rng([seed, partition])``; at most ``n - 1``, so each partition keeps a training subject)
      form the test set. Whole subjects, so no subject has slices in both splits.

    Rows are ordered by partition, subject id, slice index.

    Args:
      data_dir: FeTS's training folder.
      size: side ``S`` (the U-Net needs ``S`` divisible by 4, as 64 is).
      slices_per_subject: axial slices kept per subject.
      test_fraction: fraction of each partition's subjects held out as the test set, in [0, 1).
      num_partitions: institutions ``1..K`` of ``partitioning_1.csv`` kept (the authors' 10).
      seed: seed of the subject split.
      pixels: ``"standardised"`` (the training slices' mean/std) or ``"unit"`` (the [0, 1] scaling above).
      labels: one of :data:`FETS_LABELS`.

    Returns:
      ``Dataset(name="fets", source="fets:<data_dir>")``: ``x_* [n, S, S, 1]`` float32, ``y_* [n, S, S]`` int32
      in {0, 1} with ``num_classes = 2`` (``"classes"``: in 0..3, ``num_classes = 4``), and ``client_ids [n_train]``
      int32 (partition - 1, in ``0..K-1``).

    Raises:
      DataUnavailableError: no ``data_dir``, no ``partitioning_1.csv``, a partition with no subject folder,
        a missing or unreadable FLAIR / seg file, or nibabel not installed (one line naming the fix).
      ValueError: bad arguments, no test subject at all, or seg values other than 0, 1, 2, 4 (``"classes"``).
    """
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; choose one of {PIXELS}")
    num_classes = _fets_num_classes(labels)
    size, k, num_partitions = int(size), int(slices_per_subject), int(num_partitions)
    if size < 1 or k < 1 or num_partitions < 1 or not 0 <= test_fraction < 1:
        raise ValueError(f"fets: need size, slices_per_subject, num_partitions >= 1 and test_fraction in [0, 1), got "
                         f"{size}, {k}, {num_partitions}, {test_fraction}")
    root, parts, nib = _fets_source("fets", data_dir, num_partitions)
    (x_tr, y_tr, c_tr), (x_te, y_te, _) = _fets_splits(parts, test_fraction, seed,
                                                       lambda subject: _fets_subject(root, subject, size, k, nib, labels))
    return _pack("fets", x_tr, y_tr, x_te, y_te, f"fets:{root}", pixels, client_ids=c_tr, num_classes=num_classes)


def _fets_splits(parts: dict[int, list[str]], test_fraction: float, seed: int, read):
    """Whole subjects to train or test, per partition; ``read(subject) -> (x [k, ...], y [k, ...])``.

    Returns ``((x_train, y_train, client_ids_train), (x_test, y_test, client_ids_test))``, rows ordered by
    partition and subject id; ``client_ids`` is the partition - 1 of each row.
    """
    splits = {"train": ([], [], []), "test": ([], [], [])}  # images, masks, partition - 1
    for partition, subjects in parts.items():
        n = len(subjects)
        n_test = min(n - 1, int(test_fraction * n + 0.5))  # rounded half up
        held = {int(i) for i in np.random.default_rng([seed, partition]).permutation(n)[:n_test]}
        for i, subject in enumerate(subjects):
            xs, ys, ids = splits["test" if i in held else "train"]
            x, y = read(subject)
            xs.append(x)
            ys.append(y)
            ids.append(np.full(len(x), partition - 1, np.int32))
    if not splits["test"][0]:
        raise ValueError(f"fets: test_fraction={test_fraction} holds out no subject of partitions 1..{len(parts)}; "
                         "fix: a larger test_fraction")
    return tuple(tuple(np.concatenate(a) for a in split) for split in splits.values())


def _fets_scaled_flair(flair: np.ndarray) -> np.ndarray:
    """FLAIR divided by the 99th percentile of its non-zero (brain) voxels, clipped to [0, 1]."""
    brain = flair[flair > 0]
    scale = float(np.percentile(brain if brain.size else flair, 99))
    return np.clip(flair / (scale if scale > 0 else 1.0), 0.0, 1.0).astype(np.float32)


def _fets_subject_volume(root: str, subject: str, size: tuple[int, int, int] | None, nib,
                         labels: str = "whole_tumour") -> tuple[np.ndarray, np.ndarray]:
    """One subject -> (FLAIR ``[1, D, H, W, 1]`` float32 in [0, 1], mask ``[1, D, H, W]`` int32 of ``labels``).

    Axes in the FedRef authors' order, SimpleITK's ``[z, y, x]``: the voxel axes (i, j, k) as
    stored reversed (so ``H, W`` are the 2-D slices' columns and rows); ``size`` resizes (``jax.image.resize``: linear for the image, antialiased when shrinking,
    nearest neighbour for the mask), None keeps the grid.
    """
    import jax

    flair = _fets_volume(root, subject, "flair", nib)
    seg = _fets_volume(root, subject, "seg", nib)
    if flair.shape != seg.shape:
        raise DataUnavailableError(f"fets: {subject}'s FLAIR {flair.shape} and seg {seg.shape} differ in shape; "
                                   f"{_FETS_FIX}")
    image = np.transpose(_fets_scaled_flair(flair), (2, 1, 0))
    mask = np.transpose(_fets_labels(seg, labels, subject), (2, 1, 0))
    if size is not None and tuple(size) != image.shape:
        image = np.asarray(jax.image.resize(image, tuple(size), "linear"), np.float32)
        mask = np.rint(np.asarray(jax.image.resize(mask.astype(np.float32), tuple(size), "nearest"))).astype(np.int32)
    return image[None, ..., None], mask[None]


def load_fets_volumes(data_dir: str | None, size: tuple[int, int, int] | None = None, test_fraction: float = 0.2,
                      num_partitions: int = 10, seed: int = 0, pixels: str = "standardised",
                      labels: str = "whole_tumour") -> Dataset:
    """FeTS 2021/2022 FLAIR volumes with tumour masks, one client per institution (for ``models.UNet3D``).

    The folder layout, subjects, partitions, test split and intensity scaling are
    :func:`load_fets`'s; each subject is one sample, its whole volume:

    * axes: ``[D, H, W]`` = the stored voxel axes reversed, ``[k, j, i]``, as the authors' SimpleITK
      arrays (``GetArrayFromImage``: ``[z, y, x]``); the 2-D slices are ``[i, j]``;
    * intensities: :func:`load_fets`'s scaling, then (``pixels="standardised"``) the training
      volumes' mean and std; the authors feed the raw FLAIR values;
    * masks (``labels``, as in :func:`load_fets`): ``"whole_tumour"``, ``seg > 0``, or ``"classes"``, the
      FedRef authors' 4 classes (values 0, 1, 2, 4 as 0..3);
    * ``size``: resize every volume to ``(D, H, W)`` (``jax.image.resize``: linear and antialiased
      when shrinking for the image, nearest neighbour for the mask); None keeps FeTS's
      155 x 240 x 240 grid, as the authors do. ``load`` reaches
      it as ``"fets_volumes"`` or ``"fets_volumes/DxHxW"``, e.g. ``fets_volumes/48x64x64``.

    Returns:
      ``Dataset(name="fets_volumes")``: ``x_* [n, D, H, W, 1]`` float32, ``y_* [n, D, H, W]`` int32 in
      {0, 1}, ``num_classes = 2`` (``"classes"``: 0..3, ``num_classes = 4``), ``client_ids [n_train]``
      (partition - 1).

    Raises:
      As :func:`load_fets`.
    """
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; choose one of {PIXELS}")
    num_classes = _fets_num_classes(labels)
    if size is not None and (len(size) != 3 or min(int(v) for v in size) < 1):
        raise ValueError(f"fets_volumes: size must be three sizes >= 1 (D, H, W), got {size}; fix: e.g. (48, 64, 64)")
    if not 0 <= test_fraction < 1 or int(num_partitions) < 1:
        raise ValueError(f"fets_volumes: need test_fraction in [0, 1) and num_partitions >= 1, got {test_fraction}, "
                         f"{num_partitions}")
    root, parts, nib = _fets_source("fets_volumes", data_dir, int(num_partitions))
    (x_tr, y_tr, c_tr), (x_te, y_te, _) = _fets_splits(
        parts, test_fraction, seed, lambda subject: _fets_subject_volume(root, subject, size, nib, labels))
    return _pack("fets_volumes", x_tr, y_tr, x_te, y_te, f"fets:{root}", pixels, client_ids=c_tr,
                 num_classes=num_classes)


def _fets_source(name: str, data_dir: str | None, num_partitions: int):
    """``(root, {partition: subjects}, nibabel)`` of a FeTS folder, or a one-line DataUnavailableError."""
    root = os.path.expanduser(data_dir) if data_dir else None
    if root is None or not os.path.isdir(root):
        what = "no --data_dir given" if root is None else f"{root} is not a folder"
        raise DataUnavailableError(f"{name}: {what}; {_FETS_FIX}")
    return root, _fets_partitions(root, num_partitions), _nibabel()


def _nibabel():
    try:
        import nibabel as nib
    except ImportError as err:
        raise DataUnavailableError(f"fets: nibabel is not importable ({_short(err)}); fix: pip install "
                                   "'bfedjax[fets]'") from None
    return nib


def institution_parts(client_ids) -> list[np.ndarray]:
    """Client ``c`` holds the training rows with ``client_ids == c``, for ``c = 0..max``: one index array each.

    The partition of a set with institutions (``load_fets``'s ``Dataset.client_ids``) for
    ``bfedjax.data.from_partition``; an id in ``0..max`` with no row gives an empty array.
    """
    ids = np.asarray(client_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0:
        raise ValueError(f"institution_parts: need a non-empty 1-D array of ids >= 0, got {ids.dtype} {ids.shape}")
    return [np.flatnonzero(ids == c) for c in range(int(ids.max()) + 1)]


# --------------------------------------------------------------------------
# Oxford-IIIT Pet (TFDS)
# --------------------------------------------------------------------------

#: Value of the background class in Oxford-IIIT Pet trimaps (1 = pet, 2 = background, 3 = border).
_TRIMAP_BACKGROUND = 2


def trimap_to_mask(trimap) -> np.ndarray:
    """Oxford-IIIT Pet trimap (1 = pet, 2 = background, 3 = border / unclassified) -> int32 mask in {0, 1}.

    Foreground is pet *or* border (``trimap != 2``): the border band is the
    outline of the pet, where the annotators could not decide pixel by pixel,
    so it counts as pet rather than being dropped (there is no ignore label in
    the binary BCE + Dice loss). Any shape is kept, e.g. ``[H, W, 1]`` stays ``[H, W, 1]``.
    """
    return (np.asarray(trimap) != _TRIMAP_BACKGROUND).astype(np.int32)


def _plane(array) -> np.ndarray:
    """uint8 ``[H, W, 1]`` -> ``[H, W]`` (PIL has no one-channel ``HxWx1`` mode); ``[H, W]``, ``[H, W, 3]`` as they are."""
    array = np.asarray(array, np.uint8)
    return array[..., 0] if array.ndim == 3 and array.shape[-1] == 1 else array


def _read_pets(ds, keep: np.ndarray | None, size: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Records ``keep`` (None: all) of a TFDS data source -> (RGB ``[n, S, S, 3]`` in [0, 1], masks ``[n, S, S]``).

    Each image is resized on its own to ``S x S`` (PIL bilinear; aspect ratio
    not kept), its trimap independently (nearest neighbour) and then binarised
    with :func:`trimap_to_mask`. Only the chosen records are decoded.
    """
    from PIL import Image

    indices = np.arange(len(ds)) if keep is None else keep
    xs, ys = np.empty((len(indices), size, size, 3), np.float32), np.empty((len(indices), size, size), np.int32)
    for start in range(0, len(indices), chunk):
        for i, rec in enumerate(_get_many(ds, [int(k) for k in indices[start:start + chunk]]), start):
            image = Image.fromarray(_plane(rec["image"])).convert("RGB")
            trimap = Image.fromarray(_plane(rec["segmentation_mask"]))
            xs[i] = np.asarray(image.resize((size, size), Image.BILINEAR), np.float32) / 255.0
            ys[i] = trimap_to_mask(np.asarray(trimap.resize((size, size), Image.NEAREST)))
    return xs, ys


def load_tfds_segmentation(tfds_name: str = "oxford_iiit_pet", tfds_data_dir: str | None = None, size: int = 64,
                           download: bool = False, pixels: str = "standardised", *, max_train: int | None = None,
                           max_test: int | None = None, seed: int = 0) -> Dataset:
    """Oxford-IIIT Pet as a binary segmentation set, from prepared TFDS data (``tfds.data_source``, array_record).

    TFDS ``oxford_iiit_pet`` splits ``train`` (3,680) and ``test`` (3,669);
    features ``image`` (uint8 ``[H, W, 3]``, sizes vary) and
    ``segmentation_mask`` (uint8 ``[H, W, 1]`` trimap). Images are resized to
    ``S x S`` bilinearly and kept RGB; masks nearest-neighbour, then
    foreground = pet or border (``trimap != 2``, see :func:`trimap_to_mask`).
    ``pixels="standardised"`` uses the training subset's per-channel mean/std.

    Args:
      tfds_name: TFDS name (a builder with the same two features and splits).
      tfds_data_dir: TFDS data root; None uses TFDS's default.
      size: side ``S`` (>= 1; the U-Net needs ``S`` divisible by 4, as 64 is).
      download: let TFDS download and prepare missing data (needs network).
      pixels: ``"standardised"`` or ``"unit"`` ([0, 1]).
      max_train, max_test: keep a seeded random subset of at most this many
        images per split (the same subset as :func:`load_segmentation`'s DRIVE
        ``_limit``; only those images are decoded); None keeps all.
      seed: seed of that subset.

    Returns:
      ``Dataset(name=tfds_name, source="tfds:<tfds_name>")``: ``x_* [n, S, S, 3]`` float32,
      ``y_* [n, S, S]`` int32 in {0, 1}, ``num_classes = 2``.

    Raises:
      DataUnavailableError: TFDS is not installed or the data is not prepared (one line naming the fix).
    """
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; choose one of {PIXELS}")
    if int(size) < 1:
        raise ValueError(f"{tfds_name}: size={size} must be >= 1, e.g. 64")
    size = int(size)
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise DataUnavailableError(f"{tfds_name}: tensorflow_datasets is not importable ({_short(err)}); fix: "
                                   f"pip install 'bfedjax[tfds]', then {_tfds_remedy(tfds_name)}") from None
    for max_n in (max_train, max_test):
        _subset(1, max_n, seed, 0)  # ValueError for max_n < 1, before any TFDS work

    def failed(err: BaseException) -> DataUnavailableError:
        where = f"TFDS data_dir={tfds_data_dir!r}" if tfds_data_dir else "TFDS default data_dir"
        return DataUnavailableError(f"{tfds_name}: TFDS failed ({where}; {_short(err)}); fix: {_tfds_remedy(tfds_name)}")

    try:  # TFDS raises many types (KeyError: `splits` is empty for unprepared data, OSError, ...)
        with tfds_quiet():
            sources = tfds.data_source(tfds_name, split=["train", "test"], data_dir=tfds_data_dir, download=download,
                                       builder_kwargs={"file_format": "array_record"})
        sizes = [len(ds) for ds in sources]
    except Exception as err:
        raise failed(err) from None
    if min(sizes) == 0:
        raise failed(ValueError(f"a split is empty (train {sizes[0]}, test {sizes[1]} records)"))
    keeps = [_subset(n, max_n, seed, index) for index, (n, max_n) in enumerate(zip(sizes, (max_train, max_test)))]
    try:
        train, test = (_read_pets(ds, keep, size) for ds, keep in zip(sources, keeps))
    except Exception as err:  # unreadable records (e.g. a half-copied folder)
        raise failed(err) from None
    return _pack(tfds_name, *train, *test, f"tfds:{tfds_name}", pixels)


def load_segmentation(name: str, data_dir: str | None = None, *, max_train: int | None = None,
                      max_test: int | None = None, seed: int = 0, pixels: str = "standardised",
                      tfds_data_dir: str | None = None, tfds_download: bool = False) -> Dataset:
    """``bfedjax.data.load`` for ``"vessels"``, ``"drive"``, ``"oxford_iiit_pet"`` and ``"fets"``.

    ``vessels``: ``max_train``/``max_test`` are the split sizes (default 400/100)
    and ``seed`` seeds the generator. ``drive``: read from ``data_dir``, then a
    seeded random subset of at most ``max_train``/``max_test`` images.
    ``oxford_iiit_pet``: from TFDS (``tfds_data_dir``, ``tfds_download``) at
    64x64 RGB, the same kind of seeded subset (drawn before decoding).
    ``fets``: :func:`load_fets` from ``data_dir`` with its defaults (64x64, 8
    slices per subject, partitions 1..10, the subject split of seed 0, fixed
    like DRIVE's), then the same seeded subset of slices; ``client_ids`` keeps
    the kept training rows. ``fets_volumes`` / ``fets_volumes/DxHxW``: :func:`load_fets_volumes`
    (native grid, or resized to ``D x H x W``), then a seeded subset of volumes. Either FeTS name
    takes ``/classes`` last for the authors' 4 classes instead of whole-tumour masks
    (:func:`fets_config`), e.g. ``fets_volumes/48x64x64/classes``.
    """
    if name == "vessels":
        return vessels(400 if max_train is None else max_train, 100 if max_test is None else max_test,
                       seed=seed, pixels=pixels)
    if name == "drive":
        return _limit(load_drive(data_dir, pixels=pixels), max_train, max_test, seed)
    if name == "oxford_iiit_pet":
        return load_tfds_segmentation(name, tfds_data_dir, download=tfds_download, pixels=pixels,
                                      max_train=max_train, max_test=max_test, seed=seed)
    base = name.partition("/")[0]
    if base == "fets":
        _, labels = fets_config(name)
        return _limit(load_fets(data_dir, pixels=pixels, labels=labels), max_train, max_test, seed)
    if base == "fets_volumes":
        size, labels = fets_config(name)
        return _limit(load_fets_volumes(data_dir, size, pixels=pixels, labels=labels), max_train, max_test, seed)
    raise ValueError(f"unknown segmentation set {name!r}; valid: vessels, drive, oxford_iiit_pet, fets[/classes], "
                     "fets_volumes[/DxHxW][/classes]")
