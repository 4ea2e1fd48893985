"""PyTorch's parameter initialisations, for zoo models that follow a paper's PyTorch code.

Flax kernels are ``HWIO`` (convolutions) or ``[in, out]`` (dense), so Flax's fan-in and fan-out are
PyTorch's: ``fan_in = in_channels / groups * kh * kw``, ``fan_out = out_channels * kh * kw``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn

# nn.Linear's and nn.Conv2d's default kernel init (kaiming_uniform with a = sqrt(5)): U(-1/sqrt(fan_in), +).
TORCH_KERNEL_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")

# torch.nn.init.kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, 2 / fan_out), not truncated
# (torchvision's MobileNetV3 and ResNets initialise their convolutions so).
KAIMING_NORMAL_FAN_OUT = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # jax: "normal" is untruncated


def torch_uniform_init(fan_in: int):
    """PyTorch's default for conv/linear biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


__all__ = ["TORCH_KERNEL_INIT", "KAIMING_NORMAL_FAN_OUT", "torch_uniform_init"]
