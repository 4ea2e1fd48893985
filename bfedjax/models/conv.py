"""2-D convolutions whose gradients stay fast inside jitted training loops and under a client vmap.

Local training runs its steps inside ``lax.while_loop``/``lax.scan``. There,
XLA:CPU lowers the two backward convolutions that autodiff derives for
``lax.conv_general_dilated`` (input gradient: a transposed convolution;
kernel gradient: batch and feature axes swapped) to a slow generic loop
instead of its optimised NHWC kernel: on a 2-core machine a FedReg-CNN step
of 20 images takes 0.46 s in a loop against 0.03 s outside one. (Forward
convolutions are unaffected; unrolling the loop also avoids it.)

``conv_general_dilated`` below is a drop-in for ``lax.conv_general_dilated``
(Flax: ``nn.Conv(..., conv_general_dilated=conv_general_dilated)``) for the
convolutions the zoo uses (2-D, NHWC/HWIO, any strides and padding, no
dilation, one group or depthwise; anything else goes to ``lax``). It picks by platform:

* CPU and GPU, when the patch matrix fits in the platform's ``MATMUL_CONV_MAX_BYTES`` (a client's
  training batch; per client under a vmap): ``matmul_trained_conv``, which is
  ``matmul_conv``, the convolution as one matrix product over im2col patches,
  where it is differentiated, and ``lax``'s forward convolution where it is
  not (evaluation, a teacher's predictions). XLA:CPU's convolutions inside
  these loops hardly use a second core, and under a client vmap they become
  grouped convolutions; its matrix products use every core, and a vmap turns
  them into batched products (``python -m experiments.bench_conv``, 2 cores:
  a FedReg-CNN step of 20 images in a scan 0.027 s against 0.037 s with the
  custom VJP below; a vmapped FedAvg round of its one-class protocol 1.62 s,
  where the same command measured 6.20 s with the custom VJP before).
  On a GPU, a vmap turns XLA's convolutions into grouped cuDNN convolutions, slow for
  small per-client patches; large ones (FedReg's 20x20x800 conv2 patches) stay faster in cuDNN.
  A FedAvg round of 100 clients (B = 10) on an H100, median of 20 (``python -m experiments.bench_round``
  with 0, 0.75, 2 and 16 MiB for FedReg's CNN, 0, 2.5 and 4 MiB for FOLA's): FedReg's CNN 74.8 ms with every convolution in cuDNN, 58.7 ms with the
  patches up to 2 MiB as matrix products, 79.7 ms with all of them; FOLA's CIFAR CNN 72.1 ms
  against 38.6 ms with both its convolutions (2.2 and 3.1 MiB patches) as matrix products.
  A CPU keeps the product for a client trained alone (no vmap) only up to ``ALONE_MATMUL_CONV_MAX_BYTES``
  (1 MiB); above it ``per_client_conv`` takes XLA's convolutions there and the product under a vmap
  (FedReg's CNN, clients in turn: 0.118 against 0.097 s a round; ``python -m experiments.bench_conv_alone``),
  or, for the stride-1 kernels ``WINOGRAD_TILES`` lists (CPU: 5x5), the Winograd convolution
  F(4x4, 5x5) (``models.winograd``, a sixth of the multiplications, as ``n * n`` matrix products).
* elsewhere, and for larger patches: ``loop_friendly_conv``, ``lax``'s forward convolution with a
  custom VJP that writes both backward passes as ordinary NHWC/HWIO forward
  convolutions after explicit transposes, zero-dilation and padding. Within the platform's
  ``MATMUL_KERNEL_GRAD_MAX_BYTES`` (a GPU: 16 MiB) its kernel gradient is instead ``patches^T dy``,
  one matrix product: under a client vmap the convolution form is a grouped cuDNN convolution that
  cuDNN ran client by client through FFTs (an H100, FedReg's CNN, 100 clients: 44.5 against 39.6 ms
  a round; a variational ResNet-20 87.6 against 65.6 ms; ``results/bench/gpu_h100_targets/``).

Depthwise convolutions (one group per channel, MobileNet's) take ``shifted_depthwise_conv`` on a CPU:
a sum of shifted slices times per-channel weights, whose gradients are slices and products (XLA:CPU runs
the grouped convolution's gradients as a generic loop). Other grouped convolutions go to ``lax``.

Values and gradients equal ``lax``'s to float rounding (tested, both).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from bfedjax.models.winograd import winograd_conv_grads, winograd_forward

_NHWC = ("NHWC", "HWIO", "NHWC")
# Per platform, the largest patch matrix (bytes; per client under a vmap) whose differentiated
# convolution takes matmul_trained_conv; larger ones, and platforms not listed, take
# loop_friendly_conv. Read when a model is traced. CPU: larger patch matrices (big evaluation or
# centralised batches) leave the caches and the im2col copy costs more than it saves.
MATMUL_CONV_MAX_BYTES = {"cpu": 32 * 2**20, "gpu": 4 * 2**20}
# Per platform, the largest patch matrix (bytes; per client under a vmap) for which
# loop_friendly_conv's kernel gradient is a matrix product over im2col patches
# (``patches^T dy``) rather than a convolution over the batch axis; platforms not listed keep
# the convolution. Under a client vmap on a GPU that convolution is a grouped cuDNN
# convolution run one client at a time (FFT kernels per group). The patches exist only in the
# backward pass, but once per client of a vmapped chunk (FedReg's CNN, 100 clients: 1.6 GB compiled
# against 0.7 GB); the automatic chunks (core.layout) do not count them.
MATMUL_KERNEL_GRAD_MAX_BYTES = {"gpu": 16 * 2**20}
# Per platform, the largest patch matrix (bytes) whose differentiated convolution takes the matrix product
# when no vmap batches it (a client trained alone, clients_per_chunk=1); larger ones within
# MATMUL_CONV_MAX_BYTES take per_client_conv, the product only under a vmap. Platforms not listed use
# MATMUL_CONV_MAX_BYTES alone. CPU 1 MiB: a client trained alone keeps the product for small patch matrices
# (few channels) and takes XLA's convolutions with loop_friendly_conv's backward for the rest. FedAvg rounds
# of 10 clients x 20 images, B = 10, in turn on 2 CPU devices (``python -m experiments.bench_conv_alone``,
# results/bench/conv_alone), 32 MiB (the product for every patch matrix) -> 1 MiB: FedReg's CNN 0.118 -> 0.097 s,
# ResNet-20 0.76 -> 0.48 s, McMahan's CNN 0.54 -> 0.40 s, CNN2 0.030 -> 0.029 s, LeNet-5 0.017 s and CNN1
# 0.017 -> 0.016 s, FOLA's CNN 0.082 -> 0.083 s; 0 MiB (XLA's convolutions for every size) gave LeNet-5 0.019 s,
# CNN1 0.018 s and ResNet-20 0.54 s.
ALONE_MATMUL_CONV_MAX_BYTES = {"cpu": 2**20}
# Per platform, {kernel size r: Winograd output tile m} for the stride-1 r x r float32 convolutions that a client
# trained alone (no vmap) takes as Winograd F(m x m, r x r) (``models.winograd``) where it would otherwise take
# XLA's convolution (per_client_conv: patch matrices over ALONE_MATMUL_CONV_MAX_BYTES) and has at least
# WINOGRAD_MIN_CHANNELS input channels (fewer make degenerate products). Platforms and sizes not listed keep
# XLA's convolutions. CPU, 5x5: F(4x4, 5x5) takes 64 products per 16 outputs where the convolution takes 400.
# A FedReg-CNN conv2 step (10 images of 24x24x32 to 20x20x32, forward and both gradients, 20 steps in a scan,
# one core; scratch measurements, two runs): XLA's convolution with loop_friendly_conv's backward 8.8 / 11.4 ms,
# im2col 14.6 ms, F(3x3, 5x5) 4.1 / 3.3 ms, F(4x4, 5x5) 3.0 / 2.7 ms; rounds: results/bench/conv_alone/winograd.md.
# 3x3 (F(4x4, 3x3)) is left out: ResNet-20's round 0.523 -> 0.452 s for a first round of 14.2 s against 7.0 s.
WINOGRAD_TILES = {"cpu": {5: 4}}
WINOGRAD_MIN_CHANNELS = 8
# Platforms whose depthwise convolutions (one group per input channel, depth multiplier 1: MobileNet's)
# take ``shifted_depthwise_conv``, a sum of kh * kw shifted slices times per-channel weights. XLA:CPU runs the
# gradients of its grouped convolution as a generic loop: a MobileNetV3-Small step of 64 images at 64x64
# in a scan, 4.27 s against 0.098 s; two vmapped clients 24.7 s against 0.237 s
# (results/fedref_mobilenet_check/depthwise_step.py, 2 cores). Elsewhere ``lax``'s.
SHIFTED_DEPTHWISE_PLATFORMS = ("cpu",)


def _is_nhwc(dimension_numbers) -> bool:
    if dimension_numbers is None:
        return False
    if isinstance(dimension_numbers, lax.ConvDimensionNumbers):
        return tuple(dimension_numbers) == ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
    return tuple(dimension_numbers) == _NHWC


def _plain(conv_args) -> bool:
    dilation_free = all(d is None or all(v == 1 for v in d) for d in conv_args)
    return dilation_free


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """``lax.conv_general_dilated`` with loop-friendly gradients for plain 2-D NHWC convolutions."""
    plain_2d = (lhs.ndim == 4 and _is_nhwc(dimension_numbers) and _plain((lhs_dilation, rhs_dilation))
                and batch_group_count == 1 and preferred_element_type is None)
    depthwise = (plain_2d and feature_group_count > 1 and feature_group_count == lhs.shape[-1] == rhs.shape[-1]
                 and rhs.shape[2] == 1 and lhs.dtype == rhs.dtype)
    if depthwise and jax.default_backend() in SHIFTED_DEPTHWISE_PLATFORMS:
        if isinstance(padding, str):
            padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
        fits = all(lo >= 0 and hi >= 0 and size + lo + hi >= k
                   for (lo, hi), size, k in zip(pads, lhs.shape[1:3], rhs.shape[:2]))
        if fits:  # else (cropping pads, a kernel larger than the padded input) lax's
            return shifted_depthwise_conv(lhs, rhs, tuple(int(v) for v in window_strides), pads)
    if not (plain_2d and feature_group_count == 1):
        return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                        dimension_numbers, feature_group_count, batch_group_count, precision,
                                        preferred_element_type)
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    strides = tuple(int(s) for s in window_strides)
    backend, size = jax.default_backend(), patch_bytes(lhs, rhs, strides, pads)
    if size > MATMUL_CONV_MAX_BYTES.get(backend, -1):
        return loop_friendly_conv(lhs, rhs, strides, pads, precision)
    if size > ALONE_MATMUL_CONV_MAX_BYTES.get(backend, size):
        return per_client_conv(lhs, rhs, strides, pads, precision, winograd_tile(rhs, strides, backend))
    return matmul_trained_conv(lhs, rhs, strides, pads, precision)


def shifted_depthwise_conv(x, w, strides: tuple[int, int], pads):
    """Depthwise convolution as ``sum_ij slice_ij(pad(x)) * w[i, j, 0]``: elementwise products only.

    Args:
      x: ``[B, H, W, C]``.
      w: ``[kh, kw, 1, C]`` (HWIO with one input channel per group; depth multiplier 1).
      strides: ``(sh, sw)``.
      pads: ``((top, bottom), (left, right))``.
    Returns:
      ``[B, Ho, Wo, C]``, ``Ho = (H + top + bottom - kh) // sh + 1`` (likewise ``Wo``): ``lax``'s
      ``conv_general_dilated(..., feature_group_count=C)``, summed in float32 (a bfloat16 input too) and
      returned in ``x``'s dtype. Its gradients are slices, pads and products, which a client vmap batches
      without grouped convolutions. ``precision`` does not apply (no matrix products).
    """
    kh, kw = w.shape[:2]
    xp = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    ho = (xp.shape[1] - kh) // strides[0] + 1
    wo = (xp.shape[2] - kw) // strides[1] + 1
    out = None
    for i in range(kh):
        for j in range(kw):
            window = lax.slice(xp, (0, i, j, 0), (xp.shape[0], i + (ho - 1) * strides[0] + 1,
                                                 j + (wo - 1) * strides[1] + 1, xp.shape[3]),
                               (1, strides[0], strides[1], 1))
            term = window.astype(jnp.float32) * w[i, j, 0].astype(jnp.float32)
            out = term if out is None else out + term
    return out.astype(x.dtype)


def winograd_tile(w, strides: tuple[int, int], backend: str) -> int | None:
    """The Winograd output tile ``m`` for ``w [r, r, I, O]`` at ``strides`` on ``backend`` (``WINOGRAD_TILES``), or
    ``None`` (XLA's convolution). float32 only: the transforms' entries (up to 16 for F(4x4, 5x5)) would spend a
    bfloat16 mantissa (FedReg's CNN in bfloat16: 6% logit error through F(4x4, 5x5), against under 5% by XLA)."""
    kh, kw, channels, _ = w.shape
    if kh != kw or tuple(strides) != (1, 1) or channels < WINOGRAD_MIN_CHANNELS or w.dtype != jnp.float32:
        return None
    return WINOGRAD_TILES.get(backend, {}).get(int(kh))


def _padded(x, pads):
    """``x [N, H, W, C]`` zero-padded by ``pads = ((top, bottom), (left, right))``."""
    return jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))


