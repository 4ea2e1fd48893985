"""Tests for bfedjax.models.zoo.

Kept fast: parameter counts use ``jax.eval_shape`` (tracing only), and each
concrete model is initialised once (module-scoped fixture) with jitted
init/apply.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bfedjax.models import (
    MODELS, MLP, FolaCNN, LeNet, Logistic, McMahanCNN, get_model, init_params, local_response_normalization,
    num_params,
)

NUM_CLASSES = 10

# name -> (model, per-example input shape) for the concrete (non-abstract) tests
CONCRETE = {
    "logistic": (Logistic(num_classes=NUM_CLASSES), (28, 28, 1)),
    "mlp": (MLP(hidden=(32, 16), num_classes=NUM_CLASSES), (28, 28, 1)),
    "lenet": (LeNet(num_classes=NUM_CLASSES), (28, 28, 1)),
    "fola_cnn": (FolaCNN(num_classes=NUM_CLASSES), (32, 32, 3)),
    "mcmahan_cnn": (McMahanCNN(num_classes=NUM_CLASSES), (32, 32, 3)),
}


@pytest.fixture(scope="module")
def built():
    """name -> (model, input_shape, params) initialised with PRNGKey(0)."""
    key = jax.random.PRNGKey(0)
    return {name: (m, s, init_params(m, s, key)) for name, (m, s) in CONCRETE.items()}


def _abstract_params(model, input_shape):
    """Param pytree with ShapeDtypeStruct leaves; no FLOPs are run."""
    return jax.eval_shape(functools.partial(init_params, model, input_shape),
                          jax.random.PRNGKey(0))


@pytest.mark.parametrize(
    "name,hidden,input_shape,expected",
    [
        ("logistic", None, (28, 28, 1), 7_850),       # 784*10 + 10
        ("mlp_500_300", None, (28, 28, 1), 545_810),
        ("mlp_200_200", None, (28, 28, 1), 199_210),
        ("mlp", None, (28, 28, 1), 199_210),           # default hidden (200, 200)
        ("mlp", (500, 300), (28, 28, 1), 545_810),
        ("fola_cnn", None, (32, 32, 3), 878_538),
        # LeNet: 156 + 2,416 + 48,120 + 10,164 + 850
        ("lenet", None, (28, 28, 1), 61_706),
        # HBFL spec section 5: LeNet5 unpadded on 32x32x3 (flatten 400): 456 + 2,416 + 48,120 + 10,164 + 850
        ("lenet", None, (32, 32, 3), 62_006),
        # HBFL Decision 11's option, unpadded on 28x28 (flatten 256): 156 + 2,416 + 30,840 + 10,164 + 850
        ("lenet_unpadded", None, (28, 28, 1), 44_426),
        # CNN1: LeNet's convs then 400 -> 120 -> 10: 156 + 2,416 + 48,120 + 1,210
        ("cnn1", None, (28, 28, 1), 51_902),
        ("cnn1", None, (32, 32, 3), 52_202),
        # CNN2: 3x3 convs 32/64/64, flatten 576 (28x28) or 1,024 (32x32), then 64 -> 10
        ("cnn2", None, (28, 28, 1), 320 + 18_496 + 36_928 + 36_928 + 650),
        ("cnn2", None, (32, 32, 3), 896 + 18_496 + 36_928 + 65_600 + 650),
        ("mlp", None, (32, 32, 3), 3072 * 200 + 200 + 200 * 200 + 200 + 2_010),
        # FedReg CNN: 832 + 25,632 + 51,264 + 147,712 + 2,570
        ("fedreg_cnn", None, (28, 28, 1), 228_010),
    ],
)
def test_param_counts(name, hidden, input_shape, expected):
    model = get_model(name, num_classes=NUM_CLASSES, hidden=hidden)
    assert num_params(_abstract_params(model, input_shape)) == expected


def test_num_params_concrete(built):
    assert num_params(built["logistic"][2]) == 7_850
    assert num_params(built["lenet"][2]) == 61_706


@pytest.mark.parametrize("name", list(CONCRETE))
def test_output_shape_and_finite(built, name):
    model, shape, params = built[name]
    x = jax.random.normal(jax.random.PRNGKey(2), (3, *shape))
    logits = jax.jit(model.apply)({"params": params}, x)
    assert logits.shape == (3, NUM_CLASSES)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("name", list(CONCRETE))
def test_zero_bias_and_glorot_kernels(built, name):
    _, _, params = built[name]
    n_bias = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf = np.asarray(leaf)
        if path[-1].key == "bias":
            n_bias += 1
            np.testing.assert_array_equal(leaf, 0.0)
        else:
            assert path[-1].key == "kernel"
            # Glorot uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out))
            receptive = int(np.prod(leaf.shape[:-2])) if leaf.ndim > 2 else 1
            fan_in, fan_out = leaf.shape[-2] * receptive, leaf.shape[-1] * receptive
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            assert np.abs(leaf).max() <= limit * (1 + 1e-6)
            assert np.abs(leaf).max() > 0.5 * limit
    assert n_bias > 0


def test_init_deterministic(built):
    model, shape, p0 = built["lenet"]
    p_same = init_params(model, shape, jax.random.PRNGKey(0))
    p_other = init_params(model, shape, jax.random.PRNGKey(1))
    jax.tree_util.tree_map(np.testing.assert_array_equal, p0, p_same)
    assert not np.array_equal(p0["Conv_0"]["kernel"], p_other["Conv_0"]["kernel"])


@pytest.mark.parametrize("name", ["logistic", "mlp"])
def test_flat_input_equals_image_input(built, name):
    model, shape, params = built[name]
    x = jax.random.uniform(jax.random.PRNGKey(7), (4, *shape))
    apply = jax.jit(model.apply)
    out_img = apply({"params": params}, x)
    out_flat = apply({"params": params}, x.reshape(4, -1))
    np.testing.assert_allclose(np.asarray(out_img), np.asarray(out_flat), rtol=1e-6, atol=1e-6)


def test_flat_init_shapes_match_image_init():
    model = Logistic(num_classes=NUM_CLASSES)
    a = _abstract_params(model, (28, 28, 1))
    b = _abstract_params(model, (784,))
    assert jax.tree_util.tree_map(lambda l: l.shape, a) == jax.tree_util.tree_map(lambda l: l.shape, b)


def test_vmap_over_stacked_clients():
    model = MLP(hidden=(8,), num_classes=3)
    keys = jax.random.split(jax.random.PRNGKey(8), 4)
    stacked = jax.vmap(lambda k: init_params(model, (5,), k))(keys)
    assert stacked["Dense_0"]["kernel"].shape == (4, 5, 8)
    x = jnp.ones((2, 5))
    out = jax.jit(jax.vmap(lambda p: model.apply({"params": p}, x)))(stacked)
    assert out.shape == (4, 2, 3)


def test_registry_and_unknown_name():
    assert set(MODELS) == {"logistic", "mlp", "mlp_500_300", "mlp_200_200", "fola_cnn", "lenet", "lenet_unpadded", "cnn1",
                           "cnn2", "resnet20", "resnet9_fixup", "mobilenet_v3_small", "fedreg_cnn", "mcmahan_cnn", "unet",
                           "unet3d"}
    assert isinstance(get_model("fola_cnn", 10), FolaCNN)
    assert isinstance(get_model("McMahan_CNN", 10), McMahanCNN)
    assert isinstance(get_model("lenet", 10), LeNet)
    assert isinstance(get_model("logistic", 10), Logistic)
    assert get_model("mlp", 10).hidden == (200, 200)
    assert get_model("mlp", 10, hidden=[64]).hidden == (64,)
    assert get_model("mlp_500_300", 10).hidden == (500, 300)
    with pytest.raises(ValueError, match="logistic"):
        get_model("resnet9000", 10)


def test_fedreg_cnn_uses_pytorch_default_bounds():
    params = init_params(get_model("fedreg_cnn", 10), (28, 28, 1), jax.random.PRNGKey(0))
    for name, fan_in in (("Conv_0", 25), ("Conv_1", 800), ("Conv_2", 800), ("Dense_0", 576), ("Dense_1", 256)):
        bound = 1 / np.sqrt(fan_in)
        for leaf in (params[name]["kernel"], params[name]["bias"]):
            assert float(np.max(np.abs(leaf))) <= bound  # numpy: no compile per leaf shape
            assert float(np.max(np.abs(leaf))) > 0.8 * bound  # uniform over the whole interval


@pytest.fixture
def kernel_grad_limit(monkeypatch):
    """``set(limit)`` sets this platform's ``MATMUL_KERNEL_GRAD_MAX_BYTES`` for one test. The limit is read when a
    function is traced, and JAX reuses a traced function for the same inputs: the caches are cleared at every
    change and, after one, when the test ends."""
    from bfedjax.models import conv as zoo_conv

    changed = []

    def set_limit(limit):
        jax.clear_caches()
        monkeypatch.setitem(zoo_conv.MATMUL_KERNEL_GRAD_MAX_BYTES, jax.default_backend(), limit)
        changed.append(limit)
    yield set_limit
    if changed:
        jax.clear_caches()


ZOO_SHAPES = [(12, 3, 1, "SAME"), (11, 3, 2, "SAME"), (28, 5, 1, "VALID"), (9, 1, 2, "VALID"),
              (10, 3, 2, ((1, 1), (1, 1))), (13, 5, 3, "VALID")]
ZOO_IMPLEMENTATIONS = ["matmul_conv", "matmul_trained_conv", "loop_friendly_conv", "loop_friendly_conv/matmul_kernel_grad",
                       "per_client_conv", "per_client_conv/winograd"]


def _zoo_loss(conv, stride, padding, dn):
    return lambda x, w: jnp.sum(jnp.sin(conv(x, w, (stride, stride), padding, dimension_numbers=dn)))


@functools.lru_cache(maxsize=None)
def _lax_reference(size, kernel, stride, padding):
    """``(x, w, value, (dx, dw), second-order x-gradient)`` of lax's convolution for one ZOO_SHAPES entry, as
    numpy arrays: every implementation of a shape is compared with them, so each is compiled once per process
    (jitted: one compile per function rather than an eager compile per operation)."""
    from jax import lax
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, size, size, 2)))
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (kernel, kernel, 2, 4)))
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    loss = _zoo_loss(lax.conv_general_dilated, stride, padding, dn)
    value = jax.jit(loss)(x, w)
    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    second = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(loss, argnums=1)(x, w) ** 2)))(x)
    return x, w, np.asarray(value), tuple(np.asarray(g) for g in gradients), np.asarray(second)


@pytest.mark.parametrize("size,kernel,stride,padding", ZOO_SHAPES)
@pytest.mark.parametrize("implementation", ZOO_IMPLEMENTATIONS)
def test_zoo_convolutions_match_lax(size, kernel, stride, padding, implementation, kernel_grad_limit):
    """The zoo's convolutions (im2col matrix product, also only under grad; custom VJP, with the kernel gradient
    as a convolution or as a matrix product; Winograd F(4x4) alone) give lax's value and both gradients (also
    when differentiated twice); the dispatcher gives lax's value (checked once per shape: it is the same call
    whatever the implementation under test)."""
    from jax import lax
    from bfedjax.models import conv as zoo_conv
    implementation, _, kernel_grad = implementation.partition("/")
    if kernel_grad == "winograd" and stride != 1:
        pytest.skip("Winograd convolutions are stride-1")
    x, w, want_value, want_gradients, want_second = _lax_reference(size, kernel, stride, padding)
    if kernel_grad == "matmul_kernel_grad":  # loop_friendly_conv's kernel gradient as patches^T dy (a GPU's default)
        kernel_grad_limit(2**30)
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    pads = padding if not isinstance(padding, str) else lax.padtype_to_pads((size, size), (kernel, kernel),
                                                                            (stride, stride), padding)
    impl = getattr(zoo_conv, implementation)
    if kernel_grad == "winograd":
        impl = functools.partial(impl, precision=None, winograd=4)
    fast = lambda x, w, strides, padding, dimension_numbers: impl(x, w, strides, tuple(map(tuple, pads)))
    loss = _zoo_loss(fast, stride, padding, dn)
    # every function jitted: one compile each rather than an eager compile per operation (5x faster)
    np.testing.assert_allclose(jax.jit(loss)(x, w), want_value, rtol=1e-5)
    if implementation == ZOO_IMPLEMENTATIONS[0]:  # the dispatcher
        np.testing.assert_allclose(jax.jit(_zoo_loss(zoo_conv.conv_general_dilated, stride, padding, dn))(x, w),
                                   want_value, rtol=1e-5)
    for got, want in zip(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w), want_gradients):
        # float32 rounding scales with the gradient (up to about 30 here): both sides differ from a float64
        # reference by up to 3e-5 on some CPUs, a wrong gradient by O(1); Winograd F(4x4, 5x5)'s transforms
        # (entries up to 16) round about 5x more
        scale = (5e-5 if kernel_grad == "winograd" else 1e-5) * float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=scale)
    second = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(loss, argnums=1)(x, w) ** 2)))(x)
    # entries up to about 2,000: cancellation errors of 0.01 near 0
    np.testing.assert_allclose(second, want_second, rtol=1e-3, atol=3e-5 * float(np.max(np.abs(want_second))))


@pytest.mark.parametrize("size,kernel,stride,pads", [(12, 3, 1, ((1, 1), (1, 1))), (11, 5, 2, ((2, 2), (2, 2))),
                                                     (8, 3, 2, ((0, 1), (1, 0)))])
def test_shifted_depthwise_conv_matches_lax_and_a_client_vmap_has_no_convolution(size, kernel, stride, pads):
    """MobileNet's depthwise convolutions on a CPU: lax's value and both gradients, through the dispatcher; under a
    vmap over per-client kernels no convolution is left (XLA:CPU ran their grouped gradients as a slow loop)."""
    from jax import lax
    from bfedjax.models import conv as zoo_conv
    x = jax.random.normal(jax.random.PRNGKey(0), (3, size, size, 6))
    w = jax.random.normal(jax.random.PRNGKey(1), (kernel, kernel, 1, 6))
    dn = ("NHWC", "HWIO", "NHWC")
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w, (stride, stride), pads, dimension_numbers=dn,
                                                             feature_group_count=6)))
    # every function jitted: one compile each rather than an eager compile per operation
    want_value = jax.jit(loss(lax.conv_general_dilated))(x, w)
    np.testing.assert_allclose(jax.jit(loss(zoo_conv.conv_general_dilated))(x, w), want_value, rtol=1e-5)
    shifted = lambda x, w, strides, padding, dimension_numbers, feature_group_count: (  # noqa: E731
        zoo_conv.shifted_depthwise_conv(x, w, strides, padding))
    np.testing.assert_allclose(jax.jit(loss(shifted))(x, w), want_value, rtol=1e-5)
    for got, want in zip(jax.jit(jax.grad(loss(shifted), argnums=(0, 1)))(x, w),
                         jax.jit(jax.grad(loss(lax.conv_general_dilated), argnums=(0, 1)))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    per_client = jax.vmap(jax.grad(loss(shifted), argnums=1), in_axes=(None, 0))
    text = jax.jit(per_client).lower(x, jnp.stack([w, 2 * w])).as_text()
    assert "convolution" not in text
    # bfloat16 inputs are summed in float32: lax's bfloat16 result, within one bfloat16 rounding of the output
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    exact = lax.conv_general_dilated(xb.astype(jnp.float32), wb.astype(jnp.float32), (stride, stride), pads,
                                     dimension_numbers=dn, feature_group_count=6)
    got = jax.jit(lambda xb, wb: zoo_conv.conv_general_dilated(xb, wb, (stride, stride), pads, dimension_numbers=dn,
                                                              feature_group_count=6))(xb, wb)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), exact, atol=2**-7 * float(jnp.max(jnp.abs(exact))))
    # cropping pads and a kernel larger than the padded input go to lax (which crops or returns an empty map)
    for odd_x, odd_pads in ((x, ((-1, 0), (0, 0))), (x[:, :2, :2], ((0, 0), (0, 0)))):
        want = lax.conv_general_dilated(odd_x, w, (stride, stride), odd_pads, dimension_numbers=dn,
                                        feature_group_count=6)
        got = zoo_conv.conv_general_dilated(odd_x, w, (stride, stride), odd_pads, dimension_numbers=dn,
                                            feature_group_count=6)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_matmul_conv_under_a_client_vmap_is_a_batched_matrix_product():
    """Per-client kernels under vmap: matmul_conv lowers to a batched dot, never a grouped convolution."""
    from jax import lax
    from bfedjax.models.conv import matmul_conv
    xs = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 9, 9, 3))   # [clients, N, H, W, I]
    ws = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 3, 3, 5))   # [clients, kh, kw, I, O]
    per_client = jax.vmap(lambda x, w: matmul_conv(x, w, (1, 1), ((1, 1), (1, 1))))
    primitives = {e.primitive.name for e in jax.make_jaxpr(per_client)(xs, ws).jaxpr.eqns}
    assert "dot_general" in primitives and "conv_general_dilated" not in primitives
    want = jnp.stack([lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                      for x, w in zip(xs, ws)])
    np.testing.assert_allclose(per_client(xs, ws), want, rtol=1e-5, atol=1e-5)


def test_per_client_conv_is_a_convolution_alone_and_a_batched_product_under_a_client_vmap():
    """per_client_conv's gradient: XLA's convolutions for one client, batched dots (no convolution) under a
    vmap, values as lax's either way (also a second-order gradient under the vmap)."""
    from jax import lax
    from bfedjax.models.conv import per_client_conv
    xs = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 9, 9, 3))   # [clients, N, H, W, I]
    ws = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 3, 3, 5))   # [clients, kh, kw, I, O]
    conv = lambda x, w: per_client_conv(x, w, (2, 2), ((1, 1), (1, 1)))
    ref = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
    grads = lambda c: jax.grad(lambda x, w: jnp.sum(jnp.sin(c(x, w))), argnums=(0, 1))
    hlo = lambda fn, *args: jax.jit(fn).lower(*args).as_text()
    alone, vmapped = hlo(grads(conv), xs[0], ws[0]), hlo(jax.vmap(grads(conv)), xs, ws)
    assert alone.count("stablehlo.convolution") == 3 and "stablehlo.dot_general" not in alone
    assert "stablehlo.convolution" not in vmapped and vmapped.count("stablehlo.dot_general") == 3
    # jitted: one compile each rather than an eager compile per operation
    for got, want in zip(jax.jit(jax.vmap(grads(conv)))(xs, ws), jax.jit(jax.vmap(grads(ref)))(xs, ws)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    second = lambda c: jax.jit(jax.vmap(lambda x, w: jax.grad(lambda x: jnp.sum(grads(c)(x, w)[1] ** 2))(x)))(xs, ws)
    want = second(ref)
    np.testing.assert_allclose(second(conv), want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def primitive_names(jaxpr) -> list:
    """The primitives of a jaxpr's equations, with those of the jaxprs nested in them."""
    from jax.extend import core as jex_core
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        names += [name for sub in jex_core.jaxprs_in_params(eqn.params) for name in primitive_names(sub)]
    return names


def test_kernel_gradient_under_a_client_vmap_is_a_batched_matrix_product(kernel_grad_limit):
    """Within MATMUL_KERNEL_GRAD_MAX_BYTES, loop_friendly_conv's vmapped kernel gradient is a dot (on a GPU a
    grouped convolution there runs client by client); the forward and the input gradient stay convolutions."""
    from bfedjax.models import conv as zoo_conv
    xs = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 9, 9, 3))   # [clients, N, H, W, I]
    ws = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 3, 3, 5))   # [clients, kh, kw, I, O]
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w, (1, 1), ((1, 1), (1, 1)))))
    grads = jax.vmap(jax.grad(loss(zoo_conv.loop_friendly_conv), argnums=(0, 1)))

    def convolutions(limit):
        kernel_grad_limit(limit)
        names = primitive_names(jax.make_jaxpr(grads)(xs, ws).jaxpr)
        return names.count("conv_general_dilated"), names.count("dot_general")

    (convs, dots), (convs_mm, dots_mm) = convolutions(-1), convolutions(2**30)
    got = jax.jit(grads)(xs, ws)  # with the patches^T dy kernel gradient (the limit stays 2**30)
    assert (convs, convs_mm) == (3, 2) and dots_mm > dots
    lax_conv = lambda x, w, strides, pads: jax.lax.conv_general_dilated(x, w, strides, pads,
                                                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for g, want in zip(got, jax.jit(jax.vmap(jax.grad(loss(lax_conv), argnums=(0, 1))))(xs, ws)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_per_client_conv_alone_takes_winograd_with_asymmetric_padding():
    """``per_client_conv(..., winograd=4)`` alone: under grad its value and both gradients are lax's for an
    asymmetrically padded, non-square input (the crop of the padded input gradient), and no convolution runs."""
    from jax import lax
    from bfedjax.models.conv import per_client_conv
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 9, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (5, 5, 8, 3)) * 0.2
    pads = ((0, 2), (1, 0))
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
    fast = loss(lambda x, w: per_client_conv(x, w, (1, 1), pads, None, 4))
    ref = loss(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), pads, dimension_numbers=("NHWC", "HWIO", "NHWC")))
    # jitted: one compile each rather than an eager compile per operation
    (value, grads), (want_value, want_grads) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (fast, ref))
    np.testing.assert_allclose(value, want_value, atol=1e-4)  # the forward under grad: Winograd's (a sum of 270 sines)
    for got, want in zip(grads, want_grads):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=5e-5 * float(jnp.max(jnp.abs(want))))
    assert "conv_general_dilated" not in primitive_names(jax.make_jaxpr(jax.grad(fast, (0, 1)))(x, w).jaxpr)
    with pytest.raises(ValueError, match="stride 1 and a square kernel"):
        jax.grad(loss(lambda x, w: per_client_conv(x, w, (2, 2), pads, None, 4)))(x, w)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="WINOGRAD_TILES lists the CPU only")
