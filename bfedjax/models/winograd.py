"""Winograd minimal-filtering convolutions F(m x m, r x r) (Lavin and Gray, 2016) with an explicit backward.

A stride-1 correlation of an ``r x r`` kernel computes each ``m x m`` output tile from an
``n x n`` input tile, ``n = m + r - 1``, as

    Y = A^T [ (G g G^T) * (B^T d B) ] A

summed over input channels: the ``n * n`` positions of the transformed tile become ``n * n``
independent matrix products ``[tiles, C] x [C, O]``. F(4x4, 5x5) takes 64 products per 16 outputs
where the direct convolution takes 400, so a 5x5 convolution costs about a sixth of the
multiplications, plus the (cheap, elementwise) tile transforms. The matrices come from
Toom-Cook interpolation at the points ``0, 1, -1, 1/2, -1/2, 2, -2, ...`` and infinity
(``winograd_matrices``); float32 values and gradients stay within 3e-5 and 5e-5 of ``lax``'s
(relative to the largest entry; tested).

``winograd_conv`` differentiates by an explicit VJP, never by autodiff of the transforms (whose
strided-slice transposes XLA:CPU runs slowly):

* kernel gradient: the transformed input tiles ``V`` (kept from ``winograd_conv``'s forward pass;
  ``models.conv.per_client_conv`` recomputes them) against the
  output gradient taken into the transformed domain (``A``'s transpose, on non-overlapping tiles),
  ``n * n`` products ``[C, tiles] x [tiles, O]``, then ``G^T (.) G``;
* input gradient: the full correlation of the padded output gradient with the flipped,
  in/out-swapped kernel, itself a Winograd convolution.

``models.conv`` uses it for a client trained alone on a CPU (``WINOGRAD_TILES``); the transforms
are written as sums of the nonzero terms, unrolled, which XLA fuses into a few loops.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Toom-Cook interpolation points, in order of use: small magnitudes keep the transforms well conditioned.
INTERPOLATION_POINTS = (0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25, 4.0, -4.0)


@functools.lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A^T [m, n], G [n, r], B^T [n, n])``, ``n = m + r - 1``, with ``y = A^T ((G g) * (B^T d))`` the
    correlation ``y_i = sum_k g_k d_(i+k)`` of ``g [r]`` with ``d [n]`` (float64).

    ``A^T`` and ``G`` evaluate polynomials at ``n - 1`` points and infinity; ``B^T`` is solved from the
    identity itself (``m * r * n`` linear equations), which a wrong construction would leave unsolved.
    """
    n = m + r - 1
    if m < 1 or r < 1 or n - 1 > len(INTERPOLATION_POINTS):
        raise ValueError(f"Winograd F({m}, {r}) needs 1 <= m, 1 <= r and m + r - 2 <= {len(INTERPOLATION_POINTS)}")
    points = INTERPOLATION_POINTS[:n - 1]
    a_t, g = np.zeros((m, n)), np.zeros((n, r))
    for j, p in enumerate(points):
        a_t[:, j] = [p ** i for i in range(m)]
        g[j] = [p ** k for k in range(r)]
    a_t[m - 1, n - 1] = g[n - 1, r - 1] = 1.0
    # sum_j A^T[i, j] G[j, k] B^T[j, l] = [l == i + k] for every i, k, l: linear in B^T's entries
    equations, targets = [], []
    for i in range(m):
        for k in range(r):
            for l in range(n):
                row = np.zeros((n, n))
                row[:, l] = a_t[i] * g[:, k]
                equations.append(row.ravel())
                targets.append(float(l == i + k))
    solution = np.linalg.lstsq(np.array(equations), np.array(targets), rcond=None)[0]
    residual = np.abs(np.array(equations) @ solution - np.array(targets)).max()
    if residual > 1e-9:
        raise ArithmeticError(f"Winograd F({m}, {r}): no input transform for these points (residual {residual:.1e})")
    b_t = np.round(solution.reshape(n, n), 12)  # exact rationals, less the solver's rounding (and its -0.0s)
    b_t[b_t == 0.0] = 0.0
    return a_t, g, b_t


def _combine(coefficients, terms):
    """``sum_k coefficients[k] * terms[k]`` over the nonzero coefficients (an elementwise expression XLA fuses)."""
    total = None
    for c, term in zip(np.asarray(coefficients, np.float64), terms):
        if c == 0.0:
            continue
        value = term if c == 1.0 else term * np.asarray(c, term.dtype)
        total = value if total is None else total + value
    return total if total is not None else jnp.zeros_like(terms[0])


def _barrier(x):
    """Materialises a transform's first (separable) half: fused with its second, XLA would recompute it for every
    output position (and take seconds to compile the expression)."""
    return jax.lax.optimization_barrier(x)