def patch_bytes(x, w, strides: tuple[int, int], pads) -> int:
    """Bytes of ``matmul_conv``'s patch matrix ``[N, OH, OW, kh * kw * I]`` for ``x [N, H, W, I]``, ``w [kh, kw, I, O]``."""
    kh, kw, channels, _ = w.shape
    oh = (x.shape[1] + sum(pads[0]) - kh) // strides[0] + 1
    ow = (x.shape[2] + sum(pads[1]) - kw) // strides[1] + 1
    return x.shape[0] * oh * ow * kh * kw * channels * x.dtype.itemsize


def matmul_conv(x, w, strides: tuple[int, int], pads, precision=None):
    """A convolution as one matrix product: ``x [N, H, W, I]``, ``w [kh, kw, I, O]`` -> ``[N, OH, OW, O]``.

    The ``kh * kw`` shifted (strided) views of the padded input are concatenated on the
    channel axis (im2col, ``[N, OH, OW, kh * kw * I]``) and multiplied by the kernel
    reshaped to ``[kh * kw * I, O]``. Autodiff gives the kernel gradient as a matrix
    product and the input gradient as one plus a sum of padded slices. Under a client
    vmap the products become batched matrix products, never grouped convolutions.
    """
    kh, kw, _, out = w.shape
    x = _padded(x, pads)
    oh, ow = (x.shape[1] - kh) // strides[0] + 1, (x.shape[2] - kw) // strides[1] + 1
    views = [x[:, a:a + (oh - 1) * strides[0] + 1:strides[0], b:b + (ow - 1) * strides[1] + 1:strides[1], :]
             for a in range(kh) for b in range(kw)]
    cols = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
    return jnp.dot(cols, w.reshape(-1, out), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_trained_conv(x, w, strides: tuple[int, int], pads, precision=None):
    """``matmul_conv`` where it is differentiated, ``lax``'s convolution where it is not.

    ``x [N, H, W, I]``, ``w [kh, kw, I, O]`` -> ``[N, OH, OW, O]``. Evaluation and teacher
    predictions (no gradient) take XLA's own forward convolution and never build the patch
    matrix (CNN2 on 10,000 test images in batches of 1,000, 2 cores: 0.95 s against 1.91 s
    through the patches; ``python -m experiments.bench_conv``); under ``grad`` the forward is
    ``matmul_conv``'s matrix product, whose patches its backward reuses (values and gradients
    as ``matmul_conv``'s). Under a client vmap an undifferentiated call is a grouped convolution
    (a CPU runs convolutional models' clients in turn by default, ``core.layout``). Forward-mode
    autodiff is not defined (as for ``loop_friendly_conv``).
    """
    return _forward(x, w, strides, pads, precision)


def _trained_fwd(x, w, strides, pads, precision):
    return jax.vjp(lambda x, w: matmul_conv(x, w, strides, pads, precision), x, w)


def _trained_bwd(strides, pads, precision, vjp, dy):
    del strides, pads, precision
    return vjp(dy)


matmul_trained_conv.defvjp(_trained_fwd, _trained_bwd)


def _forward(x, w, strides, pads, precision):
    return lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=_NHWC, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def loop_friendly_conv(x, w, strides: tuple[int, int], pads, precision=None):
    """``lax``'s NHWC convolution, ``x [N, H, W, I]``, ``w [kh, kw, I, O]`` -> ``[N, OH, OW, O]``, whose
    backward passes are forward convolutions (fast inside XLA:CPU loops, unlike ``lax``'s)."""
    return _forward(x, w, strides, pads, precision)


def _conv_fwd(x, w, strides, pads, precision):
    return _forward(x, w, strides, pads, precision), (x, w)


def _dilate(dy, strides):
    """Insert ``stride - 1`` zeros between output positions: ``[N, (O-1)s+1, ...]``."""
    if strides == (1, 1):
        return dy
    n, oh, ow, c = dy.shape
    out = jnp.zeros((n, (oh - 1) * strides[0] + 1, (ow - 1) * strides[1] + 1, c), dy.dtype)
    return out.at[:, ::strides[0], ::strides[1], :].set(dy)


def _conv_bwd(strides, pads, precision, residuals, dy):
    x, w = residuals
    kh, kw = w.shape[:2]
    x_pad = _padded(x, pads)
    ph, pw = x_pad.shape[1:3]
    dy_dil = _dilate(dy, strides)
    dh, dw_ = dy_dil.shape[1:3]
    # Input gradient: full correlation of the dilated dy with the flipped, in/out-swapped kernel,
    # padded at the end to cover rows the strided windows never reached.
    dy_full = jnp.pad(dy_dil, ((0, 0), (kh - 1, kh - 1 + ph - (dh + kh - 1)), (kw - 1, kw - 1 + pw - (dw_ + kw - 1)),
                               (0, 0)))
    w_t = jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2)
    dx_pad = _forward(dy_full, w_t, (1, 1), ((0, 0), (0, 0)), precision)
    dx = dx_pad[:, pads[0][0]:pads[0][0] + x.shape[1], pads[1][0]:pads[1][0] + x.shape[2], :]
    if patch_bytes(x, w, strides, pads) <= MATMUL_KERNEL_GRAD_MAX_BYTES.get(jax.default_backend(), -1):
        # Kernel gradient: patches^T dy, one matrix product (the patches live only in the backward).
        transpose = jax.linear_transpose(lambda w: matmul_conv(x, w, strides, pads, precision), w)
        return dx, transpose(dy)[0]
    # Kernel gradient: a convolution over the batch axis (channels as the batch).
    lhs = x_pad.transpose(3, 1, 2, 0)            # [I, PH, PW, N]
    rhs = dy_dil.transpose(1, 2, 0, 3)           # [DH, DW, N, O]
    dw = _forward(lhs, rhs, (1, 1), ((0, 0), (0, 0)), precision)[:, :kh, :kw, :]  # [I, kh, kw, O]
    return dx, dw.transpose(1, 2, 0, 3)


