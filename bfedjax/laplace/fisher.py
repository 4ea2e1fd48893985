"""Diagonal empirical-Fisher estimators for Laplace approximations.

Each estimator returns, for one masked batch, the gradient of the batch-mean
cross-entropy (the training direction) and this batch's increment to a
client's diagonal Fisher, in a single backward pass:

``batch_mean_sq`` (FOLA authors' code, the default)
    g = grad(mean CE over the batch);  increment = (n_b / m) * g**2
    One epoch of increments sums to (approximately) a squared-mean-gradient
    Fisher; cheap, and the scale the paper's lambda grid was tuned for.
``per_sample_sq`` (paper Eqs. 21-22)
    per-example gradients g_i through ``vmap(grad)``; increment = sum_i g_i**2 / m,
    and g = mean_i g_i (the per-example pass gives the training gradient too).
    One epoch of increments is exactly the empirical Fisher of Eq. 21.
``alg1_raw`` (paper Algorithm 1)
    increment = g**2 (no normalisation).

``m`` is the client's number of real samples, ``n_b`` the batch's.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from bfedjax.core.batching import ordered_pass
from bfedjax.core.types import Batch, ClientData
from bfedjax.losses import cross_entropy, masked_mean, masked_mean_cross_entropy
from bfedjax.tree import tree_zeros_like

FISHER_ESTIMATORS = ("batch_mean_sq", "per_sample_sq", "alg1_raw")


def _ce_one(apply_fn, params, x, y):
    """Cross-entropy of a single example ``x`` (no batch axis)."""
    return cross_entropy(apply_fn(params, x[None]), y[None])[0]


def per_example_grads(apply_fn, params, batch: Batch):
    """Per-example losses ``[B]`` and CE gradients (leaves ``[B, ...]``), padded rows zeroed."""
    loss_and_grad = jax.value_and_grad(lambda p, x, y: _ce_one(apply_fn, p, x, y))
    losses, grads = jax.vmap(loss_and_grad, in_axes=(None, 0, 0))(params, batch.x, batch.y)
    mask = batch.mask
    grads = jax.tree.map(lambda g: g * mask.reshape((-1,) + (1,) * (g.ndim - 1)), grads)
    return losses, grads


def grad_and_fisher(apply_fn: Callable, params, batch: Batch, num_samples: jax.Array, fisher_estimator: str | None):
    """Training gradient and Fisher increment of one batch.

    Args:
      apply_fn: ``(params, x[B, ...]) -> logits[B, K]``.
      params: model parameters (pytree).
      batch: masked ``Batch``.
      num_samples: ``[]`` the client's real sample count ``m``.
      fisher_estimator: one of ``FISHER_ESTIMATORS`` or ``None`` (no Fisher).
    Returns:
      ``(loss, grad, increment)``; ``increment`` is ``None`` when ``fisher_estimator`` is None.
    """
    n_batch = jnp.maximum(jnp.sum(batch.mask), 1.0)
    m = jnp.maximum(num_samples.astype(jnp.float32), 1.0)
    if fisher_estimator == "per_sample_sq":
        losses, grads = per_example_grads(apply_fn, params, batch)
        loss = jnp.sum(losses * batch.mask) / n_batch
        grad = jax.tree.map(lambda g: jnp.sum(g, axis=0) / n_batch, grads)
        increment = jax.tree.map(lambda g: jnp.sum(jnp.square(g), axis=0) / m, grads)
        return loss, grad, increment
    loss, grad = jax.value_and_grad(masked_mean_cross_entropy, argnums=1)(apply_fn, params, batch)
    return loss, grad, increment_from_batch_grad(grad, batch, m, fisher_estimator)


def increment_from_batch_grad(grad, batch: Batch, m, fisher_estimator: str | None):
    """Fisher increment of the estimators that square the batch gradient (``None`` without one)."""
    if fisher_estimator is None:
        return None
    if fisher_estimator == "batch_mean_sq":
        scale = jnp.sum(batch.mask) / m
        # (scale * g) * g, not scale * g**2: a square of its own would be shared with the clip norm's
        # and materialised as a full tensor for both (FOLA with prior_grad=False)
        return jax.tree.map(lambda g: (scale * g) * g, grad)
    if fisher_estimator == "alg1_raw":
        return jax.tree.map(jnp.square, grad)
    raise ValueError(f"unknown Fisher estimator {fisher_estimator!r}; choose one of {FISHER_ESTIMATORS}")


def train_mode_grad_and_fisher(train_apply: Callable, params, batch: Batch, num_samples: jax.Array,
                               fisher_estimator: str | None, key: jax.Array):
    """``grad_and_fisher`` for models with BatchNorm or dropout.

    Args:
      train_apply: ``(params, x, mask, key) -> (logits, params)`` (``models.train_apply_fn_of``).
      key: dropout key of this step.
    Returns:
      ``(loss, grad, increment, params)``; the returned ``params`` carry the
      updated BatchNorm statistics (their gradient is zero).
    Raises:
      ValueError: for ``per_sample_sq``, whose per-example passes have no batch statistics.
    """
    if fisher_estimator == "per_sample_sq":
        raise ValueError("fisher='per_sample_sq' needs a model without BatchNorm or dropout; "
                         "use 'batch_mean_sq' or 'alg1_raw'")

    def loss_fn(p):
        logits, updated = train_apply(p, batch.x, batch.mask, key)
        return masked_mean(cross_entropy(logits, batch.y), batch.mask), updated

    (loss, updated), grad = jax.value_and_grad(loss_fn, has_aux=True)(params)
    m = jnp.maximum(num_samples.astype(jnp.float32), 1.0)
    return loss, grad, increment_from_batch_grad(grad, batch, m, fisher_estimator), updated


def offline_fisher(apply_fn: Callable, params, data: ClientData, batch_size: int,
                   fisher_estimator: str = "batch_mean_sq"):
    """Diagonal Fisher from one ordered pass over a client's data at fixed ``params``.

    This is the offline estimate (FOLA Eq. 21 for ``per_sample_sq``; the
    authors' FedCurv / offline-ablation code for ``batch_mean_sq``).
    Returns a pytree shaped like ``params``.
    """

    def accumulate(fisher, batch):
        _, _, inc = grad_and_fisher(apply_fn, params, batch, data.count, fisher_estimator)
        return jax.tree.map(jnp.add, fisher, inc)

    return ordered_pass(accumulate, tree_zeros_like(params), data, batch_size)
