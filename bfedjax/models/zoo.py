"""Model zoo for bfedjax: small Flax ``linen`` classifiers.

All models map inputs ``x`` of shape ``[B, H, W, C]`` (float32) -- or, for the
fully-connected models, an already-flat ``[B, D]`` -- to logits of shape
``[B, num_classes]``.  Parameters are plain pytrees (the ``'params'``
collection), so per-client parameters can be stacked along a leading axis and
``jax.vmap``-ed.  ``ResNet20`` (``models.resnet``) adds BatchNorm, and the
MLPs and ResNet-20 take an optional MC-dropout rate; ``models.apply`` applies
every model the same way.

Initialisation follows the FOLA authors: Glorot (Xavier) uniform kernels and
zero biases, except where a model follows another paper's PyTorch code
(``models.torch_init``): MobileNetV3-Small, the U-Nets (PyTorch's default
conv init, a Xavier head) and the models built with ``torch_init``.

Every model has Flax's ``dtype`` field, the compute dtype (``get_model(...,
compute_dtype="bfloat16")``): inputs, activations, matrix products and
convolutions run in it, while parameters stay float32 (the master weights the
optimiser updates) and the logits are returned as float32. ``CNN2Trunk``
returns its features in the compute dtype.

Parameter counts (for reference, checked in ``tests/test_models.py``):

==============  ===========  =========
model           input        #params
==============  ===========  =========
Logistic        28x28x1      7,850
MLP(500, 300)   28x28x1      545,810
MLP(200, 200)   28x28x1      199,210
FolaCNN         32x32x3      878,538
LeNet           28x28x1      61,706
LeNet           32x32x3      62,006
LeNet unpadded  28x28x1      44,426
CNN1            28x28x1      51,902
CNN2            28x28x1      93,322
CNN2            32x32x3      122,570
FedRegCNN       28x28x1      228,010
McMahanCNN      24x24x3      1,068,298
McMahanCNN      32x32x3      1,756,426
ResNet20        32x32x3      272,474 trainable (+ BatchNorm statistics)
FixupResNet9    32x32x3      6,568,673 (K = 10), 6,614,843 (K = 100)
MobileNetV3Sm.  any, to 64²  932,778 (K = 10; + 12,112 BatchNorm statistics)
==============  ===========  =========
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn

from bfedjax.models.conv import conv_general_dilated as zoo_conv
from bfedjax.models.apply import has_batch_stats
from bfedjax.models.fixup import FixupResNet9
from bfedjax.models.mobilenet import MobileNetV3Small
from bfedjax.models.pooling import max_pool
from bfedjax.models.resnet import ResNet20
from bfedjax.models.torch_init import TORCH_KERNEL_INIT, torch_uniform_init
from bfedjax.models.unet import UNet
from bfedjax.models.unet3d import UNet3D

Params = Any  # a pytree of arrays (the 'params' collection)

KERNEL_INIT = nn.initializers.xavier_uniform()
BIAS_INIT = nn.initializers.zeros


Dtype = Any  # a compute dtype: jnp.float32 (default) or jnp.bfloat16


def _dense(features: int, dtype: Dtype = jnp.float32, name: str | None = None) -> nn.Dense:
    return nn.Dense(features, kernel_init=KERNEL_INIT, bias_init=BIAS_INIT, dtype=dtype, name=name)


def _conv(features: int, kernel: tuple[int, int], padding: str, dtype: Dtype = jnp.float32,
          name: str | None = None) -> nn.Conv:
    return nn.Conv(features, kernel_size=kernel, padding=padding, kernel_init=KERNEL_INIT, bias_init=BIAS_INIT,
                   dtype=dtype, name=name, conv_general_dilated=zoo_conv)


def _logits(x: jax.Array) -> jax.Array:
    """Logits leave every model in float32, whatever the compute dtype (losses and softmax stay exact)."""
    return x.astype(jnp.float32)


def _flatten(x: jax.Array) -> jax.Array:
    """``[B, ...] -> [B, prod(...)]``."""
    return x.reshape((x.shape[0], -1))


class Logistic(nn.Module):
    """Multinomial logistic regression: flatten -> Dense(num_classes).

    Input ``[B, H, W, C]`` or ``[B, D]``; output logits ``[B, num_classes]``.
    Params: ``Dense_0/kernel [D, K]``, ``Dense_0/bias [K]``.
    """

    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _flatten(jnp.asarray(x, self.dtype))
        return _logits(_dense(self.num_classes, self.dtype)(x))


class MLP(nn.Module):
    """Fully-connected net: flatten -> [Dense(h) -> ReLU] * len(hidden) -> Dense(K).

    Input ``[B, H, W, C]`` or ``[B, D]``; output logits ``[B, num_classes]``.
    Params: ``Dense_i/kernel [d_in, d_out]`` and ``Dense_i/bias [d_out]`` for
    ``i = 0..len(hidden)``. ``dropout_rate > 0`` adds dropout after every hidden
    layer (``train=True`` or ``dropout=True`` turns it on; see ``models.apply``).
    """

    hidden: Sequence[int] = (200, 200)
    num_classes: int = 10
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False, dropout: bool = False, mask=None) -> jax.Array:
        del mask  # no batch statistics
        x = _flatten(jnp.asarray(x, self.dtype))
        for h in self.hidden:
            x = nn.relu(_dense(int(h), self.dtype)(x))
            if self.dropout_rate > 0:  # MC-dropout baseline: after every hidden layer, not on the logits
                x = nn.Dropout(self.dropout_rate, deterministic=not (train or dropout))(x)
        return _logits(_dense(self.num_classes, self.dtype)(x))


class FolaCNN(nn.Module):
    """The FOLA authors' CIFAR ``BasicCNN``.

    Conv(32, 5x5, VALID) -> ReLU -> MaxPool 2x2 -> Conv(64, 5x5, VALID) -> ReLU
    -> MaxPool 2x2 -> Flatten -> Dense(512) -> ReLU -> Dense(num_classes).

    Input ``[B, 32, 32, 3]`` (the shapes below); output ``[B, num_classes]``.
    Shapes: 32x32x3 -> 28x28x32 -> 14x14x32 -> 10x10x64 -> 5x5x64 -> 1600 -> 512 -> K.
    """

    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, self.dtype)
        x = max_pool(nn.relu(_conv(32, (5, 5), "VALID", self.dtype)(x)), 2)
        x = max_pool(nn.relu(_conv(64, (5, 5), "VALID", self.dtype)(x)), 2)
        x = _flatten(x)
        x = nn.relu(_dense(512, self.dtype)(x))
        return _logits(_dense(self.num_classes, self.dtype)(x))


def _first_padding(x: jax.Array, first_padding: str) -> str:
    """``"auto"``: SAME (padding 2 for 5x5) on 28x28 inputs, VALID otherwise (HBFL spec Decision 11)."""
    if first_padding == "auto":
        return "SAME" if x.shape[1] == 28 else "VALID"
    return first_padding


def _lenet_features(x: jax.Array, first_padding: str, dtype: Dtype) -> jax.Array:
    """LeNet-5's convolutions inside a compact module: 5x5 convs (6, 16), ReLU and 2x2 max-pool each, flattened."""
    x = jnp.asarray(x, dtype)
    x = max_pool(nn.relu(_conv(6, (5, 5), _first_padding(x, first_padding), dtype)(x)), 2)
    return _flatten(max_pool(nn.relu(_conv(16, (5, 5), "VALID", dtype)(x)), 2))