def test_fedreg_cnn_gradient_with_winograd_matches_xla_convolutions(monkeypatch):
    """The model a CPU trains alone with Winograd conv2/conv3 (5x5, 32 channels; no convolution left in its
    gradient) has the gradient it has with XLA's convolutions."""
    from bfedjax.models import apply_fn_of, conv, zoo
    model = get_model("fedreg_cnn", 10)
    params = zoo.init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 28, 28, 1))
    y = jnp.arange(10) % 10

    def loss(params):
        logits = apply_fn_of(model)(params, x)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(10), y])

    def gradient(tiles):
        monkeypatch.setitem(conv.WINOGRAD_TILES, "cpu", tiles)
        jax.clear_caches()  # the table is read when the model is traced
        return jax.jit(jax.grad(loss))(params), set(primitive_names(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))

    try:
        (with_winograd, winograd_ops), (without, xla_ops) = gradient({5: 4}), gradient({})
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert "conv_general_dilated" not in winograd_ops and "conv_general_dilated" in xla_ops
    for got, want in zip(jax.tree.leaves(with_winograd), jax.tree.leaves(without)):
        np.testing.assert_allclose(got, want, atol=1e-4 * float(np.max(np.abs(want))) + 1e-7)


def test_zoo_conv_takes_im2col_only_for_trained_patch_matrices_that_fit():
    """On a CPU a training batch's convolution is a matrix product under grad and lax's conv without one: under a
    client vmap up to MATMUL_CONV_MAX_BYTES, for a client alone up to ALONE_MATMUL_CONV_MAX_BYTES (larger: lax's
    conv alone, per_client_conv); a large batch keeps lax's conv (loop_friendly_conv) either way."""
    from bfedjax.models import conv
    w = jnp.zeros((5, 5, 32, 32))
    small, large = jnp.zeros((10, 24, 24, 32)), jnp.zeros((1000, 24, 24, 32))
    assert conv.patch_bytes(small, w, (1, 1), ((0, 0), (0, 0))) == 10 * 20 * 20 * 800 * 4
    call = lambda x, w: conv.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    trained = jax.grad(lambda w, x: jnp.sum(call(x, w)))

    def names(fn, x):  # through the custom-VJP and jit sub-jaxprs
        return set(primitive_names(jax.make_jaxpr(fn)(w, x).jaxpr))

    if jax.default_backend() == "cpu":
        tiny = jnp.zeros((1, 12, 12, 32))  # 8 x 8 x 800 patches: 200 KiB
        assert conv.patch_bytes(tiny, w, (1, 1), ((0, 0), (0, 0))) <= conv.ALONE_MATMUL_CONV_MAX_BYTES["cpu"]
        assert "dot_general" in names(trained, tiny) and "conv_general_dilated" not in names(trained, tiny)
        # a 5x5 stride-1 convolution alone: Winograd's products (WINOGRAD_TILES); a 3x3 one: XLA's convolutions
        assert conv.winograd_tile(w, (1, 1), "cpu") == conv.WINOGRAD_TILES["cpu"][5]
        assert "dot_general" in names(trained, small) and "conv_general_dilated" not in names(trained, small)
        w3 = jnp.zeros((3, 3, 32, 32))
        assert conv.winograd_tile(w3, (1, 1), "cpu") is None and conv.winograd_tile(w, (2, 2), "cpu") is None
        assert conv.winograd_tile(w.astype(jnp.bfloat16), (1, 1), "cpu") is None  # float32 only
        found3 = names(lambda w, x: trained(w3, x), jnp.zeros((10, 26, 26, 32)))
        assert "conv_general_dilated" in found3 and "dot_general" not in found3
        stacked = (jnp.zeros((2,) + w.shape), jnp.zeros((2,) + small.shape))
        lowered = jax.jit(jax.vmap(trained)).lower(*stacked)  # the program that runs, compiled once
        assert lowered.compile()(*stacked).shape == (2,) + w.shape
        assert "stablehlo.convolution" not in lowered.as_text() and "stablehlo.dot_general" in lowered.as_text()
        assert "conv_general_dilated" in names(lambda w, x: call(x, w), small)  # evaluation: no patches
    assert "dot_general" not in names(trained, large)  # loop_friendly_conv (a custom VJP around lax's conv)