def _tiles(size: int, r: int, m: int) -> int:
    return -(-(size - r + 1) // m)


def input_transform(x: jax.Array, m: int, r: int) -> jax.Array:
    """``x [N, H, W, C]`` -> ``V [n, n, N, TH, TW, C]``: ``B^T d B`` of every ``n x n`` input tile (stride ``m``),
    ``TH = ceil((H - r + 1) / m)`` (the input zero-padded at the end to whole tiles)."""
    b_t = winograd_matrices(m, r)[2]
    n = m + r - 1
    _, h, w, _ = x.shape
    th, tw = _tiles(h, r, m), _tiles(w, r, m)
    x = jnp.pad(x, ((0, 0), (0, th * m + r - 1 - h), (0, tw * m + r - 1 - w), (0, 0)))
    rows = [x[:, p:p + m * (th - 1) + 1:m] for p in range(n)]                    # [N, TH, W', C] each
    by_row = _barrier(jnp.stack([_combine(b_t[a], rows) for a in range(n)]))     # [n, N, TH, W', C]
    cols = [by_row[:, :, :, q:q + m * (tw - 1) + 1:m] for q in range(n)]         # [n, N, TH, TW, C] each
    return jnp.stack([_combine(b_t[b], cols) for b in range(n)], axis=1)


def _along(matrix, x: jax.Array, axis: int) -> jax.Array:
    """``matrix [a, p]`` applied to ``x``'s ``axis`` (of size ``p``; the result's is of size ``a``), as unrolled sums of
    the nonzero terms."""
    parts = [jax.lax.index_in_dim(x, p, axis, keepdims=False) for p in range(x.shape[axis])]
    return jnp.stack([_combine(row, parts) for row in np.asarray(matrix)], axis=axis)


def _two_sided(matrix, x: jax.Array) -> jax.Array:
    """``matrix X matrix^T`` over ``x``'s first two axes: ``[p, p, ...] -> [a, a, ...]``."""
    return _along(matrix, _barrier(_along(matrix, x, 0)), 1)


def kernel_transform(w: jax.Array, m: int) -> jax.Array:
    """``w [r, r, C, O]`` -> ``U [n, n, C, O]``: ``G g G^T`` per channel pair."""
    return _two_sided(winograd_matrices(m, w.shape[0])[1], w)


def kernel_from_transform(du: jax.Array, m: int, r: int) -> jax.Array:
    """The transpose of ``kernel_transform``: ``dU [n, n, C, O]`` -> ``dw [r, r, C, O]`` (``G^T dU G``)."""
    return _two_sided(winograd_matrices(m, r)[1].T, du)


def output_transform(products: jax.Array, m: int, r: int, out_h: int, out_w: int) -> jax.Array:
    """``M [n, n, N, TH, TW, O]`` -> ``y [N, out_h, out_w, O]``: ``A^T M A`` per tile, tiles laid side by side."""
    y = _two_sided(winograd_matrices(m, r)[0], products)                         # [m, m, N, TH, TW, O]
    _, _, batch, th, tw, out = y.shape
    return y.transpose(2, 3, 0, 4, 1, 5).reshape(batch, th * m, tw * m, out)[:, :out_h, :out_w]


def output_transform_transpose(dy: jax.Array, m: int, r: int, th: int, tw: int) -> jax.Array:
    """The transpose of ``output_transform``: ``dy [N, oh, ow, O]`` -> ``dM [n, n, N, TH, TW, O]``."""
    batch, oh, ow, out = dy.shape
    dy = jnp.pad(dy, ((0, 0), (0, th * m - oh), (0, tw * m - ow), (0, 0))).reshape(batch, th, m, tw, m, out)
    return _two_sided(winograd_matrices(m, r)[0].T, dy.transpose(2, 4, 0, 1, 3, 5))


def _products(v, u):
    """``V [n, n, N, TH, TW, C]``, ``U [n, n, C, O]`` -> ``[n, n, N, TH, TW, O]``: one matrix product per position."""
    n, _, batch, th, tw, channels = v.shape
    flat = v.reshape(n * n, batch * th * tw, channels)
    out = jnp.einsum("tpc,tco->tpo", flat, u.reshape(n * n, channels, -1))
    return out.reshape(n, n, batch, th, tw, -1)


def _forward(x, w, m):
    r = w.shape[0]
    v = input_transform(x, m, r)
    y = output_transform(_products(v, kernel_transform(w, m)), m, r, x.shape[1] - r + 1, x.shape[2] - r + 1)
    return y, v


def winograd_forward(x: jax.Array, w: jax.Array, m: int) -> jax.Array:
    """``winograd_conv``'s value, ``x [N, H, W, C]``, ``w [r, r, C, O]`` -> ``[N, H - r + 1, W - r + 1, O]``, as plain
    JAX operations (differentiable by autodiff, slowly: for callers with a backward of their own)."""
    return _forward(x, w, m)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def winograd_conv(x: jax.Array, w: jax.Array, m: int) -> jax.Array:
    """VALID stride-1 correlation ``x [N, H, W, C]``, ``w [r, r, C, O]`` -> ``[N, H - r + 1, W - r + 1, O]``
    by Winograd F(m x m, r x r), differentiated by ``winograd_conv_grads`` (forward-mode autodiff is not
    defined). ``lax.conv_general_dilated``'s NHWC/HWIO convolution with ``padding="VALID"``, to float rounding."""
    return _forward(x, w, m)[0]


def winograd_conv_grads(x: jax.Array, w: jax.Array, dy: jax.Array, m: int, v: jax.Array | None = None):
    """``(dx [N, H, W, C], dw [r, r, C, O])`` of ``winograd_conv(x, w, m)`` for the cotangent ``dy [N, oh, ow, O]``;
    ``v``: ``input_transform(x, m, r)`` when the caller has it."""
    r = w.shape[0]
    v = input_transform(x, m, r) if v is None else v
    n, _, batch, th, tw, channels = v.shape
    dm = output_transform_transpose(dy, m, r, th, tw)
    du = jnp.einsum("tpc,tpo->tco", v.reshape(n * n, -1, channels), dm.reshape(n * n, batch * th * tw, -1))
    dw = kernel_from_transform(du.reshape(n, n, channels, -1), m, r)
    padded = jnp.pad(dy, ((0, 0), (r - 1, r - 1), (r - 1, r - 1), (0, 0)))
    dx = _forward(padded, jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2), m)[0]
    return dx, dw


def _winograd_fwd(x, w, m):
    y, v = _forward(x, w, m)
    return y, (x, w, v)


def _winograd_bwd(m, residuals, dy):
    x, w, v = residuals
    return winograd_conv_grads(x, w, dy, m, v)


winograd_conv.defvjp(_winograd_fwd, _winograd_bwd)