def _cnn2_features(x: jax.Array, dtype: Dtype) -> jax.Array:
    """CNN2's convolutions inside a compact module: 3x3 convs 32 (+pool), 64 (+pool), 64, ReLU, flattened."""
    x = jnp.asarray(x, dtype)
    x = max_pool(nn.relu(_conv(32, (3, 3), "VALID", dtype)(x)), 2)
    x = max_pool(nn.relu(_conv(64, (3, 3), "VALID", dtype)(x)), 2)
    return _flatten(nn.relu(_conv(64, (3, 3), "VALID", dtype)(x)))


class LeNet(nn.Module):
    """LeNet-5: two 5x5 convs (6, 16) each with ReLU and 2x2 max-pool, then Dense 120 -> 84 -> K.

    ``first_padding="auto"`` pads the first conv on 28x28 inputs (SAME) and not on
    32x32 ones (VALID), so both flatten to 400 as in the HBFL/FML models.
    Input ``[B, 28, 28, C]`` or ``[B, 32, 32, C]``; output ``[B, num_classes]``.
    Shapes: 28x28xC -> 28x28x6 -> 14x14x6 -> 10x10x16 -> 5x5x16 -> 400 -> 120 -> 84 -> K
    (32x32xC -> 28x28x6 -> ... the same from there).
    """

    num_classes: int = 10
    first_padding: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(_dense(120, self.dtype)(_lenet_features(x, self.first_padding, self.dtype)))
        x = nn.relu(_dense(84, self.dtype)(x))
        return _logits(_dense(self.num_classes, self.dtype)(x))


