"""pytorch-3dunet's ``UNet3D``, FedRef's FeTS model (spec fedref.md section 5), in Flax.

The FedRef authors build ``UNet3D(in 1, out 4, f_maps 4, layer_order "gcr", num_groups 4,
num_levels 4)`` from a vendored pytorch-3dunet. Its layout, for level widths
``f_i = features * 2**i``::

    single conv "gcr":  GroupNorm(cin) -> 3x3x3 conv (padding 1, no bias) -> ReLU
    encoder level 0:    double conv  cin -> max(f_0 // 2, cin) -> f_0
    encoder level i>0:  2x2x2 max-pool (floor), double conv  f_{i-1} -> max(f_i // 2, f_{i-1}) -> f_i
    decoder level i:    nearest-neighbour resize of level i+1 to the skip's size,
                        concat [skip_i, up] -> double conv  f_i + f_{i+1} -> f_i -> f_i
    head:               1x1x1 conv f_0 -> out_channels (with bias), logits

GroupNorm has ``num_groups`` groups, or one group where a layer has fewer channels than
that (pytorch-3dunet's rule); epsilon 1e-5, scale 1, offset 0. Convolutions take
PyTorch's default initialisation; the head is Xavier-uniform with a zero bias (the
authors re-initialise only it). ``gcr`` has no dropout layer, so the authors'
``dropout_prob=0.1`` has no effect and none is applied. Odd sizes are allowed, as in
pytorch-3dunet: pooling floors them and the decoder resizes back to each skip's size
with PyTorch's ``nearest`` rule (source index ``floor(i * in / out)``), so FeTS's
155 x 240 x 240 volumes need no cropping.

Input ``x [B, D, H, W, C]``; output logits ``[B, D, H, W]`` when ``out_channels == 1``,
else ``[B, D, H, W, out_channels]``.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.models.torch_init import TORCH_KERNEL_INIT


def level_widths(features: int, levels: int) -> list[int]:
    """pytorch-3dunet's ``number_of_features_per_level``: ``[features * 2**i for i < levels]``."""
    return [features * 2 ** i for i in range(levels)]


def _single_conv(x: jax.Array, features: int, num_groups: int, dtype) -> jax.Array:
    """``[..., cin] -> [..., features]``: GroupNorm, 3x3x3 conv without bias, ReLU."""
    channels = x.shape[-1]
    groups = num_groups if channels >= num_groups else 1
    if channels % groups:
        raise ValueError(f"GroupNorm needs channels ({channels}) divisible by num_groups ({groups}); "
                         "fix: choose features and num_groups so that every level's width is a multiple")
    x = nn.GroupNorm(num_groups=groups, epsilon=1e-5, dtype=dtype)(x)
    x = nn.Conv(features, (3, 3, 3), padding=1, use_bias=False, kernel_init=TORCH_KERNEL_INIT, dtype=dtype)(x)
    return nn.relu(x)


def _double_conv(x: jax.Array, features: int, num_groups: int, encoder: bool, dtype) -> jax.Array:
    """pytorch-3dunet's ``DoubleConv`` (``conv_upscale=2``): an encoder's first conv has ``max(f // 2, cin)`` outputs."""
    middle = max(features // 2, x.shape[-1]) if encoder else features
    return _single_conv(_single_conv(x, middle, num_groups, dtype), features, num_groups, dtype)


def nearest_resize(x: jax.Array, size: tuple[int, ...]) -> jax.Array:
    """PyTorch's ``F.interpolate(mode="nearest")`` of ``x [B, *spatial, C]`` to ``size``: index ``floor(i * in / out)``."""
    for axis, out in enumerate(size, start=1):
        n = x.shape[axis]
        if n != out:
            scale = np.float32(n) / np.float32(out)  # float32 throughout, as PyTorch's nearest_idx
            source = np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64), n - 1)
            x = jnp.take(x, jnp.asarray(source), axis=axis)
    return x


class UNet3D(nn.Module):
    """pytorch-3dunet's ``UNet3D`` (see the module docstring): ``[B, D, H, W, C]`` -> logits.

    Attributes:
      features: ``f_maps``, the first level's width (FedRef's FeTS model: 4).
      levels: ``num_levels`` (resolutions; ``levels - 1`` poolings), >= 2.
      num_groups: GroupNorm groups (FedRef: 4).
      out_channels: 1 for one foreground logit per voxel, else one logit per class (FedRef: 4).
    """

    features: int = 4
    levels: int = 4
    num_groups: int = 4
    out_channels: int = 1
    dtype: Any = jnp.float32  # compute dtype; parameters and logits stay float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim != 5:
            raise ValueError(f"UNet3D needs volumes [B, D, H, W, C], got shape {x.shape}; fix: give each "
                             "sample a channel axis, e.g. x[..., None]")
        if self.levels < 2:
            raise ValueError(f"UNet3D(levels={self.levels}) needs levels >= 2, as pytorch-3dunet does")
        x = jnp.asarray(x, self.dtype)
        widths = level_widths(self.features, self.levels)
        skips = []
        for i, width in enumerate(widths):
            if i:
                x = nn.max_pool(x, (2, 2, 2), strides=(2, 2, 2), padding="VALID")
            x = _double_conv(x, width, self.num_groups, True, self.dtype)
            skips.append(x)
        for width, skip in zip(widths[-2::-1], skips[-2::-1]):
            joined = jnp.concatenate([skip, nearest_resize(x, skip.shape[1:4])], axis=-1)
            x = _double_conv(joined, width, self.num_groups, False, self.dtype)
        head = nn.Conv(self.out_channels, (1, 1, 1), kernel_init=nn.initializers.xavier_uniform(),
                       bias_init=nn.initializers.zeros, dtype=self.dtype)
        logits = head(x).astype(jnp.float32)
        return logits[..., 0] if self.out_channels == 1 else logits
