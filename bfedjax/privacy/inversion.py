"""Gradient-inversion attacks on client updates and the PSNR of their reconstructions.

FedReg (Xu et al., ICLR 2022, Sec. 4.5 / App. B.4) measures how much a
client's update leaks its data by running the attacks of DLG (Zhu et al.,
2019: L2 distance between updates) and of Geiping et al. (2020: cosine
distance plus total variation) and reporting the PSNR of the recovered
images. The attacker knows the labels, the parameters before the step and
the observed update; it optimises dummy inputs so that their update matches.

    rec = reconstruct(update_fn, params, observed, x.shape, y, key=key, distance="cosine", tv_weight=1e-2)
    psnr(rec.x, x)  # [N] dB
"""
from __future__ import annotations

import pathlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bfedjax.optional import require

DISTANCES = ("l2", "cosine")


class Reconstruction(NamedTuple):
    """``x``: reconstructed inputs ``[N, ...]``; ``loss``: final objective (scalar)."""

    x: jax.Array
    loss: jax.Array


def psnr(reconstruction: jax.Array, original: jax.Array, max_value: float = 1.0) -> jax.Array:
    """Peak signal-to-noise ratio in dB per image, ``[N, ...] x [N, ...] -> [N]``.

    ``10 log10(max_value**2 / MSE)`` with the MSE over all pixels of one image;
    identical images give ``+inf``.
    """
    reconstruction, original = jnp.asarray(reconstruction), jnp.asarray(original)
    if reconstruction.shape != original.shape or reconstruction.ndim < 2:
        raise ValueError(f"psnr needs two [N, ...] batches of one shape, got {reconstruction.shape} and "
                         f"{original.shape}; add a leading batch axis with x[None]")
    axes = tuple(range(1, original.ndim))
    mse = jnp.mean((reconstruction.astype(jnp.float32) - original.astype(jnp.float32)) ** 2, axis=axes)
    return 10.0 * jnp.log10(max_value ** 2 / mse)


def total_variation(x: jax.Array) -> jax.Array:
    """Anisotropic total variation of images ``[N, H, W, C] -> ()``: the mean absolute
    difference of vertical neighbours plus that of horizontal neighbours (Geiping et al.)."""
    if x.ndim != 4:
        raise ValueError(f"total_variation needs images [N, H, W, C], got shape {x.shape}; reshape x first")
    dy = jnp.mean(jnp.abs(x[:, 1:] - x[:, :-1]))
    dx = jnp.mean(jnp.abs(x[:, :, 1:] - x[:, :, :-1]))
    return dy + dx