class CNN1(nn.Module):
    """HBFL's CNN1: LeNet-5's two conv layers, then two dense layers (400 -> ``hidden`` -> K).

    Input ``[B, 28, 28, C]`` or ``[B, 32, 32, C]`` (first conv padded on 28x28 as ``LeNet``);
    output ``[B, num_classes]``. ``hidden`` is unstated in the paper (spec default 120).
    """

    num_classes: int = 10
    hidden: int = 120
    first_padding: str = "auto"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(_dense(self.hidden, self.dtype)(_lenet_features(x, self.first_padding, self.dtype)))
        return _logits(_dense(self.num_classes, self.dtype)(x))


class CNN2Trunk(nn.Module):
    """CNN2's convolutional trunk (HBFL's objective heterogeneity, spec Decision 13): the three 3x3 convs,
    flattened; ``[B, 28, 28, C] -> [B, 576]`` (``[B, 1024]`` on 32x32). Clients put their own head on it."""

    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _cnn2_features(x, self.dtype)


class CNN2(nn.Module):
    """HBFL/FML's CNN2: 3x3 convs 32 (+pool) -> 64 (+pool) -> 64, ReLU, no padding; Dense 64 -> K.

    Input ``[B, 28, 28, C]`` (flatten 3x3x64 = 576) or ``[B, 32, 32, C]`` (4x4x64 = 1024);
    output ``[B, num_classes]``.
    """

    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(_dense(64, self.dtype)(_cnn2_features(x, self.dtype)))
        return _logits(_dense(self.num_classes, self.dtype)(x))


class FedRegCNN(nn.Module):
    """FedReg's MNIST/EMNIST CNN ("3 conv + 2 FC", 228,010 parameters), PyTorch initialisation.

    Conv(32, 5x5, VALID) -> ReLU -> Conv(32, 5x5, VALID) -> MaxPool 2 -> ReLU ->
    Conv(64, 5x5, VALID) -> MaxPool 2 -> ReLU -> Flatten -> Dense(256) -> ReLU -> Dense(num_classes).

    Input ``[B, 28, 28, C]``; output ``[B, num_classes]``.
    Shapes: 28x28 -> 24x24x32 -> 20x20x32 -> 10x10x32 -> 6x6x64 -> 3x3x64 = 576 -> 256 -> K.
    """

    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, self.dtype)

        def conv(x, features):
            fan_in = 25 * x.shape[-1]
            return nn.Conv(features, (5, 5), padding="VALID", kernel_init=TORCH_KERNEL_INIT,
                           bias_init=torch_uniform_init(fan_in), dtype=self.dtype, conv_general_dilated=zoo_conv)(x)

        def dense(x, features):
            return nn.Dense(features, kernel_init=TORCH_KERNEL_INIT, bias_init=torch_uniform_init(x.shape[-1]),
                            dtype=self.dtype)(x)

        x = nn.relu(conv(x, 32))
        x = nn.relu(max_pool(conv(x, 32), 2))
        x = nn.relu(max_pool(conv(x, 64), 2))
        x = nn.relu(dense(_flatten(x), 256))
        return _logits(dense(x, self.num_classes))


