"""Flat draws reshaped are bitwise JAX's draws of the shape (the library's rounds draw flat to compile faster)."""
import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

from bfedjax import flat_random
from bfedjax.vi.flat_normal import FlatDrawNormal

SHAPES = [(3, 3, 16, 8), (32, 1, 1, 16), (7,), ()]


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_flat_draws_are_the_shaped_draws_bitwise(shape, partitionable):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    with jax.threefry_partitionable(partitionable):
        for draw, flat in ((jax.random.normal, flat_random.normal), (jax.random.rademacher, flat_random.rademacher)):
            shaped = jax.vmap(lambda key: draw(key, shape))(keys)  # under a client vmap, as in a round
            np.testing.assert_array_equal(jax.vmap(lambda key: flat(key, shape))(keys), shaped)
        np.testing.assert_array_equal(flat_random.normal(keys[0], shape, jnp.float16),
                                      jax.random.normal(keys[0], shape, jnp.float16))


def test_flat_draw_normal_samples_as_numpyro_normal():
    loc, scale = jnp.arange(24.0).reshape(2, 3, 4), jnp.full((2, 3, 4), 0.3)
    key = jax.random.PRNGKey(1)
    flat, plain = FlatDrawNormal(loc, scale).to_event(3), dist.Normal(loc, scale).to_event(3)
    np.testing.assert_array_equal(flat.sample(key, (5,)), plain.sample(key, (5,)))
    np.testing.assert_array_equal(flat.rsample(key), plain.rsample(key))
    prior = dist.Normal(0.0, 10.0).expand(loc.shape).to_event(3)
    assert float(dist.kl_divergence(flat, prior)) == float(dist.kl_divergence(plain, prior))
    assert not np.array_equal(flat.sample(key), flat.sample(jax.random.PRNGKey(2)))
