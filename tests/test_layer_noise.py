"""Flipout and local reparameterisation: per-example moments equal to independent weight samples,
lower-variance gradients."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.vi import MeanFieldConfig, MeanFieldVI, meanfield
from bfedjax.vi.layer_noise import flipout_apply, local_reparameterization_apply


def _layer_moments(layer, x, estimator, samples=4000):
    """MC mean/var of the estimator's outputs, and the analytic ones of independent N(mu, sigma^2) kernels."""
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    sigma = 0.3 * jax.random.uniform(jax.random.PRNGKey(1), params["kernel"].shape)
    path = ()  # a top-level layer has the empty module path

    def one(key):
        k_eps, k_flip = jax.random.split(key)
        if estimator == "local_reparameterization":
            return local_reparameterization_apply(lambda: layer.apply({"params": params}, x), {path: sigma}, key)
        delta = sigma * jax.random.normal(k_eps, sigma.shape)
        return flipout_apply(lambda: layer.apply({"params": params}, x), {path: delta}, k_flip)

    out = jax.vmap(one)(jax.random.split(jax.random.PRNGKey(2), samples))
    mean = layer.apply({"params": params}, x)
    # each output is linear in the kernel: its variance is the layer applied to x^2 with kernel sigma^2
    var = layer.clone(use_bias=False).apply({"params": {"kernel": sigma ** 2}}, x ** 2)
    return out, mean, var


@pytest.mark.parametrize("estimator", ["flipout", "local_reparameterization"])
@pytest.mark.parametrize("layer,shape", [(nn.Dense(5), (3, 7)), (nn.Conv(4, (3, 3)), (2, 6, 6, 2))])
def test_outputs_have_the_moments_of_independent_samples(layer, shape, estimator):
    x = jax.random.normal(jax.random.PRNGKey(3), shape)
    out, mean, var = _layer_moments(layer, x, estimator)
    np.testing.assert_allclose(out.mean(0), mean, atol=4 * np.sqrt(float(var.max()) / out.shape[0]))
    np.testing.assert_allclose(out.var(0), var, rtol=0.15, atol=1e-4)


def test_flipout_gives_each_example_its_own_perturbation():
    layer = nn.Dense(4)
    x = jnp.ones((2, 3))  # two identical examples
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    delta = jax.random.normal(jax.random.PRNGKey(1), params["kernel"].shape)
    out = flipout_apply(lambda: layer.apply({"params": params}, x), {(): delta}, jax.random.PRNGKey(2))
    assert not np.allclose(out[0], out[1])
    zero = flipout_apply(lambda: layer.apply({"params": params}, x), {(): jnp.zeros_like(delta)},
                         jax.random.PRNGKey(2))
    np.testing.assert_allclose(zero, layer.apply({"params": params}, x), rtol=1e-6)


def test_local_reparameterization_draws_noise_per_example_and_position():
    layer = nn.Conv(3, (1, 1))
    x = jnp.ones((2, 2, 2, 1))  # two identical examples of four identical pixels
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    sigma = jnp.full(params["kernel"].shape, 0.5)
    noise = local_reparameterization_apply(lambda: layer.apply({"params": params}, x), {(): sigma},
                                           jax.random.PRNGKey(2)) - layer.apply({"params": params}, x)
    assert len(np.unique(np.asarray(noise).round(6))) == noise.size  # every example, pixel and unit its own


def test_mean_field_passes_the_posterior_scale_to_local_reparameterization(digits, monkeypatch):
    seen = []
    real = meanfield.local_reparameterization_apply
    monkeypatch.setattr(meanfield, "local_reparameterization_apply",
                        lambda apply, scales, key, *a, **k: seen.append(scales) or real(apply, scales, key, *a, **k))
    model = bf.models.get_model("mlp", 10, hidden=(8,))
    vi = MeanFieldVI(model, digits.x_train.shape[1:], MeanFieldConfig(gradient_estimator="local_reparameterization"))
    x, y = jnp.asarray(digits.x_train[:4]), jnp.asarray(digits.y_train[:4])
    key = jax.random.PRNGKey(0)
    posterior = vi.init_posterior(key)
    posterior["scale"]["Dense_0"]["kernel"] = jnp.full((64, 8), 0.3)
    state = vi.init_svi_state(key, x, y, jnp.float32(4), posterior)
    vi.svi.loss.loss(key, vi.svi.get_params(state), vi.svi.model, vi.svi.guide, x, y, jnp.ones(4), jnp.float32(4))
    np.testing.assert_allclose(seen[-1][("Dense_0",)], 0.3, rtol=1e-6)  # sigma itself, constrained
    np.testing.assert_allclose(seen[-1][("Dense_1",)], MeanFieldConfig.init_scale, rtol=1e-6)