def local_response_normalization(x: jax.Array, depth_radius: int = 4, bias: float = 1.0, alpha: float = 0.001 / 9.0,
                                 beta: float = 0.75) -> jax.Array:
    """TensorFlow's ``tf.nn.local_response_normalization`` (``tf.nn.lrn``) over the last (channel) axis.

    ``sqr_sum[..., d] = sum(x[..., d - depth_radius : d + depth_radius + 1] ** 2)`` (the window is cut at the
    first and last channel, never wrapped) and ``output = x / (bias + alpha * sqr_sum) ** beta``. TensorFlow's
    ``alpha`` multiplies the window sum itself (PyTorch's ``LocalResponseNorm`` divides its ``alpha`` by the
    window size), hence the CIFAR-10 tutorial's ``alpha = 0.001 / 9.0`` for a 9-channel window; the defaults
    are the tutorial's. Any input shape ``[..., C]``, output of the same shape and dtype.

    The window sums are one matrix product of the squares with a ``[C, C]`` band of ones, in ``x``'s dtype
    (like the zoo's other products; on a CPU, forward and backward, 5x faster than a sum of shifted
    slices); ``bias + alpha * sqr_sum`` and its power are float32.
    """
    channels = jnp.arange(x.shape[-1])
    band = (jnp.abs(channels[:, None] - channels[None, :]) <= depth_radius).astype(x.dtype)
    denominator = bias + alpha * jnp.dot(jnp.square(x), band).astype(jnp.float32)
    if beta == 0.75:  # the tutorial's power without a log and an exp: z^-3/4 = z^-1/2 * (z^-1/2)^1/2
        inverse_sqrt = jax.lax.rsqrt(denominator)
        scale = inverse_sqrt * jnp.sqrt(inverse_sqrt)
    else:
        scale = denominator ** -beta
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


def _max_pool_3x3_stride2_same(x: jax.Array) -> jax.Array:
    """TensorFlow's ``max_pool(ksize=3, strides=2, padding='SAME')``: ``[B, H, W, C] -> [B, ceil(H/2),
    ceil(W/2), C]``, the padding (TF's split: an odd total puts the extra row/column at the end) never
    winning the max (Flax pads a max-pool with -inf)."""
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


# The TensorFlow CIFAR-10 tutorial's initialisers (cifar10.py, ``inference``): truncated normal kernels
# (cut at 2 standard deviations, as TF1's ``truncated_normal_initializer``) and constant biases, per layer.
_TF_TUTORIAL_INIT = {  # layer -> (kernel stddev, bias constant)
    "conv1": (5e-2, 0.0), "conv2": (5e-2, 0.1), "local3": (0.04, 0.1), "local4": (0.04, 0.1),
    "softmax_linear": (1 / 192.0, 0.0),
}
MCMAHAN_CNN_INITS = ("glorot", "tf_tutorial")


