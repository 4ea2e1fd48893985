"""Model zoo for bfedjax: small Flax ``linen`` classifiers.

All models map inputs ``x`` of shape ``[B, H, W, C]`` (float32) -- or, for the
fully-connected models, an already-flat ``[B, D]`` -- to logits of shape
``[B, num_classes]``.  Parameters are plain pytrees (the ``'params'``
collection), so per-client parameters can be stacked along a leading axis and
``jax.vmap``-ed.  ``ResNet20`` (``models.resnet``) adds BatchNorm, and the
MLPs and ResNet-20 take an optional MC-dropout rate; ``models.apply`` applies
every model the same way.

Initialisation follows the FOLA authors: Glorot (Xavier) uniform kernels and
zero biases.

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
CNN1            28x28x1      51,902
CNN2            28x28x1      93,322
CNN2            32x32x3      122,570
FedRegCNN       28x28x1      228,010
ResNet20        32x32x3      272,474 trainable (+ BatchNorm statistics)
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
from bfedjax.models.resnet import ResNet20
from bfedjax.models.unet import UNet

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


def _max_pool_2x2(x: jax.Array) -> jax.Array:
    """``[B, H, W, C] -> [B, H//2, W//2, C]`` (floor, VALID), as a max over a reshape."""
    b, h, w, c = x.shape
    x = x[:, :h // 2 * 2, :w // 2 * 2, :].reshape(b, h // 2, 2, w // 2, 2, c)
    return jnp.max(x, axis=(2, 4))


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
        x = _max_pool_2x2(nn.relu(_conv(32, (5, 5), "VALID", self.dtype)(x)))
        x = _max_pool_2x2(nn.relu(_conv(64, (5, 5), "VALID", self.dtype)(x)))
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
    x = _max_pool_2x2(nn.relu(_conv(6, (5, 5), _first_padding(x, first_padding), dtype)(x)))
    return _flatten(_max_pool_2x2(nn.relu(_conv(16, (5, 5), "VALID", dtype)(x))))


def _cnn2_features(x: jax.Array, dtype: Dtype) -> jax.Array:
    """CNN2's convolutions inside a compact module: 3x3 convs 32 (+pool), 64 (+pool), 64, ReLU, flattened."""
    x = jnp.asarray(x, dtype)
    x = _max_pool_2x2(nn.relu(_conv(32, (3, 3), "VALID", dtype)(x)))
    x = _max_pool_2x2(nn.relu(_conv(64, (3, 3), "VALID", dtype)(x)))
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


def _torch_uniform_init(fan_in: int):
    """PyTorch's default for conv/linear biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


# PyTorch's default kernel init (kaiming_uniform with a = sqrt(5)) is the same bound on the kernel.
TORCH_KERNEL_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


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
                           bias_init=_torch_uniform_init(fan_in), dtype=self.dtype, conv_general_dilated=zoo_conv)(x)

        def dense(x, features):
            return nn.Dense(features, kernel_init=TORCH_KERNEL_INIT, bias_init=_torch_uniform_init(x.shape[-1]),
                            dtype=self.dtype)(x)

        x = nn.relu(conv(x, 32))
        x = nn.relu(_max_pool_2x2(conv(x, 32)))
        x = nn.relu(_max_pool_2x2(conv(x, 64)))
        x = nn.relu(dense(_flatten(x), 256))
        return _logits(dense(x, self.num_classes))


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
    "cnn1": lambda num_classes, hidden=None: CNN1(num_classes=num_classes),
    "cnn2": lambda num_classes, hidden=None: CNN2(num_classes=num_classes),
    "fedreg_cnn": lambda num_classes, hidden=None: FedRegCNN(num_classes=num_classes),
    "resnet20": lambda num_classes, hidden=None, dropout_rate=0.0: ResNet20(num_classes=num_classes,
                                                                             dropout_rate=dropout_rate),
    # Segmentation: num_classes == 2 is binary, one foreground logit per pixel ([B, H, W]).
    "unet": lambda num_classes, hidden=None: UNet(out_channels=1 if num_classes == 2 else num_classes),
}
"""name -> factory ``(num_classes, hidden=None[, dropout_rate]) -> nn.Module``.

``hidden`` is only used by ``"mlp"`` (default ``(200, 200)``); the other
entries ignore it. Only the MLPs and ``"resnet20"`` take a ``dropout_rate``.
``"unet"`` is a segmentation net (``models.unet``): logits ``[B, H, W]`` for
``num_classes == 2`` (one foreground logit), else ``[B, H, W, num_classes]``.
"""


def get_model(name: str, num_classes: int, hidden: Sequence[int] | None = None, dropout_rate: float = 0.0,
              compute_dtype: Dtype = "float32") -> nn.Module:
    """Build a model by registry name.

    Args:
      name: one of ``MODELS`` (case-insensitive).
      num_classes: number of output logits ``K``.
      hidden: hidden widths for ``"mlp"`` (default ``(200, 200)``); ignored otherwise.
      dropout_rate: MC-dropout rate (MLPs and ResNet-20 only; 0 = no dropout layers).
      compute_dtype: one of ``COMPUTE_DTYPES``: the dtype of activations and matrix products
        (Flax's ``dtype``). Parameters, and so the optimiser's master weights, stay float32
        (``param_dtype``), and the logits are returned as float32: ``"bfloat16"`` is mixed precision.

    Returns:
      An (unbound) ``flax.linen`` module mapping ``[B, ...] -> [B, K]``.

    Raises:
      ValueError: if ``name`` is unknown (the message lists valid names), ``dropout_rate``
        is set for a model without dropout layers, or ``compute_dtype`` is not one of ``COMPUTE_DTYPES``.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ValueError(
            f"Unknown model {name!r}; fix: use one of the available models {sorted(MODELS)}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate} must be in [0, 1); fix: pass e.g. dropout_rate=0.2")
    if dropout_rate and key not in DROPOUT_MODELS:
        raise ValueError(f"model {name!r} has no dropout layers; fix: use one of {DROPOUT_MODELS} for MC dropout")
    model = MODELS[key](num_classes, hidden, **({"dropout_rate": dropout_rate} if dropout_rate else {}))
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
    "Logistic", "MLP", "FolaCNN", "LeNet", "FedRegCNN", "ResNet20",
    "MODELS", "DROPOUT_MODELS", "COMPUTE_DTYPES", "compute_dtype_of", "get_model", "init_params", "num_params",
]