loop_friendly_conv.defvjp(_conv_fwd, _conv_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def per_client_conv(x, w, strides: tuple[int, int], pads, precision=None, winograd: int | None = None):
    """``x [N, H, W, I]``, ``w [kh, kw, I, O]`` -> ``[N, OH, OW, O]``: ``matmul_trained_conv`` where a vmap
    batches the differentiated convolution (a client vmap: batched matrix products, never grouped
    convolutions), ``loop_friendly_conv`` where none does (a client trained alone: XLA's convolutions,
    faster on a CPU core than the im2col copy and product; ``ALONE_MATMUL_CONV_MAX_BYTES``), or with
    ``winograd = m`` (stride 1, a square kernel; ``winograd_tile``) the Winograd convolution F(m x m) alone
    (``models.winograd``: forward and both gradients; ``precision`` is not passed to its products).

    Undifferentiated, it is ``lax``'s forward convolution either way. The choice is made per pass by
    ``jax.custom_batching.custom_vmap``; under a vmap the backward rebuilds the patches from ``x``
    rather than keeping them from the forward. Forward-mode autodiff is not defined.
    """
    return _forward(x, w, strides, pads, precision)


def _alone_or_batched(alone, batched):
    """``alone(*args)`` where no vmap batches the arguments, ``jax.vmap(batched)(*args)`` where one does
    (unbatched arguments broadcast); outputs batched whenever one argument is. Derivatives (a second-order
    gradient through ``per_client_conv``) are ``alone``'s, batched or not: ``custom_vmap`` has no reverse mode."""
    fn = jax.custom_batching.custom_vmap(alone)

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(batched, in_axes=axes, axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    differentiable = jax.custom_jvp(fn)
    differentiable.defjvp(lambda primals, tangents: (fn(*primals), jax.jvp(alone, primals, tangents)[1]))
    return differentiable


def _per_client_fwd(x, w, strides, pads, precision, winograd):
    if winograd and (tuple(strides) != (1, 1) or w.shape[0] != w.shape[1]):
        raise ValueError(f"per_client_conv(winograd={winograd}) needs stride 1 and a square kernel, got strides "
                         f"{strides} and a {w.shape[0]}x{w.shape[1]} kernel; fix: winograd=None")
    alone = ((lambda x, w: winograd_forward(_padded(x, pads), w, winograd)) if winograd
             else (lambda x, w: _forward(x, w, strides, pads, precision)))
    y = _alone_or_batched(alone, lambda x, w: matmul_conv(x, w, strides, pads, precision))(x, w)
    return y, (x, w)


def _winograd_grads(x, w, dy, pads, m):
    """``(dx, dw)`` of the padded stride-1 convolution by Winograd F(m x m) (``winograd_conv_grads``)."""
    dx, dw = winograd_conv_grads(_padded(x, pads), w, dy, m)
    return dx[:, pads[0][0]:pads[0][0] + x.shape[1], pads[1][0]:pads[1][0] + x.shape[2]], dw


def _matmul_conv_grads(x, w, dy, strides, pads, precision):
    """``(dx, dw)`` of ``matmul_conv`` for the cotangent ``dy``, each the transpose of a linear map."""
    dx = jax.linear_transpose(lambda x: matmul_conv(x, w, strides, pads, precision), x)(dy)[0]
    dw = jax.linear_transpose(lambda w: matmul_conv(x, w, strides, pads, precision), w)(dy)[0]
    return dx, dw


def _per_client_bwd(strides, pads, precision, winograd, residuals, dy):
    x, w = residuals
    alone = ((lambda x, w, dy: _winograd_grads(x, w, dy, pads, winograd)) if winograd
             else (lambda x, w, dy: _conv_bwd(strides, pads, precision, (x, w), dy)))
    return _alone_or_batched(alone, lambda x, w, dy: _matmul_conv_grads(x, w, dy, strides, pads, precision))(x, w, dy)


per_client_conv.defvjp(_per_client_fwd, _per_client_bwd)