class McMahanCNN(nn.Module):
    """McMahan et al.'s CIFAR CNN, the TensorFlow CIFAR-10 tutorial's model (FOLA spec decision D13's option).

    McMahan et al. 2017 ("Communication-Efficient Learning of Deep Networks from Decentralized Data", Sec. 3,
    CIFAR): "the model architecture was taken from the TensorFlow tutorial, which consists of two
    convolutional layers followed by two fully connected layers and then a linear transformation layer to
    produce logits, for a total of about 10^6 parameters". The layers, LRN constants and ``tf_tutorial``
    initialisers below are the tutorial's (``tensorflow/models``, ``tutorials/image/cifar10/cifar10.py``,
    ``inference``)::

        conv1 Conv(64, 5x5, SAME) -> ReLU -> MaxPool 3x3 stride 2 SAME -> LRN
        conv2 Conv(64, 5x5, SAME) -> ReLU -> LRN -> MaxPool 3x3 stride 2 SAME
        Flatten -> local3 Dense(384) -> ReLU -> local4 Dense(192) -> ReLU -> softmax_linear Dense(K)

    LRN is ``local_response_normalization`` with the tutorial's ``depth_radius=4, bias=1.0,
    alpha=0.001/9.0, beta=0.75``; the logits are linear (no softmax).

    Input ``[B, H, W, C]``; output ``[B, num_classes]``. The tutorial feeds 24x24 crops of the 32x32
    images; the model takes either:

    * 24x24x3 -> 24x24x64 -> 12x12x64 -> 12x12x64 -> 6x6x64 = 2,304 -> 384 -> 192 -> K:
      4,864 + 102,464 + 885,120 + 73,920 + 1,930 = 1,068,298 parameters for K = 10 ("about 10^6");
    * 32x32x3 -> 32x32x64 -> 16x16x64 -> 16x16x64 -> 8x8x64 = 4,096 -> 384 -> 192 -> K:
      4,864 + 102,464 + 1,573,248 + 73,920 + 1,930 = 1,756,426 parameters for K = 10.

    ``weight_init="glorot"`` (default) is the zoo's Glorot-uniform kernels and zero biases, as every other zoo
    model (McMahan et al.'s Sec. 3 names only the architecture); ``weight_init="tf_tutorial"`` is the tutorial's:
    truncated-normal kernels with standard deviations 5e-2, 5e-2, 0.04, 0.04 and 1/192, biases 0, 0.1, 0.1,
    0.1 and 0. The tutorial's weight decay (0.004 on local3 and local4), its input distortions and its
    optimiser are training choices, not part of this module.
    """

    num_classes: int = 10
    weight_init: str = "glorot"
    dtype: Dtype = jnp.float32

    def _inits(self, name: str):
        if self.weight_init == "glorot":
            return KERNEL_INIT, BIAS_INIT
        if self.weight_init == "tf_tutorial":
            stddev, bias = _TF_TUTORIAL_INIT[name]
            return nn.initializers.truncated_normal(stddev), nn.initializers.constant(bias)
        raise ValueError(f"McMahanCNN weight_init={self.weight_init!r}; fix: use one of {MCMAHAN_CNN_INITS}")

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def conv(x, name):
            kernel_init, bias_init = self._inits(name)
            return nn.Conv(64, (5, 5), padding="SAME", kernel_init=kernel_init, bias_init=bias_init,
                           dtype=self.dtype, name=name, conv_general_dilated=zoo_conv)(x)

        def dense(x, features, name):
            kernel_init, bias_init = self._inits(name)
            return nn.Dense(features, kernel_init=kernel_init, bias_init=bias_init, dtype=self.dtype, name=name)(x)

        x = jnp.asarray(x, self.dtype)
        x = local_response_normalization(_max_pool_3x3_stride2_same(nn.relu(conv(x, "conv1"))))
        x = _max_pool_3x3_stride2_same(local_response_normalization(nn.relu(conv(x, "conv2"))))
        x = nn.relu(dense(_flatten(x), 384, "local3"))
        x = nn.relu(dense(x, 192, "local4"))
        return _logits(dense(x, self.num_classes, "softmax_linear"))


# --------------------------------------------------------------------------- #
# Registry / factory
# --------------------------------------------------------------------------- #