MIXED = {"mlp": (28, 28, 1), "fedreg_cnn": (28, 28, 1), "resnet20": (16, 16, 3), "unet": (8, 8, 1)}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_bfloat16_compute_keeps_float32_parameters_statistics_and_logits(name):
    from bfedjax.models import train_apply_fn_of
    shape, classes = MIXED[name], 2 if name == "unet" else NUM_CLASSES
    full, mixed = get_model(name, classes), get_model(name, classes, compute_dtype="bfloat16")
    if name == "resnet20":  # one block per stage: the same layers (convs, BatchNorm, shortcuts), a third the compile
        full, mixed = full.clone(blocks_per_stage=1), mixed.clone(blocks_per_stage=1)
    params = init_params(full, shape, jax.random.PRNGKey(0))
    # the same float32 parameters (master weights) whatever the compute dtype
    jax.tree.map(np.testing.assert_array_equal, params, init_params(mixed, shape, jax.random.PRNGKey(0)))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, *shape))
    train = lambda model, p: train_apply_fn_of(model)(p, x, jnp.ones(4), jax.random.PRNGKey(2))
    step = jax.jit(jax.value_and_grad(lambda p: (jnp.mean(train(mixed, p)[0] ** 2), train(mixed, p)), has_aux=True))
    lowered = step.lower(params)
    products = [line for line in lowered.as_text().splitlines()
                if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]
    assert products and all("f32>" not in line for line in products)  # every product, forward and backward, in bf16
    (_, (logits, updated)), _ = lowered.compile()(params)
    reference, _ = jax.jit(train, static_argnums=0)(full, params)
    assert logits.dtype == jnp.float32
    assert jax.tree.all(jax.tree.map(lambda a: a.dtype == jnp.float32, updated))  # ResNet's BatchNorm statistics
    error = float(jnp.max(jnp.abs(logits - reference)) / jnp.max(jnp.abs(reference)))
    assert 1e-4 < error < 0.05  # bfloat16 rounding (8-bit mantissa): visible, but small