def step_decay_lr(lr: float, iterations: int) -> optax.Schedule:
    """``step -> lr``, multiplied by 0.1 from steps ``3/8``, ``5/8`` and ``7/8`` of ``iterations`` on."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be a positive number of optimiser steps, e.g. 2000")
    milestones = jnp.array([iterations * 3 // 8, iterations * 5 // 8, iterations * 7 // 8])
    return lambda step: lr * 0.1 ** jnp.sum(step >= milestones)


def _leaves(tree) -> list[jax.Array]:
    return [jnp.ravel(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


def _l2(a, b) -> jax.Array:
    """Sum of squared differences over all leaves (DLG)."""
    return sum(jnp.sum((u - v) ** 2) for u, v in zip(_leaves(a), _leaves(b)))


def _cosine(a, b) -> jax.Array:
    """``1 - <a, b> / (|a| |b|)`` with all leaves flattened into one vector (Geiping et al.)."""
    la, lb = _leaves(a), _leaves(b)
    dot = sum(jnp.sum(u * v) for u, v in zip(la, lb))
    norm_a = jnp.sqrt(sum(jnp.sum(u ** 2) for u in la))
    norm_b = jnp.sqrt(sum(jnp.sum(v ** 2) for v in lb))
    return 1.0 - dot / jnp.maximum(norm_a * norm_b, 1e-30)


def _initial_x(key: jax.Array, x_shape: tuple[int, ...], clamp: tuple[float, float] | None) -> jax.Array:
    """Dummy inputs ``x_shape``: uniform in the clamp range, or standard normal without one."""
    if clamp is None:
        return jax.random.normal(key, x_shape)
    return jax.random.uniform(key, x_shape, minval=clamp[0], maxval=clamp[1])


def reconstruct(update_fn: Callable, params, observed_update, x_shape: tuple[int, ...], y: jax.Array, *,
                key: jax.Array, distance: str = "l2", tv_weight: float = 0.0, iterations: int = 2000,
                lr: float = 1.0, clamp: tuple[float, float] | None = (0.0, 1.0)) -> Reconstruction:
    """Recover inputs ``x_shape = [N, ...]`` whose update matches ``observed_update``.

    Minimises ``distance(update_fn(params, x, y), observed_update) + tv_weight * TV(x)``
    over ``x`` with Adam under :func:`step_decay_lr`, clamping ``x`` after every step,
    as one jitted ``lax.fori_loop``. ``update_fn(params, x, y)`` must return a pytree
    shaped like ``observed_update`` and be differentiable in ``x``; ``y`` are the labels.
    """
    if distance not in DISTANCES:
        raise ValueError(f"distance {distance!r}; choose one of {DISTANCES}")
    if tv_weight and len(x_shape) != 4:
        raise ValueError(f"tv_weight needs images [N, H, W, C], got x_shape {tuple(x_shape)}; set tv_weight=0.0")
    if clamp is not None and not clamp[0] < clamp[1]:
        raise ValueError(f"clamp={clamp} must be (low, high) with low < high, or None for no clamping")
    dist = _l2 if distance == "l2" else _cosine
    opt = optax.adam(step_decay_lr(lr, iterations))

    def objective(x, params, observed, y):
        loss = dist(update_fn(params, x, y), observed)
        return loss + tv_weight * total_variation(x) if tv_weight else loss

    def step(_, carry):
        x, state, args = carry
        grads = jax.grad(objective)(x, *args)
        updates, state = opt.update(grads, state, x)
        x = optax.apply_updates(x, updates)
        x = x if clamp is None else jnp.clip(x, *clamp)
        return x, state, args

    @jax.jit
    def run(x0, params, observed, y):
        args = (params, observed, y)
        x, _, _ = jax.lax.fori_loop(0, iterations, step, (x0, opt.init(x0), args))
        return Reconstruction(x, objective(x, *args))

    return run(_initial_x(key, tuple(x_shape), clamp), params, observed_update, y)


def _as_images(x, name: str) -> np.ndarray:
    """``[N, H, W]`` or ``[N, H, W, C]`` (C = 1 or 3) -> ``[N, H, W, C]`` float in [0, 1]."""
    x = np.asarray(x, dtype=np.float32)
    x = x[..., None] if x.ndim == 3 else x
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"{name} must be images [N, H, W] or [N, H, W, C] with C in (1, 3), got {x.shape}")
    return np.clip(x, 0.0, 1.0)


def save_reconstruction_png(path: str | pathlib.Path, originals, reconstructions: dict[str, jax.Array],
                            psnrs: dict[str, jax.Array] | None = None, title: str | None = None) -> pathlib.Path:
    """Write a PNG grid: the ``originals [N, H, W(, C)]`` on top, then one row per method
    (labelled by its name), each image titled with its PSNR in dB when ``psnrs[method]`` is given."""
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = {"original": _as_images(originals, "originals")}
    for name, rec in reconstructions.items():
        rows[name] = _as_images(rec, f"reconstructions[{name!r}]")
        if rows[name].shape != rows["original"].shape:
            raise ValueError(f"reconstructions[{name!r}] has shape {rows[name].shape}, expected the originals' "
                             f"{rows['original'].shape}")
    n = rows["original"].shape[0]
    fig = Figure(figsize=(1.6 * n + 0.8, 1.7 * len(rows) + (0.4 if title else 0.0)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), n, squeeze=False)
    for r, (name, images) in enumerate(rows.items()):
        values = None if psnrs is None or name not in psnrs else np.asarray(psnrs[name]).reshape(-1)
        for i, ax in enumerate(axes[r]):
            ax.imshow(images[i, ..., 0] if images.shape[-1] == 1 else images[i], cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([]), ax.set_yticks([])
            if values is not None:
                ax.set_title(f"{values[i]:.1f} dB", fontsize=8)
        axes[r, 0].set_ylabel(name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


__all__ = ["DISTANCES", "Reconstruction", "psnr", "reconstruct", "save_reconstruction_png", "step_decay_lr",
           "total_variation"]