def _make_mlp(num_classes: int, hidden: Sequence[int] | None = None, dropout_rate: float = 0.0) -> nn.Module:
    return MLP(hidden=tuple(hidden) if hidden is not None else (200, 200),
               num_classes=num_classes, dropout_rate=dropout_rate)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "logistic": lambda num_classes, hidden=None: Logistic(num_classes=num_classes),
    "mlp": _make_mlp,
    "mlp_500_300": lambda num_classes, hidden=None, dropout_rate=0.0: _make_mlp(num_classes, (500, 300), dropout_rate),
    "mlp_200_200": lambda num_classes, hidden=None, dropout_rate=0.0: _make_mlp(num_classes, (200, 200), dropout_rate),
    "fola_cnn": lambda num_classes, hidden=None: FolaCNN(num_classes=num_classes),
    "lenet": lambda num_classes, hidden=None: LeNet(num_classes=num_classes),
    # HBFL spec Decision 11's option: LeNet-5 without the first conv's padding on 28x28 too (flatten 256).
    "lenet_unpadded": lambda num_classes, hidden=None: LeNet(num_classes=num_classes, first_padding="VALID"),
    "cnn1": lambda num_classes, hidden=None: CNN1(num_classes=num_classes),
    "cnn2": lambda num_classes, hidden=None: CNN2(num_classes=num_classes),
    "fedreg_cnn": lambda num_classes, hidden=None: FedRegCNN(num_classes=num_classes),
    "mcmahan_cnn": lambda num_classes, hidden=None: McMahanCNN(num_classes=num_classes),
    "resnet20": lambda num_classes, hidden=None, dropout_rate=0.0: ResNet20(num_classes=num_classes,
                                                                             dropout_rate=dropout_rate),
    # FedReg's CIFAR model (models.fixup): no normalisation layers, Fixup's scalar biases and multipliers.
    "resnet9_fixup": lambda num_classes, hidden=None: FixupResNet9(num_classes=num_classes),
    # FedRef's MNIST model (models.mobilenet): torchvision's MobileNetV3-Small, inputs resized to 64x64 RGB.
    "mobilenet_v3_small": lambda num_classes, hidden=None: MobileNetV3Small(num_classes=num_classes),
    # Segmentation: num_classes == 2 is binary, one foreground logit per pixel ([B, H, W]), unless
    # segmentation_head="softmax" (one logit per class, the FedRef authors' two-channel DRIVE head).
    "unet": lambda num_classes, hidden=None, softmax_head=False: UNet(
        out_channels=_segmentation_channels(num_classes, softmax_head)),
    # FedRef's FeTS model (models.unet3d): pytorch-3dunet's UNet3D, f_maps 4, 4 levels, GroupNorm 4; volumes.
    "unet3d": lambda num_classes, hidden=None, softmax_head=False: UNet3D(
        out_channels=_segmentation_channels(num_classes, softmax_head)),
}
"""name -> factory ``(num_classes, hidden=None[, dropout_rate][, softmax_head]) -> nn.Module``.

``hidden`` is only used by ``"mlp"`` (default ``(200, 200)``); the other
entries ignore it. Only the MLPs and ``"resnet20"`` take a ``dropout_rate``, only the U-Nets a ``softmax_head``.
``"unet"`` is a segmentation net (``models.unet``): logits ``[B, H, W]`` for
``num_classes == 2`` (one foreground logit; with ``softmax_head=True``, get_model's
``segmentation_head="softmax"``, two), else ``[B, H, W, num_classes]``;
``"unet3d"`` (``models.unet3d``) the same for volumes, ``[B, D, H, W(, num_classes)]``.
"""


def _segmentation_channels(num_classes: int, softmax_head: bool) -> int:
    """A segmentation net's logits per pixel: one for two classes (a sigmoid head) unless ``softmax_head``, else one
    per class."""
    return num_classes if softmax_head or num_classes != 2 else 1


