"""MobileNetV3-Small (Howard et al. 2019) as torchvision builds it: FedRef's MNIST model (spec ``fedref.md`` §5).

FedRef's authors train torchvision's ``mobilenet_v3_small()`` from random initialisation with its classifier
replaced by one ``Linear(576, 10)``, on MNIST digits resized to 64x64 with the grey channel replicated to
three. ``MobileNetV3Small`` does that resizing itself (``input_size``, bilinear; a no-op on 64x64x3 inputs),
so the federated data stay 28x28x1.

Layers (torchvision's table; ``k`` kernel, ``exp`` expanded width, ``SE`` squeeze-and-excitation, ``RE``
ReLU, ``HS`` hard-swish), with the map sizes of a 64x64 input::

    stem      conv3x3(16), stride 2, BN, HS                                   32x32x16
    bneck     k  exp  out  SE  act  stride
              3   16   16   y   RE   2                                         16x16x16
              3   72   24   -   RE   2                                         8x8x24
              3   88   24   -   RE   1
              5   96   40   y   HS   2                                         4x4x40
              5  240   40   y   HS   1   (x2)
              5  120   48   y   HS   1
              5  144   48   y   HS   1
              5  288   96   y   HS   2                                         2x2x96
              5  576   96   y   HS   1   (x2)
    last      conv1x1(576), BN, HS; global average pool; Dense(num_classes)

A block: 1x1 expansion conv + BN + act (absent when ``exp`` equals the input width), depthwise kxk conv
(stride, padding ``(k - 1) // 2`` on each side as PyTorch) + BN + act, squeeze-and-excitation
(``x * hard_sigmoid(fc2(relu(fc1(mean_hw(x)))))``, 1x1 convs with biases, squeeze width
``make_divisible(exp // 4, 8)``), 1x1 projection conv + BN; the input is added back when the stride is 1
and the widths match. Convolutions before BatchNorm have no bias.

Initialisation (torchvision's): convolutions N(0, 2 / fan_out) (``KAIMING_NORMAL_FAN_OUT``), their biases
0; BatchNorm scale 1, bias 0; the replaced classifier is a fresh ``nn.Linear``, so PyTorch's default
U(+-1/sqrt(576)) for kernel and bias. BatchNorm: epsilon 1e-3 and PyTorch's momentum 0.01 (Flax's 0.99);
Flax keeps the biased batch variance in its running average where PyTorch keeps the unbiased one. ``mask
[B]`` excludes padded rows from the batch statistics (``models.apply``).

Parameters: 927,008 before the classifier (torchvision's 2,542,856 less its 576-1024-1000 classifier),
932,778 with ``Dense(10)``; plus 12,112 BatchNorm statistics (``mobilenet_v3_small_param_count``).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bfedjax.models.conv import conv_general_dilated as zoo_conv
from bfedjax.models.torch_init import KAIMING_NORMAL_FAN_OUT, TORCH_KERNEL_INIT, torch_uniform_init

# (kernel, expanded width, output width, squeeze-and-excitation, activation, stride): torchvision's table.
BNECK = (
    (3, 16, 16, True, "RE", 2),
    (3, 72, 24, False, "RE", 2),
    (3, 88, 24, False, "RE", 1),
    (5, 96, 40, True, "HS", 2),
    (5, 240, 40, True, "HS", 1),
    (5, 240, 40, True, "HS", 1),
    (5, 120, 48, True, "HS", 1),
    (5, 144, 48, True, "HS", 1),
    (5, 288, 96, True, "HS", 2),
    (5, 576, 96, True, "HS", 1),
    (5, 576, 96, True, "HS", 1),
)
STEM_WIDTH = 16
LAST_WIDTH = 576
_ACTIVATIONS = {"RE": nn.relu, "HS": jax.nn.hard_swish}


def make_divisible(value: float, divisor: int = 8) -> int:
    """The nearest multiple of ``divisor`` at least ``divisor`` and not below 90% of ``value`` (MobileNet's rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class _ConvBN(nn.Module):
    """conv (no bias; ``groups`` = depthwise when equal to the width) -> BatchNorm -> optional activation."""

    features: int
    kernel: int
    strides: int = 1
    groups: int = 1
    activation: str | None = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool, mask):
        pad = (self.kernel - 1) // 2
        x = nn.Conv(self.features, (self.kernel, self.kernel), strides=(self.strides, self.strides),
                    padding=((pad, pad), (pad, pad)), feature_group_count=self.groups, use_bias=False,
                    kernel_init=KAIMING_NORMAL_FAN_OUT, dtype=self.dtype, conv_general_dilated=zoo_conv)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=1e-3, dtype=self.dtype)(x, mask=mask)
        return x if self.activation is None else _ACTIVATIONS[self.activation](x)


