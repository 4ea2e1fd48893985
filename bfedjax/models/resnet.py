"""ResNet-20, the CIFAR variant of He et al. (2016), as Fischer et al. use it.

Depth 6n + 2 with n = 3::

    conv3x3(16) -> BN -> ReLU
    3 stages x 3 basic blocks, 16 / 32 / 64 filters (32x32 -> 16x16 -> 8x8 maps),
        stride 2 in the first block of stages 2 and 3
        block: conv3x3 -> BN -> ReLU -> conv3x3 -> BN -> (+ shortcut) -> ReLU
        shortcut: identity, or (where the shape changes) a 1x1 conv + BN
        ("projection", the default) or zero-padded subsampling ("pad", He et al. option A)
    global average pool -> Dense(num_classes)

Input ``[B, 32, 32, C]`` (any spatial size works); output logits ``[B, num_classes]``.
Convolutions have no bias (BatchNorm follows each) and He-normal kernels.

MC dropout: with ``dropout_rate > 0`` a dropout layer follows every
convolution (3x3 and 1x1 projections; ``dropout_on_projections=False``
excludes the latter), and with ``dropout_on_logits`` also the output layer.
Call with ``train=True`` to use batch statistics (and dropout), with
``dropout=True`` for MC-dropout inference; ``mask [B]`` excludes padded rows
from the batch statistics. See ``bfedjax.models.apply``.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from bfedjax.models.conv import conv_general_dilated as zoo_conv

SHORTCUTS = ("projection", "pad")
_CONV_INIT = nn.initializers.he_normal()


class _Unit(nn.Module):
    """conv -> [dropout] -> BN (the unit every conv of the network goes through)."""

    features: int
    kernel: int
    strides: int
    dropout_rate: float
    bn_momentum: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool, dropout: bool, mask):
        x = nn.Conv(self.features, (self.kernel, self.kernel), strides=(self.strides, self.strides),
                    padding="SAME", use_bias=False, kernel_init=_CONV_INIT, dtype=self.dtype,
                    conv_general_dilated=zoo_conv)(x)
        if self.dropout_rate > 0:
            x = nn.Dropout(self.dropout_rate, deterministic=not (train or dropout))(x)
        # statistics are computed in float32 whatever the dtype (flax); running averages stay float32
        return nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum, epsilon=1e-5,
                            dtype=self.dtype)(x, mask=mask)


class _BasicBlock(nn.Module):
    features: int
    strides: int
    shortcut: str
    dropout_rate: float
    projection_dropout: float
    bn_momentum: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool, dropout: bool, mask):
        unit = dict(dropout_rate=self.dropout_rate, bn_momentum=self.bn_momentum, dtype=self.dtype)
        y = nn.relu(_Unit(self.features, 3, self.strides, **unit)(x, train, dropout, mask))
        y = _Unit(self.features, 3, 1, **unit)(y, train, dropout, mask)
        if x.shape[-1] != self.features or self.strides != 1:
            if self.shortcut == "projection":
                x = _Unit(self.features, 1, self.strides, dropout_rate=self.projection_dropout,
                          bn_momentum=self.bn_momentum, dtype=self.dtype)(x, train, dropout, mask)
            else:  # option A: subsample, zero-pad the new channels
                x = x[:, ::self.strides, ::self.strides, :]
                extra = self.features - x.shape[-1]
                x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
        return nn.relu(x + y)


class ResNet20(nn.Module):
    """ResNet-20 (CIFAR). ``__call__(x [B, H, W, C], *, train=False, dropout=False, mask=None) -> [B, K]``."""

    num_classes: int = 10
    shortcut: str = "projection"
    dropout_rate: float = 0.0
    dropout_on_projections: bool = True
    dropout_on_logits: bool = False
    bn_momentum: float = 0.9
    blocks_per_stage: int = 3
    dtype: Any = jnp.float32  # compute dtype (e.g. jnp.bfloat16); parameters and logits stay float32

    uses_batch_stats = True  # see bfedjax.models.apply

    @nn.compact
    def __call__(self, x, *, train: bool = False, dropout: bool = False, mask=None):
        if self.shortcut not in SHORTCUTS:
            raise ValueError(f"shortcut={self.shortcut!r}; choose one of {SHORTCUTS}")
        bn_mask = None if mask is None else (jnp.asarray(mask) > 0)[:, None, None, None]
        x = jnp.asarray(x, self.dtype)
        x = nn.relu(_Unit(16, 3, 1, self.dropout_rate, self.bn_momentum, self.dtype)(x, train, dropout, bn_mask))
        for stage, features in enumerate((16, 32, 64)):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _BasicBlock(features, strides, self.shortcut, self.dropout_rate,
                                self.dropout_rate if self.dropout_on_projections else 0.0,
                                self.bn_momentum, self.dtype)(x, train, dropout, bn_mask)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        if self.dropout_rate > 0 and self.dropout_on_logits:
            x = nn.Dropout(self.dropout_rate, deterministic=not (train or dropout))(x)
        return x.astype(jnp.float32)


def resnet20_param_count(num_classes: int = 10, in_channels: int = 3, shortcut: str = "projection") -> int:
    """Trainable parameters of ``ResNet20`` counted from the architecture (for tests and docs)."""
    def unit(cin, cout, k):
        return k * k * cin * cout + 2 * cout  # conv kernel + BN scale and bias
    total = unit(in_channels, 16, 3)
    cin = 16
    for features in (16, 32, 64):
        for block in range(3):
            total += unit(cin, features, 3) + unit(features, features, 3)
            if cin != features and shortcut == "projection":
                total += unit(cin, features, 1)
            cin = features
    return total + 64 * num_classes + num_classes


__all__ = ["ResNet20", "SHORTCUTS", "resnet20_param_count"]

