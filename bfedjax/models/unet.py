"""A small 2-D U-Net for (binary) segmentation, after pytorch-3dunet's ``UNet2D``.

Layer order "cr" (3x3 conv, then ReLU; no normalisation), concatenation skips,
max-pool down and nearest-neighbour up (pytorch-3dunet's 2-D default;
its ``conv_upscale`` transposed conv is not offered). Level ``i`` has
``f_i = features * 2**i`` channels::

    encoder level 0:    x [B, H, W, C] -> conv(C -> f_0) -> conv(f_0 -> f_0)
    encoder level i>0:  maxpool 2x2 -> conv(f_{i-1} -> f_i) -> conv(f_i -> f_i)
    decoder level i:    nearest x2 up of level i+1 ([B, H/2**i, W/2**i, f_{i+1}]),
                        concat [skip_i, up] -> conv(f_i + f_{i+1} -> f_i) -> conv(f_i -> f_i)
    head:               1x1 conv(f_0 -> out_channels), no activation (logits)

Every 3x3 conv is padded SAME and followed by ReLU. Unlike pytorch-3dunet's
encoder (whose first conv has ``f_i // 2`` channels, 'in -> f/2 -> f'), both
encoder convs here have ``f_i`` channels (the classic Ronneberger block).
The 3x3 convs keep PyTorch's default initialisation (kernel and bias
U(-1/sqrt(fan_in), +1/sqrt(fan_in)), ``fan_in = 9 cin``); the 1x1 head is
Xavier (Glorot) uniform with a zero bias, the authors' re-initialisation of
the final conv (FedRef spec section 5).

Input ``x [B, H, W, C]`` with ``H`` and ``W`` divisible by ``2**(levels - 1)``;
output logits ``[B, H, W]`` when ``out_channels == 1`` (the channel squeezed:
one foreground logit per pixel), else ``[B, H, W, out_channels]``.

Parameters for ``features=8, levels=3, C=1, out_channels=1`` (a 3x3 conv
``cin -> cout`` has ``9 * cin * cout + cout``): encoder 664 + 3,488 + 13,888,
decoder 9,248 + 2,320, head 9; in all 29,617 (checked in
``tests/test_segmentation_data.py``).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bfedjax.models.conv import conv_general_dilated as zoo_conv
from bfedjax.models.torch_init import TORCH_KERNEL_INIT, torch_uniform_init


def _conv_relu(x: jax.Array, features: int, dtype) -> jax.Array:
    """``[B, H, W, cin] -> [B, H, W, features]``: SAME 3x3 conv (PyTorch's default init), ReLU."""
    conv = nn.Conv(features, (3, 3), padding="SAME", kernel_init=TORCH_KERNEL_INIT,
                   bias_init=torch_uniform_init(9 * x.shape[-1]), dtype=dtype, conv_general_dilated=zoo_conv)
    return nn.relu(conv(x))


def _double_conv(x: jax.Array, features: int, dtype) -> jax.Array:
    """Two 3x3 conv-ReLU layers, both with ``features`` outputs."""
    return _conv_relu(_conv_relu(x, features, dtype), features, dtype)


def _up2(x: jax.Array) -> jax.Array:
    """Nearest-neighbour upsampling ``[B, h, w, c] -> [B, 2h, 2w, c]``."""
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


class UNet(nn.Module):
    """2-D U-Net (see the module docstring): ``[B, H, W, C]`` -> logits ``[B, H, W(, out_channels)]``.

    Attributes:
      features: channels of the first level ``f_0``; level ``i`` has ``features * 2**i``.
      levels: number of resolutions (``levels - 1`` poolings), >= 1.
      out_channels: 1 for binary segmentation (one foreground logit), else one logit per class.
    """

    features: int = 8
    levels: int = 3
    out_channels: int = 1
    dtype: Any = jnp.float32  # compute dtype (e.g. jnp.bfloat16); parameters and logits stay float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, self.dtype)
        factor = 2 ** (self.levels - 1)
        if self.levels < 1 or x.shape[1] % factor or x.shape[2] % factor:
            raise ValueError(f"UNet(levels={self.levels}) needs levels >= 1 and H, W divisible by {factor}; "
                             f"got input {x.shape}; fix: resize or crop the images")
        widths = [self.features * 2 ** i for i in range(self.levels)]
        skips = []
        for i, f in enumerate(widths):
            if i:
                x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
            x = _double_conv(x, f, self.dtype)
            skips.append(x)
        for f, skip in zip(widths[-2::-1], skips[-2::-1]):
            x = _double_conv(jnp.concatenate([skip, _up2(x)], axis=-1), f, self.dtype)
        head = nn.Conv(self.out_channels, (1, 1), kernel_init=nn.initializers.xavier_uniform(),
                       bias_init=nn.initializers.zeros, dtype=self.dtype, conv_general_dilated=zoo_conv)
        logits = head(x).astype(jnp.float32)
        return logits[..., 0] if self.out_channels == 1 else logits