def test_local_reparameterization_noise_is_zero_with_a_zero_gradient_where_the_input_is():
    layer = nn.Dense(4)
    x = jnp.zeros((2, 3)).at[1].set(1.0)  # example 0 has no input, so its outputs have no variance
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    sigma = jnp.full(params["kernel"].shape, 0.5)

    def out(sigma):
        return local_reparameterization_apply(lambda: layer.apply({"params": params}, x), {(): sigma},
                                              jax.random.PRNGKey(2))

    np.testing.assert_array_equal(out(sigma)[0], params["bias"])
    assert not np.allclose(out(sigma)[1], layer.apply({"params": params}, x)[1])
    grad = jax.grad(lambda s: jnp.sum(out(s)))(sigma)
    assert np.isfinite(np.asarray(grad)).all()
    # y_1j = mean_1j + sqrt(sum_i sigma_ij^2) eps_j: d/dsigma_ij = sigma_ij eps_j / sqrt(sum_i sigma_ij^2)
    eps = (out(sigma)[1] - layer.apply({"params": params}, x)[1]) / jnp.sqrt(3 * 0.25)
    np.testing.assert_allclose(grad, jnp.broadcast_to(0.5 * eps / jnp.sqrt(0.75), grad.shape), rtol=1e-5)


def _loc_gradients(vi, x, y, keys):
    """Gradient of the negative ELBO w.r.t. the first kernel's loc, one per key ``[S, ...]``."""
    key0 = jax.random.PRNGKey(0)
    state = vi.init_svi_state(key0, x, y, jnp.float32(len(y)), vi.init_posterior(key0))
    params = vi.svi.get_params(state)
    name = "net/Dense_0.kernel_loc"

    def loss(loc, key):
        return vi.svi.loss.loss(key, {**params, name: loc}, vi.svi.model, vi.svi.guide, x, y,
                                jnp.ones(len(y)), jnp.float32(len(y)))

    return jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(params[name], keys)


def test_flipout_and_local_reparameterization_lower_the_gradient_variance(digits):
    model = bf.models.get_model("mlp", 10, hidden=(32,))
    x, y = jnp.asarray(digits.x_train[:64]), jnp.asarray(digits.y_train[:64])
    keys = jax.random.split(jax.random.PRNGKey(5), 64)
    spread = {}
    for estimator in ("flipout", "local_reparameterization", "reparameterization"):
        vi = MeanFieldVI(model, digits.x_train.shape[1:], MeanFieldConfig(init_scale=0.2, gradient_estimator=estimator))
        grads = _loc_gradients(vi, x, y, keys)
        assert np.isfinite(np.asarray(grads)).all()
        spread[estimator] = float(grads.var(0).sum())
    assert spread["flipout"] < 0.5 * spread["reparameterization"], spread
    assert spread["local_reparameterization"] < 0.5 * spread["reparameterization"], spread
    assert spread["local_reparameterization"] < spread["flipout"], spread  # no kernel noise shared by the batch


class _TinyCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("estimator", ["flipout", "local_reparameterization"])
def test_estimator_option_and_conv_model(small_fed, estimator):
    with pytest.raises(ValueError, match="gradient_estimator"):
        MeanFieldConfig(gradient_estimator="local")
    # a variational CNN (conv and dense layers with the estimator) trains in the vmapped round
    algorithm = bf.algorithms.bfl(_TinyCNN(), small_fed.input_shape, lr=3e-2, batch_size=32,
                                  gradient_estimator=estimator)
    result = bf.simulate(algorithm, small_fed, rounds=2, key=jax.random.PRNGKey(0), evaluate_local=False)
    assert result.metrics["global_accuracy"][-1] > 0.3
