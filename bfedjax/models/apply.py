"""Applying zoo models the same way whether or not they have BatchNorm or dropout.

The engine carries one pytree per model, called ``params`` everywhere:

* for a model without BatchNorm it is the Flax ``'params'`` collection;
* for a model with BatchNorm (``uses_batch_stats = True``, e.g. ``ResNet20``)
  it is the whole variables dict ``{"params": ..., "batch_stats": ...}``, so the
  running statistics are stacked, vmapped and averaged by the server like any
  other deterministic leaf (Fischer et al. keep normalisation layers deterministic).

Models with BatchNorm or dropout take keyword arguments
``train`` (BatchNorm uses and updates batch statistics), ``dropout`` (dropout
active outside training: MC dropout) and ``mask`` (``[B]``, rows that are real;
BatchNorm statistics ignore padded rows).
"""
from __future__ import annotations

from typing import Callable

import jax


def has_batch_stats(model) -> bool:
    """Whether ``model`` keeps BatchNorm running statistics."""
    return bool(getattr(model, "uses_batch_stats", False))


def has_dropout(model) -> bool:
    """Whether ``model`` has dropout layers (``dropout_rate > 0``)."""
    return float(getattr(model, "dropout_rate", 0.0) or 0.0) > 0.0


def needs_train_mode(model) -> bool:
    """Whether training differs from prediction (BatchNorm or dropout)."""
    return has_batch_stats(model) or has_dropout(model)


def variables_of(model, params):
    """The Flax variables dict of the engine's ``params`` pytree."""
    return params if has_batch_stats(model) else {"params": params}


def apply_fn_of(model) -> Callable:
    """``(params, x [B, ...]) -> logits [B, K]`` in inference mode (running BN statistics, no dropout)."""
    if not needs_train_mode(model):
        return lambda params, x: model.apply({"params": params}, x)
    return lambda params, x: model.apply(variables_of(model, params), x, train=False)


def mc_apply_fn_of(model) -> Callable:
    """``(params, x, key) -> logits``: inference with dropout on (one MC-dropout sample per key)."""
    if not has_dropout(model):
        raise ValueError(f"{type(model).__name__} has no dropout; build it with dropout_rate > 0 for MC dropout")
    return lambda params, x, key: model.apply(variables_of(model, params), x, train=False, dropout=True,
                                              rngs={"dropout": key})


def train_apply_fn_of(model) -> Callable:
    """``(params, x [B, ...], mask [B], key) -> (logits [B, K], params)`` in training mode.

    BatchNorm normalises with the statistics of the real rows of the batch and
    the returned ``params`` carry the updated running statistics; dropout draws
    its masks from ``key``. For a model with neither, the logits are the
    inference logits and ``params`` is returned unchanged.
    """
    if not needs_train_mode(model):
        return lambda params, x, mask, key: (model.apply({"params": params}, x), params)

    def apply(params, x, mask, key):
        variables = variables_of(model, params)
        rngs = {"dropout": key} if has_dropout(model) else {}
        if not has_batch_stats(model):
            return model.apply(variables, x, train=True, mask=mask, rngs=rngs), params
        logits, updated = model.apply(variables, x, train=True, mask=mask, rngs=rngs, mutable=["batch_stats"])
        return logits, {**params, "batch_stats": updated["batch_stats"]}

    return apply


def mc_predict_proba(model, params, x, key, num_samples: int):
    """MC-dropout class probabilities ``[M, T, K]`` of inputs ``x [T, ...]`` (M = ``num_samples``)."""
    apply = mc_apply_fn_of(model)
    return jax.lax.map(lambda k: jax.nn.softmax(apply(params, x, k), -1), jax.random.split(key, num_samples))

