"""ResNet-9 with Fixup initialisation, FedReg's CIFAR-10 and CIFAR-100 model (spec ``fedreg.md`` section 5.1).

FedReg (Xu et al.) trains this network from scratch on CIFAR-10 (10,000 clients x 5 images) and CIFAR-100
(50,000 clients x 1 image), as Rothchild et al. (FetchSGD) did. It has no normalisation layers: Fixup
(Zhang et al. 2019) replaces BatchNorm by scalar biases and multipliers and an initialisation that starts
every residual branch at zero, so per-client training of one or five images needs no batch statistics
(FedReg's pseudo-data generation also refuses BatchNorm models). The layers (input ``[B, 32, 32, 3]``)::

    prep    relu(conv3x3_64(x + a) * s + b)                               32x32x64
    layer1  relu(conv3x3_128(x + a) * s + b) -> MaxPool 2 -> FixupBlock   16x16x128
    layer2  relu(conv3x3_256(x + a) * s + b) -> MaxPool 2                 8x8x256
    layer3  relu(conv3x3_512(x + a) * s + b) -> MaxPool 2 -> FixupBlock   4x4x512
    head    MaxPool 4 -> flatten (512) -> Dense(K)(x + bias2)

    FixupBlock(x) = relu(x + conv2(relu(conv1(x + bias1a) + bias1b) + bias2a) * scale + bias2b)

``a``, ``b``, ``s`` (``bias1a``, ``bias1b``, ``scale``) and the block's ``bias1a``, ``bias1b``, ``bias2a``,
``bias2b``, ``scale`` are scalars (shape ``[1]``); convolutions are 3x3, padding 1, no bias.

Initialisation (spec): convolution kernels normal with standard deviation ``sqrt(2 / (out_channels * 9))``
(He's fan-out), the blocks' first convolution that times ``num_layers ** -0.5`` with ``num_layers = 2``,
the blocks' second convolution zero, the dense kernel and bias zero, biases 0 and scales 1. At
initialisation every block is therefore the identity and the logits are zero.

Parameters: 6,568,673 for K = 10 and 6,614,843 for K = 100 (23 scalars among them;
``fixup_resnet9_param_count``).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bfedjax.models.conv import conv_general_dilated as zoo_conv
from bfedjax.models.pooling import max_pool
from bfedjax.models.torch_init import KAIMING_NORMAL_FAN_OUT

STAGES = (("prep", 64, 0, False), ("layer1", 128, 1, True), ("layer2", 256, 0, True), ("layer3", 512, 1, True))
"""``(name, channels, Fixup blocks, max-pool 2)`` of the four convolutional layers, in order."""

NUM_RESIDUAL_BRANCHES = 2  # Fixup's L: the blocks' first convolutions are scaled by L ** -0.5 (m = 2 layers a branch)


def _scalar(module: nn.Module, name: str, value: float) -> jax.Array:
    """A learned scalar ``[1]`` (a Fixup bias or multiplier), float32 like every zoo parameter."""
    return module.param(name, nn.initializers.constant(value), (1,), jnp.float32)


def _conv3x3(features: int, kernel_init, dtype, name: str) -> nn.Conv:
    return nn.Conv(features, (3, 3), padding=((1, 1), (1, 1)), use_bias=False, kernel_init=kernel_init,
                   dtype=dtype, name=name, conv_general_dilated=zoo_conv)


class FixupBlock(nn.Module):
    """Fixup's basic block at constant width: ``[B, H, W, C] -> [B, H, W, C]`` (identity at initialisation)."""

    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scalar = lambda name, value: _scalar(self, name, value).astype(self.dtype)  # noqa: E731
        branch_init = nn.initializers.variance_scaling(2.0 / NUM_RESIDUAL_BRANCHES, "fan_out", "normal")
        y = _conv3x3(self.features, branch_init, self.dtype, "conv1")(x + scalar("bias1a", 0.0))
        y = nn.relu(y + scalar("bias1b", 0.0))
        y = _conv3x3(self.features, nn.initializers.zeros, self.dtype, "conv2")(y + scalar("bias2a", 0.0))
        return nn.relu(x + y * scalar("scale", 1.0) + scalar("bias2b", 0.0))


class FixupLayer(nn.Module):
    """``relu(conv3x3(x + bias1a) * scale + bias1b)``, then an optional 2x2 max-pool and ``blocks`` Fixup blocks.

    ``[B, H, W, C_in] -> [B, H', W', features]`` with ``H' = H // 2`` when ``pool``, else ``H``.
    """

    features: int
    blocks: int = 0
    pool: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scalar = lambda name, value: _scalar(self, name, value).astype(self.dtype)  # noqa: E731
        x = _conv3x3(self.features, KAIMING_NORMAL_FAN_OUT, self.dtype, "conv")(x + scalar("bias1a", 0.0))
        x = nn.relu(x * scalar("scale", 1.0) + scalar("bias1b", 0.0))
        if self.pool:
            x = max_pool(x, 2)
        for i in range(self.blocks):
            x = FixupBlock(self.features, self.dtype, name=f"block{i}")(x)
        return x


class FixupResNet9(nn.Module):
    """FedReg's ResNet-9 with Fixup: ``[B, 32, 32, C] -> [B, num_classes]`` logits (float32), no normalisation.

    Other input sizes raise a ``ValueError`` (the head pools the last 4x4 map, 32 / 8, to one vector).
    """

    num_classes: int = 10
    dtype: Any = jnp.float32  # compute dtype; parameters and logits stay float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, self.dtype)
        for name, features, blocks, pool in STAGES:
            x = FixupLayer(features, blocks, pool, self.dtype, name=name)(x)
        if x.shape[1:3] != (4, 4):
            raise ValueError(f"FixupResNet9 takes 32x32 images (its head pools the last 4x4 map to one vector), got "
                             f"{x.shape[1] * 8}x{x.shape[2] * 8}-sized maps; fix: CIFAR-sized data "
                             "(--dataset=cifar10 or cifar100) or another --model")
        x = max_pool(x, 4).reshape((x.shape[0], -1))
        x = x + _scalar(self, "bias2", 0.0).astype(self.dtype)
        x = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, bias_init=nn.initializers.zeros,
                     dtype=self.dtype, name="linear")(x)
        return x.astype(jnp.float32)


def fixup_resnet9_param_count(num_classes: int = 10, in_channels: int = 3) -> int:
    """Parameters of ``FixupResNet9`` counted from ``STAGES`` (for tests and docs)."""
    total, cin = 0, in_channels
    for _, features, blocks, _ in STAGES:
        total += 9 * cin * features + 3  # conv kernel, bias1a, scale, bias1b
        total += blocks * (2 * 9 * features * features + 5)  # conv1, conv2 and five scalars a block
        cin = features
    return total + 1 + cin * num_classes + num_classes  # bias2, dense kernel and bias


__all__ = ["FixupResNet9", "FixupBlock", "FixupLayer", "STAGES", "fixup_resnet9_param_count"]
