"""Tests for bfedjax.models.winograd: the Toom-Cook matrices, and the convolution's value and gradients against lax."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from bfedjax.models import winograd

NHWC = ("NHWC", "HWIO", "NHWC")


@pytest.mark.parametrize("m,r", [(2, 3), (4, 3), (2, 5), (3, 5), (4, 5), (6, 3)])
def test_matrices_compute_the_one_dimensional_correlation(m, r):
    a_t, g, b_t = winograd.winograd_matrices(m, r)
    n = m + r - 1
    assert a_t.shape == (m, n) and g.shape == (n, r) and b_t.shape == (n, n)
    rng = np.random.default_rng(0)
    for _ in range(5):
        d, k = rng.normal(size=n), rng.normal(size=r)
        want = np.array([k @ d[i:i + r] for i in range(m)])
        np.testing.assert_allclose(a_t @ ((g @ k) * (b_t @ d)), want, atol=1e-10)


def test_matrices_refuse_more_points_than_they_have():
    with pytest.raises(ValueError, match="F\\(10, 5\\)"):
        winograd.winograd_matrices(10, 5)


@pytest.mark.parametrize("m,shape,kernel", [(4, (2, 24, 24, 8), (5, 5, 8, 6)),   # whole tiles (20 = 5 x 4)
                                            (4, (3, 10, 10, 8), (5, 5, 8, 4)),   # 6 outputs: the last tile cropped
                                            (3, (2, 13, 9, 4), (5, 5, 4, 3)),    # H != W, partial tiles
                                            (4, (2, 11, 11, 5), (3, 3, 5, 7)),
                                            (2, (1, 5, 5, 2), (3, 3, 2, 2))])    # one tile
def test_winograd_conv_gives_lax_value_and_gradients(m, shape, kernel):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    w = jax.random.normal(jax.random.PRNGKey(1), kernel) * 0.2
    ref = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=NHWC)
    got = winograd.winograd_conv(x, w, m)
    want = ref(x, w)
    assert got.shape == want.shape
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=3e-5 * scale)
    np.testing.assert_allclose(winograd.winograd_forward(x, w, m), want, atol=3e-5 * scale)
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
    fast = lambda x, w: winograd.winograd_conv(x, w, m)
    for got, want in zip(jax.grad(loss(fast), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, atol=5e-5 * float(jnp.max(jnp.abs(want))))


def _primitives(fn, *args) -> set:
    """The primitives of ``fn``'s jaxpr and of every jaxpr nested in it."""
    from jax.extend.core import jaxprs_in_params
    found, todo = set(), [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            found.add(eqn.primitive.name)
            todo += list(jaxprs_in_params(eqn.params))
    return found


def test_per_client_conv_alone_takes_winograd_with_asymmetric_padding():
    """``per_client_conv(..., winograd=4)`` alone: under grad its value and both gradients are lax's for an
    asymmetrically padded, non-square input (the crop of the padded input gradient), and no convolution runs."""
    from bfedjax.models.conv import per_client_conv
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 9, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (5, 5, 8, 3)) * 0.2
    pads = ((0, 2), (1, 0))
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
    fast = loss(lambda x, w: per_client_conv(x, w, (1, 1), pads, None, 4))
    ref = loss(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), pads, dimension_numbers=NHWC))
    (value, grads), (want_value, want_grads) = (jax.value_and_grad(f, (0, 1))(x, w) for f in (fast, ref))
    np.testing.assert_allclose(value, want_value, atol=1e-4)  # the forward under grad: Winograd's (a sum of 270 sines)
    for got, want in zip(grads, want_grads):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=5e-5 * float(jnp.max(jnp.abs(want))))
    assert "conv_general_dilated" not in _primitives(jax.grad(fast, (0, 1)), x, w)
    with pytest.raises(ValueError, match="stride 1 and a square kernel"):
        jax.grad(loss(lambda x, w: per_client_conv(x, w, (2, 2), pads, None, 4)))(x, w)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="WINOGRAD_TILES lists the CPU only")
def test_fedreg_cnn_gradient_with_winograd_matches_xla_convolutions(monkeypatch):
    """The model a CPU trains alone with Winograd conv2/conv3 (5x5, 32 channels; no convolution left in its
    gradient) has the gradient it has with XLA's convolutions."""
    from bfedjax.models import apply_fn_of, conv, get_model, zoo
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
        return jax.grad(loss)(params), _primitives(jax.grad(loss), params)

    try:
        (with_winograd, winograd_ops), (without, xla_ops) = gradient({5: 4}), gradient({})
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert "conv_general_dilated" not in winograd_ops and "conv_general_dilated" in xla_ops
    for got, want in zip(jax.tree.leaves(with_winograd), jax.tree.leaves(without)):
        np.testing.assert_allclose(got, want, atol=1e-4 * float(jnp.max(jnp.abs(want))) + 1e-7)
