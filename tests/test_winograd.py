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
    fast = lambda x, w: winograd.winograd_conv(x, w, m)
    # every function jitted: one compile each rather than an eager compile per operation
    got, want = jax.jit(fast)(x, w), jax.jit(ref)(x, w)
    assert got.shape == want.shape
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=3e-5 * scale)
    np.testing.assert_allclose(jax.jit(winograd.winograd_forward, static_argnums=2)(x, w, m), want, atol=3e-5 * scale)
    loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
    gradients = lambda conv: jax.jit(jax.grad(loss(conv), (0, 1)))(x, w)
    for got, want in zip(gradients(fast), gradients(ref)):
        np.testing.assert_allclose(got, want, atol=5e-5 * float(jnp.max(jnp.abs(want))))