def get_model(name: str, num_classes: int, hidden: Sequence[int] | None = None, dropout_rate: float = 0.0,
              compute_dtype: Dtype = "float32", segmentation_head: str = "sigmoid") -> nn.Module:
    """Build a model by registry name.

    Args:
      name: one of ``MODELS`` (case-insensitive).
      num_classes: number of output logits ``K``.
      hidden: hidden widths for ``"mlp"`` (default ``(200, 200)``); ignored otherwise.
      dropout_rate: MC-dropout rate (MLPs and ResNet-20 only; 0 = no dropout layers).
      compute_dtype: one of ``COMPUTE_DTYPES``: the dtype of activations and matrix products
        (Flax's ``dtype``). Parameters, and so the optimiser's master weights, stay float32
        (``param_dtype``), and the logits are returned as float32: ``"bfloat16"`` is mixed precision.
      segmentation_head: one of ``SEGMENTATION_HEADS``, for ``SEGMENTATION_MODELS`` with binary masks
        (``num_classes == 2``): ``"sigmoid"``, one foreground logit per pixel (``[B, H, W]``), or
        ``"softmax"``, one trainable logit per class (``[B, H, W, 2]``, volumes ``[B, D, H, W, 2]``; the
        FedRef authors' DRIVE head; with one logit, the losses and metrics read class 0's logit as the
        constant 0). With more classes both are one logit per class.

    Returns:
      An (unbound) ``flax.linen`` module mapping ``[B, ...] -> [B, K]`` (the U-Nets: per-pixel logits, above).

    Raises:
      ValueError: if ``name`` is unknown (the message lists valid names), ``dropout_rate``
        is set for a model without dropout layers, ``compute_dtype`` is not one of ``COMPUTE_DTYPES``, or
        ``segmentation_head`` is unknown or ``"softmax"`` for a model outside ``SEGMENTATION_MODELS``.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ValueError(
            f"Unknown model {name!r}; fix: use one of the available models {sorted(MODELS)}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate} must be in [0, 1); fix: pass e.g. dropout_rate=0.2")
    if dropout_rate and key not in DROPOUT_MODELS:
        raise ValueError(f"model {name!r} has no dropout layers; fix: use one of {DROPOUT_MODELS} for MC dropout")
    if segmentation_head not in SEGMENTATION_HEADS:
        raise ValueError(f"unknown segmentation_head={segmentation_head!r}; fix: use one of {SEGMENTATION_HEADS}")
    if segmentation_head == "softmax" and key not in SEGMENTATION_MODELS:
        raise ValueError(f"model {name!r} is a classifier; segmentation_head='softmax' is for "
                         f"{SEGMENTATION_MODELS}; fix: drop segmentation_head or use one of those models")
    options = {"dropout_rate": dropout_rate} if dropout_rate else {}
    if segmentation_head == "softmax":
        options["softmax_head"] = True
    model = MODELS[key](num_classes, hidden, **options)
    dtype = compute_dtype_of(compute_dtype)
    return model if dtype == jnp.float32 else model.clone(dtype=dtype)


COMPUTE_DTYPES = ("float32", "bfloat16")  # no float16: it would need loss scaling


def compute_dtype_of(name: Dtype) -> jnp.dtype:
    """``"bfloat16"`` or ``jnp.bfloat16`` -> ``dtype('bfloat16')``; a one-line error outside ``COMPUTE_DTYPES``."""
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype {name!r} is not supported; fix: use one of {COMPUTE_DTYPES}")
    return dtype


DROPOUT_MODELS = ("mlp", "mlp_500_300", "mlp_200_200", "resnet20")
SEGMENTATION_MODELS = ("unet", "unet3d")
SEGMENTATION_HEADS = ("sigmoid", "softmax")  # binary masks: one foreground logit, or one logit per class


def init_params(model: nn.Module, input_shape: tuple[int, ...],
                key: jax.Array) -> Params:
    """Initialise a model's parameters.

    Args:
      model: a ``flax.linen`` module from this zoo.
      input_shape: per-example input shape WITHOUT the batch axis, e.g.
        ``(28, 28, 1)``, ``(32, 32, 3)`` or ``(784,)``.
      key: a PRNG key.

    Returns:
      The pytree the engine trains: the ``'params'`` collection (a plain nested
      dict of float32 arrays, usable as ``model.apply({'params': params}, x)``),
      or for a model with BatchNorm the variables ``{'params', 'batch_stats'}``
      (see ``bfedjax.models.apply``).
    """
    input_shape = tuple(int(d) for d in input_shape)
    try:
        hash(model)
    except TypeError:  # e.g. MLP(hidden=[...]) with a list attribute: no jit cache
        return _init(model, input_shape, key)
    return _jit_init(model, input_shape, key)


def _init(model: nn.Module, input_shape: tuple[int, ...], key: jax.Array) -> Params:
    dummy = jnp.zeros((1, *input_shape), jnp.float32)
    variables = model.init(key, dummy)
    return dict(variables) if has_batch_stats(model) else variables["params"]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_init(model: nn.Module, input_shape: tuple[int, ...],
              key: jax.Array) -> Params:
    # Jitted (one XLA program instead of many eager ops); cached per
    # (model, input_shape) -- linen modules are frozen, hashable dataclasses.
    return _init(model, input_shape, key)


def num_params(params: Params) -> int:
    """Total number of scalar parameters in a pytree.

    Works on concrete arrays and on ``jax.ShapeDtypeStruct`` leaves (e.g. the
    output of ``jax.eval_shape(init_params, ...)``).
    """
    return int(sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params)))


__all__ = [
    "Logistic", "MLP", "FolaCNN", "LeNet", "FedRegCNN", "McMahanCNN", "ResNet20", "FixupResNet9",
    "MobileNetV3Small", "local_response_normalization",
    "MODELS", "DROPOUT_MODELS", "SEGMENTATION_MODELS", "SEGMENTATION_HEADS", "COMPUTE_DTYPES", "compute_dtype_of",
    "get_model", "init_params", "num_params",
]
