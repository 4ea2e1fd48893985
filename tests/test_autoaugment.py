"""AutoAugment's CIFAR-10 policy and FOLA's Table I augmentation against Pillow, the library it was published in."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.data import autoaugment, pil_ops

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageEnhance, ImageOps  # noqa: E402

GREY = (128, 128, 128)


@functools.lru_cache(maxsize=None)
def _images(n: int = 48, seed: int = 0) -> np.ndarray:
    """``[n, 32, 32, 3]`` uint8 photographs' stand-ins: smooth colour fields plus noise, some flat patches."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (n, 8, 8, 3)).astype(np.uint8)
    smooth = np.stack([np.asarray(Image.fromarray(c).resize((32, 32), Image.BILINEAR)) for c in coarse])
    out = np.clip(smooth.astype(int) + rng.integers(-20, 21, smooth.shape), 0, 255)
    out[: n // 4, 4:12, 4:12] = 77  # flat patches: ties for the histogram operations
    out[n // 4: n // 2] //= 3  # dark images: autocontrast and equalize stretch them
    return out.astype(np.uint8)


def _pil(fn, images):
    return np.stack([np.asarray(fn(Image.fromarray(image))) for image in images]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _jitted(fn, static: tuple = (), **options):
    """``fn`` under ``jax.jit`` (``static``: positions of its static arguments, ``options``: keyword arguments
    bound first), one wrapper per function: one compilation per shape instead of one per operation, as the
    library's operations run inside the jitted round."""
    return jax.jit(functools.partial(fn, **options) if options else fn, static_argnums=static)


def _ours(fn, images, *args):
    static = tuple(i + 1 for i, a in enumerate(args) if isinstance(a, (int, str)))  # fill levels, shear axes
    return np.asarray(_jitted(fn, static)(jnp.asarray(images, jnp.int32), *args))


def _rotate_with_fill(image, degrees):  # the authors' port: RGBA rotation composited over grey
    rotated = image.convert("RGBA").rotate(degrees)
    return Image.composite(rotated, Image.new("RGBA", rotated.size, (128,) * 4), rotated).convert(image.mode)


def _low_range_images(n: int = 64, seed: int = 5) -> np.ndarray:
    """``[n, 16, 16, 3]`` uint8 whose channels span few levels (two levels, narrow and shifted ranges, constants)."""
    rng = np.random.default_rng(seed)
    lo = rng.integers(0, 200, (n, 1, 1, 3))
    width = rng.choice([0, 1, 2, 3, 5, 7, 15, 17, 51, 55], (n, 1, 1, 3))
    x = lo + rng.integers(0, 1000, (n, 16, 16, 3)) % (width + 1)
    x[: n // 4] = lo[: n // 4] + width[: n // 4] * rng.integers(0, 2, (n // 4, 16, 16, 3))  # two levels
    return np.clip(x, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("name", ["invert", "equalize", "posterize", "solarize", "autocontrast"])
def test_lookup_operations_match_pillow_exactly(name):
    x = np.concatenate([_images(), np.pad(_low_range_images(), ((0, 0), (8, 8), (8, 8), (0, 0)), mode="edge")])
    n = len(x)
    ours, ref = {
        "invert": (lambda: _ours(pil_ops.invert, x), lambda: _pil(ImageOps.invert, x)),
        "equalize": (lambda: _ours(pil_ops.equalize, x), lambda: _pil(ImageOps.equalize, x)),
        "autocontrast": (lambda: _ours(pil_ops.autocontrast, x), lambda: _pil(ImageOps.autocontrast, x)),
        "posterize": (lambda: _ours(pil_ops.posterize, x, jnp.full(n, 5)),
                      lambda: _pil(lambda i: ImageOps.posterize(i, 5), x)),
        "solarize": (lambda: _ours(pil_ops.solarize, x, jnp.full(n, 227.55555555555554)),
                     lambda: _pil(lambda i: ImageOps.solarize(i, 227.55555555555554), x)),
    }[name]
    np.testing.assert_array_equal(ours(), ref())


@pytest.mark.parametrize("name", ["color", "contrast", "brightness", "sharpness"])
def test_enhance_operations_match_pillow_exactly(name):
    x = _images()
    factors = [0.1, 0.3, 0.7000000000000001, 1.0, 1.3, 1.7000000000000002, 1.9]
    table = jnp.asarray(pil_ops.blend_table(factors))
    enhancer = {"color": ImageEnhance.Color, "contrast": ImageEnhance.Contrast,
                "brightness": ImageEnhance.Brightness, "sharpness": ImageEnhance.Sharpness}[name]
    for row, factor in enumerate(factors):
        ours = _ours(getattr(pil_ops, name), x, jnp.full(len(x), row), table)
        np.testing.assert_array_equal(ours, _pil(lambda i: enhancer(i).enhance(factor), x), err_msg=f"factor {factor}")


def test_blend_table_is_pillows_float32_blend():
    table = pil_ops.blend_table([0.7000000000000001, 1.3])
    # Pillow's C blend takes the factor as a float: 0.7f * 90 rounds to 63 (float64: 62.999... -> 62) and
    # 1.3f * 180 to 233.99998 (float64: 234.0)
    assert table[0, 0, 90] == 63 and table[1, 0, 180] == 233 and table[1, 0, 250] == 255
    chex.assert_shape(table, (2, 256, 256))


def test_geometry_matches_pillow_exactly():
    x = _images()
    n = len(x)
    for shift in (14.501510574018129, -14.501510574018129, 4.833836858006042):
        offset = pil_ops.translate_offset(shift)
        ref_x = _pil(lambda i: i.transform(i.size, Image.AFFINE, (1, 0, shift, 0, 1, 0), fillcolor=GREY), x)
        ref_y = _pil(lambda i: i.transform(i.size, Image.AFFINE, (1, 0, 0, 0, 1, shift), fillcolor=GREY), x)
        np.testing.assert_array_equal(_ours(pil_ops.translate, x, jnp.tile(jnp.array([offset, 0]), (n, 1)), 128), ref_x)
        np.testing.assert_array_equal(_ours(pil_ops.translate, x, jnp.tile(jnp.array([0, offset]), (n, 1)), 128), ref_y)
    for degrees in (20 / 3, 30.0, -17.3):
        coefficients = jnp.tile(jnp.asarray(pil_ops.rotate_coefficients(degrees, 32, 32)), (n, 1))
        np.testing.assert_array_equal(_ours(pil_ops.affine_fixed, x, coefficients, 128),
                                      _pil(lambda i: _rotate_with_fill(i, degrees), x), err_msg=f"{degrees} deg")


def test_autocontrast_corrections_are_pillows_float64_shortfalls():
    keys = pil_ops.autocontrast_corrections()
    assert len(keys) == 12_094 and np.all(np.diff(keys) > 0)
    lo, hi, v = keys // 65536, keys // 256 % 256, keys % 256
    assert np.all((lo < hi) & (lo <= v) & (v <= hi)) and np.all(255 * (v - lo) % (hi - lo) == 0)
    two_levels = np.zeros((1, 4, 4, 3), np.uint8)
    two_levels[0, :2] = 25  # levels {0, 25}: Pillow maps 25 to 254 (25 * (255 / 25) is 254.99999999999997)
    assert _pil(ImageOps.autocontrast, two_levels).max() == 254 == _ours(pil_ops.autocontrast, two_levels).max()


def test_bicubic_shears_are_within_one_level_of_pillow():
    """Pillow truncates a float64 interpolation, we a float32 one; the sample positions are Pillow's."""
    x = _images()
    n = len(x)
    pairs = []
    for m in (0.26666666666666666, -0.2333333333333333, 0.1, -0.06666666666666667):
        for axis, matrix in (("x", (1, m, 0, 0, 1, 0)), ("y", (1, 0, 0, m, 1, 0))):
            coordinates = jnp.tile(jnp.asarray(pil_ops.shear_coordinates(m, axis, 32, 32))[None], (n, 1, 1, 1))
            pairs.append((_ours(pil_ops.shear_bicubic, x, coordinates, axis, 128),
                          _pil(lambda i: i.transform(i.size, Image.AFFINE, matrix, Image.BICUBIC, fillcolor=GREY), x)))
    for ours, ref in pairs:
        assert np.abs(ours - ref).max() <= 1  # at m = -1/15 a sample point lands exactly on the border
        assert np.mean(ours == ref) > 0.99
    # a wrong tap order or clamping shows up as many large errors
    sheared = pairs[0][1]
    assert np.abs(sheared - x).max() > 50


def _pil_subpolicy(image, sub, applied, negative):
    """The authors' ``SubPolicy.__call__`` with the draws given: Pillow calls as in their port."""
    for slot in (0, 1):
        name, index = sub[3 * slot + 1], sub[3 * slot + 2]
        if not applied[slot]:
            continue
        m = autoaugment.MAGNITUDES[name][index]
        sign = -1 if negative[slot] else 1
        w, h = image.size
        image = {
            "shearX": lambda: image.transform(image.size, Image.AFFINE, (1, m * sign, 0, 0, 1, 0), Image.BICUBIC,
                                              fillcolor=GREY),
            "shearY": lambda: image.transform(image.size, Image.AFFINE, (1, 0, 0, m * sign, 1, 0), Image.BICUBIC,
                                              fillcolor=GREY),
            "translateX": lambda: image.transform(image.size, Image.AFFINE, (1, 0, m * w * sign, 0, 1, 0),
                                                  fillcolor=GREY),
            "translateY": lambda: image.transform(image.size, Image.AFFINE, (1, 0, 0, 0, 1, m * h * sign),
                                                  fillcolor=GREY),
            "rotate": lambda: _rotate_with_fill(image, m),
            "color": lambda: ImageEnhance.Color(image).enhance(1 + m * sign),
            "posterize": lambda: ImageOps.posterize(image, int(m)),
            "solarize": lambda: ImageOps.solarize(image, m),
            "contrast": lambda: ImageEnhance.Contrast(image).enhance(1 + m * sign),
            "sharpness": lambda: ImageEnhance.Sharpness(image).enhance(1 + m * sign),
            "brightness": lambda: ImageEnhance.Brightness(image).enhance(1 + m * sign),
            "autocontrast": lambda: ImageOps.autocontrast(image),
            "equalize": lambda: ImageOps.equalize(image),
            "invert": lambda: ImageOps.invert(image),
        }[name]()
    return image


def test_cifar10_policy_matches_the_authors_pillow_subpolicies():
    x = np.concatenate([_images(), _images(seed=1)])
    policy = autoaugment.CIFAR10_POLICY
    rng = np.random.default_rng(2)
    subpolicy = np.arange(len(x)) % len(policy)  # every sub-policy, 3-4 times
    applied = rng.random((len(x), 2)) < 0.8
    negative = rng.random((len(x), 2)) < 0.5
    ours = np.asarray(_jitted(autoaugment.apply_policy)(jnp.asarray(x, jnp.int32), jnp.asarray(subpolicy),
                                                        jnp.asarray(applied), jnp.asarray(negative)))
    ref = np.stack([np.asarray(_pil_subpolicy(Image.fromarray(image), policy[s], a, n))
                    for image, s, a, n in zip(x, subpolicy, applied, negative)]).astype(np.int32)
    sheared = np.array([any(applied[i, slot] and policy[s][3 * slot + 1] in ("shearX", "shearY") for slot in (0, 1))
                        for i, s in enumerate(subpolicy)])
    np.testing.assert_array_equal(ours[~sheared], ref[~sheared])
    changed = np.any(ref != x, axis=(1, 2, 3))
    assert (~sheared).mean() > 0.8 and changed[~sheared].mean() > 0.6  # most comparisons are exact, of changed images
    # where a shear ran, Pillow's float64 truncation differs from ours on a few pixels by a level
    near = np.abs(ours[sheared] - ref[sheared])
    assert sheared.any() and np.mean(near == 0) > 0.99 and near.max() <= 1


def test_cifar10_policy_table_facts():
    """Spot checks of the authors' table (the whole table was compared with their file by hand)."""
    policy = autoaugment.CIFAR10_POLICY
    assert len(policy) == 25 and policy[0] == (0.1, "invert", 7, 0.2, "contrast", 6)
    assert policy[1] == (0.7, "rotate", 2, 0.3, "translateX", 9) and policy[-1] == (0.7, "translateY", 9, 0.9,
                                                                                     "autocontrast", 1)
    assert sum(sub.count("equalize") for sub in policy) == 9 and not any("shearX" in sub for sub in policy)
    m = autoaugment.MAGNITUDES
    assert m["shearY"][9] == 0.3 and m["translateX"][9] == 150 / 331 and m["rotate"][2] == pytest.approx(20 / 3)
    assert list(m["posterize"]) == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4] and m["solarize"][0] == 256 and m["solarize"][9] == 0
    assert {name for name, op in autoaugment.OPS.items() if op.signed} == {
        "shearX", "shearY", "translateX", "translateY", "color", "contrast", "sharpness", "brightness"}


def test_policy_draws_follow_the_probabilities():
    policy = ((1.0, "invert", 0, 0.3, "posterize", 0), (0.0, "invert", 0, 0.0, "invert", 0))
    random_policy = _jitted(autoaugment.random_policy, (2,))
    x = jnp.full((4000, 4, 4, 3), 100, jnp.int32)
    out = np.asarray(random_policy(x, jax.random.PRNGKey(0), policy))[:, 0, 0, 0]
    inverted = out == 155
    # sub-policy 0 (half the images) always inverts, then posterizes to 8 bits (no change) - every level stays 155
    assert abs(inverted.mean() - 0.5) < 0.03
    posterized = random_policy(x, jax.random.PRNGKey(1), ((0.3, "posterize", 9, 0.0, "invert", 0),))
    assert abs(float(jnp.mean(posterized[:, 0, 0, 0] == 96)) - 0.3) < 0.03  # 4 bits: 100 -> 96
    signs = random_policy(jnp.asarray(_images()[:1].repeat(400, 0), jnp.int32), jax.random.PRNGKey(2),
                          ((1.0, "translateX", 9, 0.0, "invert", 0),))
    left = np.all(np.asarray(signs)[:, :, :14] == 128, axis=(1, 2, 3))  # negative shifts uncover the left side
    right = np.all(np.asarray(signs)[:, :, -14:] == 128, axis=(1, 2, 3))
    assert abs(left.mean() - 0.5) < 0.08 and np.all(left ^ right)


def test_policy_rejects_unknown_operations():
    with pytest.raises(ValueError, match="sub-policy"):
        autoaugment.apply_policy(jnp.zeros((1, 8, 8, 3), jnp.int32), jnp.zeros(1, int), jnp.ones((1, 2), bool),
                                 jnp.zeros((1, 2), bool), ((0.5, "blur", 3, 0.5, "invert", 0),))


def test_cutout_zeroes_one_clipped_square_per_image():
    x = jnp.ones((2000, 32, 32, 1))
    holes = np.asarray(_jitted(bf.data.cutout, length=16)(x, jax.random.PRNGKey(0))[..., 0] == 0)
    rows, cols = holes.any(axis=2), holes.any(axis=1)
    heights, widths = rows.sum(1), cols.sum(1)
    np.testing.assert_array_equal(holes.sum((1, 2)), heights * widths)  # a filled rectangle
    assert heights.min() >= 8 and heights.max() == 16 and widths.min() >= 8 and widths.max() == 16
    assert rows[:, 0].mean() > 0.2 and rows[:, 31].mean() > 0.2  # centres reach the borders (8/32 of them)
    assert abs(np.mean(heights == 16) - 17 / 32) < 0.05  # centre rows 8..24 give a full square


def test_autoaugment_cutout_recovers_levels_and_restandardises():
    levels = _images()
    mean, std = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)
    x = ((levels / 255.0 - np.array(mean)) / np.array(std)).astype(np.float32)
    identity = ((0.0, "invert", 0, 0.0, "invert", 0),)
    out = np.asarray(_jitted(autoaugment.autoaugment_cutout, pixel_norm=(mean, std), padding=0, cutout_length=0,
                             policy=identity)(jnp.asarray(x), jax.random.PRNGKey(0)))
    mirrored = np.all(np.abs(out - x[:, :, ::-1]) < 1e-5, axis=(1, 2, 3))
    kept = np.all(np.abs(out - x) < 1e-5, axis=(1, 2, 3))
    assert np.all(mirrored | kept) and 0 < mirrored.mean() < 1


def test_autoaugment_cutout_pads_grey_and_cuts_black():
    x = jnp.full((600, 32, 32, 3), 1.0)  # white, FOLA's standardisation (level 255)
    out = np.asarray(_jitted(bf.data.autoaugment_cutout, policy=((0.0, "invert", 0, 0.0, "invert", 0),))(
        x, jax.random.PRNGKey(3)))
    levels = np.round((out * 0.5 + 0.5) * 255).astype(int)
    assert set(np.unique(levels)) == {0, 128, 255}  # cutout black, crop border grey, image white
    assert np.mean(np.any(levels == 128, axis=(1, 2, 3))) > 0.8  # a crop offset of 0 x 0 is 1 in 81
    assert np.all(np.any(levels == 0, axis=(1, 2, 3)))


def test_registry_builds_autoaugment_for_rgb_levels_only():
    fn = bf.data.augmentation("autoaugment_cutout", (32, 32, 3), ((0.5,) * 3, (0.5,) * 3))
    x = jnp.asarray(((_images()[:8] / 255.0) - 0.5) / 0.5, jnp.float32)
    out = jax.jit(fn)(x, jax.random.PRNGKey(0))
    chex.assert_shape(out, x.shape)
    assert float(jnp.abs(out - x).mean()) > 0.05
    assert bf.data.augmentation("none", (8, 8, 1)) is None
    assert bf.data.augmentation("crop_flip", (8, 8, 1)) is bf.data.random_crop_flip
    with pytest.raises(ValueError, match="fix: use it on CIFAR-style RGB data"):
        bf.data.augmentation("autoaugment_cutout", (28, 28, 1), (0.1307, 0.3081))
    with pytest.raises(ValueError, match="pixel levels are unknown"):
        bf.data.augmentation("autoaugment_cutout", (32, 32, 3), None)
    with pytest.raises(ValueError, match="--augment=none"):
        bf.data.augmentation("shift_flip", (64,))


def test_fola_round_with_table1_augmentation_trains_on_changed_batches():
    rng = np.random.default_rng(0)
    levels = _images(64, seed=3)
    x = ((levels / 255.0 - 0.5) / 0.5).astype(np.float32)
    y = rng.integers(0, 10, len(x))
    fed = bf.data.stack_clients(x, y, [np.arange(i, 64, 4) for i in range(4)], x_test=x[:8], y_test=y[:8],
                                num_classes=10)
    model = bf.models.get_model("mlp", 10, hidden=(32,))
    plain = bf.algorithms.build("fola", model, fed, lr=0.01, batch_size=8, local_epochs=1)
    augment = bf.data.augmentation("autoaugment_cutout", (32, 32, 3), ((0.5,) * 3, (0.5,) * 3))
    runs = [bf.core.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(0), evaluate_local=False)
            for algo in (plain, bf.data.augmented(plain, augment))]
    a, b = (jax.tree.leaves(r.state.server["params"]) for r in runs)
    assert sum(float(jnp.abs(u - v).sum()) for u, v in zip(a, b)) > 1e-2