def test_compute_dtype_is_checked():
    assert get_model("mlp", 10, compute_dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert get_model("mlp", 10).dtype == jnp.float32
    from bfedjax.models import client_architectures
    models, _ = client_architectures("mlp:1,cnn2:1", 2, num_classes=10, compute_dtype="bfloat16")
    assert [m.dtype for m in models] == [jnp.bfloat16, jnp.bfloat16]
    with pytest.raises(ValueError, match="fix: use one of .*bfloat16"):
        get_model("mlp", 10, compute_dtype="int8")
    with pytest.raises(ValueError, match="not supported"):
        get_model("mlp", 10, compute_dtype="float16")  # would need loss scaling


# --------------------------------------------------------------------------- #
# McMahan et al.'s CIFAR CNN (the TensorFlow CIFAR-10 tutorial's model; FOLA spec D13)
# --------------------------------------------------------------------------- #

def _lrn_loop(x, depth_radius, bias, alpha, beta):
    """tf.nn.lrn written out channel by channel: sqr_sum over channels d-r..d+r (cut at the edges)."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    channels = x.shape[-1]
    for d in range(channels):
        lo, hi = max(0, d - depth_radius), min(channels, d + depth_radius + 1)
        sqr_sum = np.sum(x[..., lo:hi] ** 2, axis=-1)
        out[..., d] = x[..., d] / (bias + alpha * sqr_sum) ** beta
    return out


@pytest.mark.parametrize("kwargs", [{},  # the tutorial's (depth 4, bias 1, alpha 0.001 / 9, beta 0.75)
                                    {"depth_radius": 2, "bias": 2.0, "alpha": 0.3, "beta": 0.6}])
def test_local_response_normalization_matches_the_tf_formula(kwargs):
    # 11 channels: windows cut at both ends and full ones in the middle; scale 20 so alpha * sqr_sum matters
    x = 20.0 * jax.random.normal(jax.random.PRNGKey(3), (2, 3, 4, 11))
    full = {"depth_radius": 4, "bias": 1.0, "alpha": 0.001 / 9.0, "beta": 0.75, **kwargs}
    want = _lrn_loop(x, **full)
    assert np.max(np.abs(want - np.asarray(x)) / np.abs(np.asarray(x))) > 0.05  # a visible normalisation
    got = jax.jit(lambda x: local_response_normalization(x, **kwargs))(x)
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)


def _mcmahan_param_count(size, channels=3, num_classes=NUM_CLASSES):
    """By hand from the layer shapes: two 5x5x64 SAME convs, two 3x3 stride-2 SAME pools, 384, 192, K."""
    conv1 = 5 * 5 * channels * 64 + 64
    conv2 = 5 * 5 * 64 * 64 + 64
    side = math.ceil(math.ceil(size / 2) / 2)  # SAME pooling with stride 2, twice
    local3 = side * side * 64 * 384 + 384
    local4 = 384 * 192 + 192
    logits = 192 * num_classes + num_classes
    return conv1 + conv2 + local3 + local4 + logits


@pytest.mark.parametrize("size,flat,expected", [(24, 2304, 1_068_298), (32, 4096, 1_756_426)])
def test_mcmahan_cnn_shapes_and_parameter_count(size, flat, expected):
    """The tutorial's 24x24 crops give McMahan et al.'s "about 10^6" parameters; 32x32 images 1.76M."""
    assert _mcmahan_param_count(size) == expected
    model = get_model("mcmahan_cnn", NUM_CLASSES)
    params = _abstract_params(model, (size, size, 3))
    assert num_params(params) == expected
    shapes = jax.tree.map(lambda leaf: leaf.shape, params)
    assert shapes == {"conv1": {"kernel": (5, 5, 3, 64), "bias": (64,)},
                      "conv2": {"kernel": (5, 5, 64, 64), "bias": (64,)},
                      "local3": {"kernel": (flat, 384), "bias": (384,)},
                      "local4": {"kernel": (384, 192), "bias": (192,)},
                      "softmax_linear": {"kernel": (192, NUM_CLASSES), "bias": (NUM_CLASSES,)}}
    out = jax.eval_shape(model.apply, {"params": params}, jax.ShapeDtypeStruct((5, size, size, 3), jnp.float32))
    assert out.shape == (5, NUM_CLASSES) and out.dtype == jnp.float32


def test_mcmahan_cnn_forward_matches_the_tutorial_layer_by_layer():
    """The model against the tutorial's inference() written with lax ops and the loop LRN, on 24x24 inputs:
    conv1 -> relu -> pool -> lrn, conv2 -> relu -> lrn -> pool (the two blocks order them differently)."""
    from jax import lax
    model = McMahanCNN(num_classes=NUM_CLASSES, weight_init="tf_tutorial")  # non-zero biases take part too
    params = init_params(model, (24, 24, 3), jax.random.PRNGKey(4))
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 24, 24, 3))
    lrn = lambda h: _lrn_loop(h, 4, 1.0, 0.001 / 9.0, 0.75)
    conv = lambda h, p: np.asarray(lax.conv_general_dilated(
        jnp.asarray(h, jnp.float32), p["kernel"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))) + np.asarray(p["bias"])
    pool = lambda h: np.asarray(lax.reduce_window(jnp.asarray(h, jnp.float32), -jnp.inf, lax.max,
                                                  (1, 3, 3, 1), (1, 2, 2, 1), "SAME"))
    relu = lambda h: np.maximum(h, 0.0)
    dense = lambda h, p: h @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"])
    h = lrn(pool(relu(conv(x, params["conv1"]))))
    h = pool(lrn(relu(conv(h, params["conv2"]))))
    h = relu(dense(h.reshape(2, -1), params["local3"]))
    h = relu(dense(h, params["local4"]))
    want = dense(h, params["softmax_linear"])
    got = jax.jit(model.apply)({"params": params}, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.max(np.abs(want)))


def test_mcmahan_cnn_tf_tutorial_initialisation():
    params = init_params(McMahanCNN(num_classes=NUM_CLASSES, weight_init="tf_tutorial"), (24, 24, 3),
                         jax.random.PRNGKey(0))
    for name, stddev, bias in (("conv1", 5e-2, 0.0), ("conv2", 5e-2, 0.1), ("local3", 0.04, 0.1),
                               ("local4", 0.04, 0.1), ("softmax_linear", 1 / 192.0, 0.0)):
        kernel = np.asarray(params[name]["kernel"])
        np.testing.assert_array_equal(np.asarray(params[name]["bias"]), np.float32(bias))
        assert np.abs(kernel).max() <= 2 * stddev  # truncated at two standard deviations
        # a normal cut at +-2 sigma keeps 0.88 sigma of spread
        np.testing.assert_allclose(kernel.std(), 0.8796 * stddev, rtol=0.1)
    with pytest.raises(ValueError, match="weight_init"):
        init_params(McMahanCNN(weight_init="he"), (24, 24, 3), jax.random.PRNGKey(0))


def test_mcmahan_cnn_trains_in_one_vmapped_round():
    """One FedAvg round on tiny procedural CIFAR-shaped data (3 clients of 6 24x24x3 images, the whole cohort
    in one vmap): every layer moves and the training loss falls. (The round compiles in about 4 s; FOLA's
    takes 2-3 s longer and runs the same model code.)"""
    import bfedjax as bf
    rng = np.random.default_rng(0)
    labels = np.arange(18) % 3
    # each class a different colour plus noise: learnable, so one round lowers the training loss
    images = (rng.normal(size=(18, 24, 24, 3)) * 0.5 + np.eye(3)[labels][:, None, None, :]).astype(np.float32)
    parts = [np.arange(0, 6), np.arange(6, 12), np.arange(12, 18)]
    fed = bf.data.stack_clients(images, labels, parts, x_test=images, y_test=labels, num_classes=3)
    model = get_model("mcmahan_cnn", 3)
    # training only (no evaluation hook to compile): the loss below checks what the round learnt
    algo = bf.algorithms.build("fedavg", model, fed, lr=0.05, batch_size=6, local_epochs=1).replace(evaluate=None)
    init = init_params(model, (24, 24, 3), jax.random.PRNGKey(0))
    res = bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(1), init_params=init, clients_per_chunk=None,
                      evaluate_local=False)
    assert res.clients_per_chunk is None  # one vmap over the cohort
    final = res.state.server["params"]
    assert jax.tree.structure(final) == jax.tree.structure(init)
    changed = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))  # numpy: no compile per leaf shape
               for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(init))]
    assert min(changed) > 0 and np.all(np.isfinite(changed))  # every layer trained
    loss = jax.jit(lambda p: bf.losses.masked_mean_cross_entropy(
        bf.models.apply_fn_of(model), p, bf.core.Batch(images, labels, np.ones(18, np.float32))))
    assert float(loss(final)) < float(loss(init))


def test_mcmahan_cnn_bfloat16_compute():
    """compute_dtype="bfloat16": float32 parameters, every product (LRN's window sums included) in bfloat16,
    float32 logits; lowered only, nothing compiled."""
    full, mixed = get_model("mcmahan_cnn", NUM_CLASSES), get_model("mcmahan_cnn", NUM_CLASSES, compute_dtype="bfloat16")
    assert mixed.dtype == jnp.bfloat16
    params = _abstract_params(mixed, (24, 24, 3))
    assert jax.tree.all(jax.tree.map(lambda leaf: leaf.dtype == jnp.float32, params))
    x = jax.ShapeDtypeStruct((2, 24, 24, 3), jnp.float32)
    for model, want in ((mixed, "bf16>"), (full, "f32>")):
        lowered = jax.jit(model.apply).lower({"params": params}, x)
        products = [line for line in lowered.as_text().splitlines()
                    if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]
        assert len(products) == 7 and all(want in line for line in products)  # 2 convs, 2 LRN sums, 3 dense
        if model is mixed:
            assert all("f32>" not in line for line in products)
    assert jax.eval_shape(mixed.apply, {"params": params}, x).dtype == jnp.float32
