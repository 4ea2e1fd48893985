"""Losses of masked mini-batches (jax only: importing this loads no optimiser or network library).

A ``Batch`` holds ``x [B, ...]``, ``y [B]`` and ``mask [B]`` (1 for a real
sample, 0 for a padding row); every mean here is over the real rows only.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy ``logsumexp(logits) - logits[label]``.

    Args:
      logits: ``[..., K]`` floats.
      labels: ``[...]`` integer classes.
    Returns:
      ``[...]`` losses.
    """
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values [B]`` over the rows where ``mask [B]`` is 1 (0 for an all-padding batch)."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_mean_cross_entropy(apply_fn: Callable, params, batch) -> jax.Array:
    """Mean softmax cross-entropy of ``apply_fn(params, batch.x)`` over the real rows of ``batch`` (a scalar)."""
    return masked_mean(cross_entropy(apply_fn(params, batch.x), batch.y), batch.mask)


def soft_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean of ``-sum_k targets_k log softmax(logits)_k``; logits and targets ``[B, K]``, mask ``[B]``.

    ``log_softmax`` rather than FedReg's released ``log(softmax + 1e-12)``: the same value away from
    underflow, and soft labels equal to the model's own softmax make it exactly stationary.
    """
    return masked_mean(-jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1), mask)


def distillation(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array, mask: jax.Array,
                 alpha: float, temperature: float = 1.0) -> jax.Array:
    """Knowledge distillation (HBFL Eq. 2.4 / FML): ``alpha CE + (1 - alpha) T^2 KL(q_teacher || q_student)``.

    ``q = softmax(logits / T)``; both terms are masked means over the batch (the
    FML code's ``KLDivLoss(batchmean)``); ``T^2`` keeps the KL's gradient scale
    for ``T > 1`` (1 at the default T = 1). No gradient reaches the teacher.

    Args:
      student_logits, teacher_logits: ``[B, K]``; labels: ``[B]`` ints; mask: ``[B]``.
      alpha: weight of the cross-entropy (1: plain CE); temperature: T > 0.
    Returns:
      a scalar.
    """
    ce = masked_mean(cross_entropy(student_logits, labels), mask)
    teacher = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits / temperature))
    student = jax.nn.log_softmax(student_logits / temperature)
    kl = masked_mean(jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1), mask)
    return alpha * ce + (1.0 - alpha) * temperature ** 2 * kl


__all__ = ["cross_entropy", "distillation", "masked_mean", "masked_mean_cross_entropy", "soft_cross_entropy"]
