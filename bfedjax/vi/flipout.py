"""Flipout (Wen et al., 2018) for the dense and conv layers of any Flax model.

For a layer with kernel posterior N(mu, sigma^2) and one shared noise draw
``delta = sigma * eps`` per forward pass, Flipout gives each example its own
pseudo-independent perturbation by random sign flips:

    y = layer(x; mu, b) + layer_no_bias(x * s_in; delta) * s_out

with ``s_in`` ``[B, 1.., C_in]`` and ``s_out`` ``[B, 1.., C_out]`` independent
+-1 signs per example and channel (broadcast over spatial positions for
convolutions, as TFP's Flipout layers do). Each example's output has the same
marginal as with its own weight sample, but the gradient variance across a
mini-batch is lower than when every example shares one sample (Fischer et
al.'s TFP layers use Flipout, and it is the library's default estimator).

The layers are left untouched: ``flipout_interceptor`` wraps every
``nn.Dense`` / ``nn.Conv`` call through ``flax.linen.intercept_methods``, so
any model of the zoo (MLPs, CNNs, ResNet-20 with BatchNorm) works as is.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

FLIPOUT_LAYERS = (nn.Dense, nn.Conv)


def _signs(key, y) -> jax.Array:
    """Random +-1 of shape ``[B, 1, .., 1, C]`` for a layer input or output ``y [B, ..., C]``."""
    shape = y.shape[:1] + (1,) * (y.ndim - 2) + y.shape[-1:] if y.ndim >= 2 else y.shape
    return jax.random.rademacher(key, shape, dtype=y.dtype)


def flipout_interceptor(kernel_noise: dict, key):
    """A ``flax.linen.intercept_methods`` interceptor applying Flipout to the listed layers.

    Args:
      kernel_noise: module path (tuple of names, as ``module.path``) -> the kernel
        perturbation ``delta`` of that layer, same shape as its kernel. Layers not
        listed run unchanged. The model must be applied with the kernel *means* as
        its kernels.
      key: PRNG key of this forward pass; each perturbed layer folds in its call index.
    """
    calls = [0]
    busy = [False]  # the perturbation pass applies the layer again: let that call through

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if busy[0] or context.method_name != "__call__" or not isinstance(module, FLIPOUT_LAYERS):
            return next_fun(*args, **kwargs)
        delta = kernel_noise.get(tuple(module.path))
        if delta is None:
            return next_fun(*args, **kwargs)
        mean = next_fun(*args, **kwargs)
        x = args[0] if args else kwargs["inputs"]
        key_in, key_out = jax.random.split(jax.random.fold_in(key, calls[0]))
        calls[0] += 1
        busy[0] = True
        try:
            layer = module.clone(parent=None, use_bias=False)
            noise = layer.apply({"params": {"kernel": delta}}, x * _signs(key_in, x))
        finally:
            busy[0] = False
        return mean + noise * _signs(key_out, mean)

    return interceptor


def flipout_apply(apply_fn, kernel_noise: dict, key, *args, **kwargs):
    """``apply_fn(*args, **kwargs)`` with Flipout on the layers of ``kernel_noise`` (see the interceptor).

    ``apply_fn`` must hold the kernel means of those layers.
    """
    with nn.intercept_methods(flipout_interceptor(kernel_noise, key)):
        return apply_fn(*args, **kwargs)
