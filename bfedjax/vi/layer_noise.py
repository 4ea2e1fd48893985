"""Gradient estimators for mean-field Gaussian kernels, applied to the dense and conv layers of any Flax model.

The model is applied with its kernel *means*; an interceptor
(``flax.linen.intercept_methods``) adds noise to the output of every listed
``nn.Dense`` / ``nn.Conv`` call, so any model of the zoo (MLPs, CNNs,
ResNet-20 with BatchNorm) works unchanged. For a kernel posterior
N(mu, sigma^2) with independent weights, ``layer(x)`` below is the layer with
the means and its bias, ``layer_no_bias(x; k)`` the same layer with kernel
``k`` and no bias, for an input ``x [B, ..., C_in]``:

* **Flipout** (Wen et al., 2018), ``flipout_apply``: one shared noise draw
  ``delta = sigma * eps`` per forward pass, with random sign flips per example,

      y = layer(x) + layer_no_bias(x * s_in; delta) * s_out,

  ``s_in`` ``[B, 1.., C_in]`` and ``s_out`` ``[B, 1.., C_out]`` independent +-1
  (broadcast over spatial positions for convolutions, as TFP's Flipout layers).
  Each example's output has the marginal of its own weight sample, with a lower
  gradient variance across a mini-batch than one shared sample (Fischer et al.'s
  TFP layers; the library's default).
* **Local reparameterisation** (Kingma, Salimans and Welling, 2015),
  ``local_reparameterization_apply``: every output unit is Gaussian given the
  input, so it is sampled directly,

      y = layer(x) + sqrt(layer_no_bias(x^2; sigma^2)) * eps,   eps ~ N(0, 1) of y's shape,

  independent per example, position and unit. The marginals are those of
  independent weight samples. For dense layers the estimate of the expected
  log-likelihood is unbiased, as Flipout's; a convolution's outputs at
  different positions lose their correlation, so for convolutional models it
  estimates a close but different objective. No kernel-sized noise is drawn,
  and the gradient variance is lower still (tested on an MLP). Where
  ``layer_no_bias(x^2; sigma^2)`` is 0 (an all-zero receptive field) the noise
  and its gradient are 0.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from bfedjax import flat_random

NOISY_LAYERS = (nn.Dense, nn.Conv)


def _signs(key, y) -> jax.Array:
    """Random +-1 of shape ``[B, 1, .., 1, C]`` for a layer input or output ``y [B, ..., C]``."""
    shape = y.shape[:1] + (1,) * (y.ndim - 2) + y.shape[-1:] if y.ndim >= 2 else y.shape
    return flat_random.rademacher(key, shape, dtype=y.dtype)


def _sqrt_or_zero(v):
    """``sqrt(v)`` with value and gradient 0 where ``v == 0`` (``jnp.sqrt``'s gradient is infinite there)."""
    positive = v > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, v, 1.0)), 0.0)


def _noisy_layers(per_layer: dict, key, noise: Callable):
    """An interceptor adding ``noise(bare, x, mean, value, key)`` to the outputs of the listed layers.

    ``per_layer``: module path (tuple of names, as ``module.path``) -> that layer's kernel-shaped
    value; ``bare`` applies the layer without bias to ``(x, kernel)``; ``mean`` is the layer's own
    output; each listed call folds its call index into ``key``. Unlisted layers run unchanged.
    """
    calls = [0]
    busy = [False]  # the noise pass applies the layer again: let that call through

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if busy[0] or context.method_name != "__call__" or not isinstance(module, NOISY_LAYERS):
            return next_fun(*args, **kwargs)
        value = per_layer.get(tuple(module.path))
        if value is None:
            return next_fun(*args, **kwargs)
        mean = next_fun(*args, **kwargs)
        x = args[0] if args else kwargs["inputs"]
        layer_key = jax.random.fold_in(key, calls[0])
        calls[0] += 1
        layer = module.clone(parent=None, use_bias=False)
        busy[0] = True
        try:
            return mean + noise(lambda x, kernel: layer.apply({"params": {"kernel": kernel}}, x),
                                x, mean, value, layer_key)
        finally:
            busy[0] = False

    return interceptor


def _flipout_noise(bare, x, mean, delta, key):
    """``bare(x * s_in, delta) * s_out`` for ``x [B, ..., C_in]``, ``mean [B, ..., C_out]``, ``delta`` kernel-shaped."""
    key_in, key_out = jax.random.split(key)
    return bare(x * _signs(key_in, x), delta) * _signs(key_out, mean)


def _local_reparameterization_noise(bare, x, mean, sigma, key):
    """``sqrt(bare(x^2, sigma^2)) * eps`` with ``eps ~ N(0, 1)`` of ``mean``'s shape ``[B, ..., C_out]``."""
    std = _sqrt_or_zero(bare(jnp.square(x), jnp.square(sigma)))
    return std * flat_random.normal(key, mean.shape, mean.dtype)


def flipout_interceptor(kernel_noise: dict, key):
    """Flipout on the layers of ``kernel_noise`` (module path -> kernel perturbation ``delta``, kernel-shaped)."""
    return _noisy_layers(kernel_noise, key, _flipout_noise)


def local_reparameterization_interceptor(kernel_scale: dict, key):
    """Local reparameterisation on the layers of ``kernel_scale`` (module path -> the kernel's posterior
    std ``sigma``, kernel-shaped)."""
    return _noisy_layers(kernel_scale, key, _local_reparameterization_noise)


def flipout_apply(apply_fn, kernel_noise: dict, key, *args, **kwargs):
    """``apply_fn(*args, **kwargs)`` with Flipout on the layers of ``kernel_noise``; ``apply_fn`` holds the
    kernel means of those layers."""
    with nn.intercept_methods(flipout_interceptor(kernel_noise, key)):
        return apply_fn(*args, **kwargs)


def local_reparameterization_apply(apply_fn, kernel_scale: dict, key, *args, **kwargs):
    """``apply_fn(*args, **kwargs)`` with local reparameterisation on the layers of ``kernel_scale``;
    ``apply_fn`` holds the kernel means of those layers."""
    with nn.intercept_methods(local_reparameterization_interceptor(kernel_scale, key)):
        return apply_fn(*args, **kwargs)