class _SqueezeExcitation(nn.Module):
    """``x * hard_sigmoid(fc2(relu(fc1(mean over H, W of x))))``, per image; ``[B, H, W, C] -> same``."""

    squeeze: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        conv = lambda features, name: nn.Conv(features, (1, 1), kernel_init=KAIMING_NORMAL_FAN_OUT,  # noqa: E731
                                              bias_init=nn.initializers.zeros, dtype=self.dtype, name=name,
                                              conv_general_dilated=zoo_conv)
        scale = jnp.mean(x, axis=(1, 2), keepdims=True)
        scale = conv(x.shape[-1], "fc2")(nn.relu(conv(self.squeeze, "fc1")(scale)))
        return x * jax.nn.hard_sigmoid(scale)


class _InvertedResidual(nn.Module):
    kernel: int
    expanded: int
    features: int
    use_se: bool
    activation: str
    strides: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool, mask):
        y = x
        if self.expanded != x.shape[-1]:
            y = _ConvBN(self.expanded, 1, activation=self.activation, dtype=self.dtype, name="expand")(y, train, mask)
        y = _ConvBN(self.expanded, self.kernel, self.strides, groups=self.expanded, activation=self.activation,
                    dtype=self.dtype, name="depthwise")(y, train, mask)
        if self.use_se:
            y = _SqueezeExcitation(make_divisible(self.expanded // 4), self.dtype, name="se")(y)
        y = _ConvBN(self.features, 1, dtype=self.dtype, name="project")(y, train, mask)
        return x + y if self.strides == 1 and x.shape[-1] == self.features else y


class MobileNetV3Small(nn.Module):
    """``__call__(x [B, H, W, C], *, train=False, dropout=False, mask=None) -> logits [B, num_classes]``.

    ``x`` is resized (bilinear) to ``input_size`` x ``input_size`` unless it already is (``input_size=None``
    keeps its size), and one grey channel becomes three. ``train=True`` normalises with the batch statistics
    of the rows ``mask`` marks and updates the running ones (``models.apply``).
    """

    num_classes: int = 10
    input_size: int | None = 64
    dtype: Any = jnp.float32  # compute dtype; parameters, BatchNorm statistics and logits stay float32

    uses_batch_stats = True  # see bfedjax.models.apply

    @nn.compact
    def __call__(self, x, *, train: bool = False, dropout: bool = False, mask=None):
        del dropout  # no dropout layers (the replaced classifier has none)
        x = jnp.asarray(x, self.dtype)
        b, h, w, c = x.shape
        if c not in (1, 3):
            raise ValueError(f"MobileNetV3Small takes grey or RGB images [B, H, W, 1 or 3], got {c} channels; "
                             "fix: another --model for this data")
        if self.input_size is not None and (h, w) != (self.input_size, self.input_size):
            x = jax.image.resize(x, (b, self.input_size, self.input_size, c), "bilinear")
        if c == 1:
            x = jnp.broadcast_to(x, (*x.shape[:3], 3))
        bn_mask = None if mask is None else (jnp.asarray(mask) > 0)[:, None, None, None]
        x = _ConvBN(STEM_WIDTH, 3, 2, activation="HS", dtype=self.dtype, name="stem")(x, train, bn_mask)
        for i, (kernel, expanded, features, use_se, activation, strides) in enumerate(BNECK):
            x = _InvertedResidual(kernel, expanded, features, use_se, activation, strides, self.dtype,
                                  name=f"bneck{i}")(x, train, bn_mask)
        x = _ConvBN(LAST_WIDTH, 1, activation="HS", dtype=self.dtype, name="last")(x, train, bn_mask)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, kernel_init=TORCH_KERNEL_INIT, bias_init=torch_uniform_init(LAST_WIDTH),
                     dtype=self.dtype, name="classifier")(x)
        return x.astype(jnp.float32)


def mobilenet_v3_small_param_count(num_classes: int = 10, in_channels: int = 3) -> tuple[int, int]:
    """``(trainable parameters, BatchNorm statistics)`` of ``MobileNetV3Small``, counted from ``BNECK``."""
    params, stats = 0, 0

    def conv_bn(cin, cout, kernel, groups=1):
        nonlocal params, stats
        params += kernel * kernel * cin // groups * cout + 2 * cout  # kernel, BN scale and bias
        stats += 2 * cout  # BN running mean and variance

    conv_bn(in_channels, STEM_WIDTH, 3)
    cin = STEM_WIDTH
    for kernel, expanded, features, use_se, _, _ in BNECK:
        if expanded != cin:
            conv_bn(cin, expanded, 1)
        conv_bn(expanded, expanded, kernel, groups=expanded)
        if use_se:
            squeeze = make_divisible(expanded // 4)
            params += expanded * squeeze + squeeze + squeeze * expanded + expanded
        conv_bn(expanded, features, 1)
        cin = features
    conv_bn(cin, LAST_WIDTH, 1)
    return params + LAST_WIDTH * num_classes + num_classes, stats


__all__ = ["MobileNetV3Small", "BNECK", "make_divisible", "mobilenet_v3_small_param_count"]
