"""Tasks: what a model learns and how it is scored, kept apart from the federated algorithm.

A ``Task`` bundles a model with its loss, its metrics (the engine's evaluate
hook), its final predictive and its initialisation. Algorithms take their
hooks from a task (``Algorithm(..., **task.hooks())``), so the engine never
imports a model or a metric and a new task (regression, segmentation) plugs
in without touching ``bfedjax.core``.
"""
from __future__ import annotations

import math

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.losses import masked_mean_cross_entropy
from bfedjax.metrics.classification import evaluate as classification_metrics
from bfedjax.metrics.classification import (EVAL_BATCH_SIZE, MC_EVAL_SAMPLES, MC_EVAL_SEED, map_real_batches,
                                             padded_batches, predictive_evaluate)
from bfedjax.models.apply import apply_fn_of, has_dropout, mc_predict_proba


class Task(NamedTuple):
    """A model and everything about it that is not the federated algorithm's maths.

    Attributes:
      model: the Flax module.
      apply_fn: ``(params, x [B, ...]) -> outputs [B, ...]`` in inference mode.
      loss: ``(params, Batch) -> scalar``, the masked mean training loss in inference mode
        (models with BatchNorm or dropout train through ``algorithms.local_sgd``, which
        runs them in training mode).
      evaluate: ``(params, x [T, ...], y [T, ...], mask [T] = None) -> {name: scalar}``, the engine's
        evaluate hook.
      predict: ``(params, x [T, ...], key, num_samples) -> probs [M, T, K]``, the final predictive.
      init_params: ``(key, input_shape) -> params``.
    """

    model: Any
    apply_fn: Callable
    loss: Callable
    evaluate: Callable
    predict: Callable
    init_params: Callable

    def hooks(self, global_params: Callable | None = None) -> dict:
        """The ``Algorithm`` keyword arguments ``evaluate``, ``predict`` and ``init_params`` of this task.

        ``predict`` scores ``global_params(server)`` (default ``server["params"]``).
        """
        params_of = global_params or (lambda server: server["params"])
        predict = self.predict
        return {"evaluate": self.evaluate, "init_params": self.init_params,
                "predict": lambda server, x, key, num_samples: predict(params_of(server), x, key, num_samples)}


def in_batches(fn: Callable, x: jax.Array, batch_size: int) -> jax.Array:
    """``fn(x_batch) -> [M, b, ...]`` applied to ``x [T, ...]`` in batches of ``batch_size``; returns ``[M, T, ...]``
    (``...`` is ``K`` class probabilities, or ``H, W`` pixel probabilities)."""
    xb, _, _ = padded_batches(x, jnp.zeros(x.shape[0], jnp.int32), batch_size)
    out = jnp.moveaxis(jax.lax.map(fn, xb), 0, 1)  # [M, nb, b, ...]
    return out.reshape((out.shape[0], -1) + out.shape[3:])[:, : x.shape[0]]


PREDICT_BATCH_SIZE = 500  # test examples per predictive batch (M samples of each are held at once)


def classification(model, *, eval_batch_size: int = EVAL_BATCH_SIZE, predict_batch_size: int = PREDICT_BATCH_SIZE,
                   eval_samples: int = MC_EVAL_SAMPLES) -> Task:
    """A classifier producing logits ``[B, K]`` from integer labels ``y [B]``.

    evaluate: top-1 ``accuracy`` and mean cross-entropy ``loss`` of the test set, in
    batches of ``eval_batch_size``. For a model with dropout (MC dropout, kept on at test time: Fischer et al.
    spec D20) they are the accuracy and NLL of its ``eval_samples``-pass MC predictive
    (``metrics.classification.predictive_evaluate``; ``eval_samples=0``: one pass with dropout off).
    predict: the softmax (``M = 1``), or ``num_samples`` MC-dropout passes for a model with dropout, in
    batches of ``predict_batch_size``.
    """
    if eval_samples < 0:
        raise ValueError(f"eval_samples={eval_samples} must be >= 0 (0: dropout off; spec D9: {MC_EVAL_SAMPLES})")
    apply_fn = apply_fn_of(model)

    def loss(params, batch):
        return masked_mean_cross_entropy(apply_fn, params, batch)

    def evaluate(params, x, y, mask=None):
        if has_dropout(model) and eval_samples:
            return predictive_evaluate(
                lambda xb: mc_predict_proba(model, params, xb, jax.random.PRNGKey(MC_EVAL_SEED), eval_samples), x, y,
                eval_batch_size, mask)
        return classification_metrics(apply_fn, params, x, y, eval_batch_size, mask)

    def predict(params, x, key, num_samples: int):
        if has_dropout(model):
            one = lambda xb: mc_predict_proba(model, params, xb, key, num_samples)
        else:
            one = lambda xb: jax.nn.softmax(apply_fn(params, xb), -1)[None]
        return in_batches(one, x, predict_batch_size)

    def init_params(key, input_shape):
        from bfedjax.models.zoo import init_params as zoo_init
        return zoo_init(model, tuple(input_shape), key)

    return Task(model, apply_fn, loss, evaluate, predict, init_params)


SEGMENTATION_EVAL_BATCH_SIZE = 50  # test images per evaluation batch (HD95's distance transforms are per image)
SEGMENTATION_EVAL_VOXELS = 2 ** 22  # and at most this many pixels (voxels) per batch, so whole volumes go few at a time


def _segmentation_batch(x, eval_batch_size: int) -> int:
    """Samples per evaluation batch: ``eval_batch_size``, fewer where that would exceed ``SEGMENTATION_EVAL_VOXELS``."""
    voxels = math.prod(x.shape[1:-1])
    return max(1, min(eval_batch_size, SEGMENTATION_EVAL_VOXELS // max(voxels, 1)))


def segmentation(model, *, loss: str = "ce_dice", regions: tuple = (),
                 eval_batch_size: int = SEGMENTATION_EVAL_BATCH_SIZE) -> Task:
    """Segmentation of images ``[H, W]`` (or volumes ``[D, H, W]``, ``models.UNet3D``) into classes.

    The model gives one foreground logit per pixel, ``[B, H, W]``, for binary masks ``y [B, H, W]``
    in {0, 1}, or one logit per class, ``[B, H, W, C]``, for label maps in ``{0, ..., C-1}`` and, with
    a two-channel head, for binary masks (``models.get_model("unet", num_classes)`` builds either from
    the data set's ``num_classes``; ``segmentation_head="softmax"`` the two-channel head for binary masks).

    loss: ``metrics.segmentation.LOSSES[loss]`` over the batch's real images: ``"ce_dice"``
      (cross-entropy + soft Dice of the foreground classes, per image), or the FedRef authors'
      ``"focal"`` (DRIVE) and ``"dice_focal"`` (FeTS), segmentation_models_pytorch's losses as
      they configure them.
    evaluate: over the test set, the mean per-image ``dice``, ``iou``, ``hd95`` (95th-percentile
      symmetric Hausdorff distance in pixels; each the mean over the foreground classes, with
      ``dice_class{c}`` per class when there are more than two), ``pixel_accuracy`` and ``loss`` of
      the hard prediction (``logit > 0``, or the argmax), ``dice_<name>`` and ``hd95_<name>`` for each of ``regions``
      (``((name, classes), ...)``, unions of classes such as ``metrics.segmentation.FETS_REGIONS``,
      BraTS's whole tumour, tumour core and enhancing tumour; names distinct identifiers, not ``class<c>``,
      checked by ``metrics.segmentation.checked_regions``), plus the FedRef authors' ``authors_dice``,
      ``authors_iou`` (soft, batch-pooled, after a sigmoid and a softmax) and ``authors_hd95``
      (their row-wise distance, not a Hausdorff distance), computed the way their code does
      (``metrics.segmentation``).

    predict: the foreground probability ``sigmoid(logit)``, ``[1, T, H, W]``, or the class
    probabilities ``softmax(logits)``, ``[1, T, H, W, C]``.
    """
    from bfedjax.metrics import segmentation as seg
    apply_fn = apply_fn_of(model)
    loss_fn = seg.loss_fn(loss)
    regions = seg.checked_regions(regions)

    def train_loss(params, batch):
        return loss_fn(apply_fn(params, batch.x), batch.y, batch.mask)

    def evaluate(params, x, y, mask=None):
        size = _segmentation_batch(x, eval_batch_size)
        xb, yb, mb = padded_batches(x, y, size)
        if mask is not None:
            mb = mb * padded_batches(jnp.zeros(y.shape[:1]), jnp.asarray(mask, jnp.float32), size)[1]
        sums = map_real_batches(lambda b: seg.evaluate_batch(apply_fn(params, b[0]), b[1], b[2], loss=loss,
                                                                regions=regions),
                                (xb, yb, mb), mb)
        scores = seg.summarize(jax.tree.map(lambda v: jnp.sum(v, axis=0), sums))
        return {name: value for name, value in scores.items() if name != "count"}

    def predict(params, x, key, num_samples: int):
        del key, num_samples

        def probabilities(xb):
            logits = apply_fn(params, xb)
            one_logit = logits.ndim == xb.ndim - 1  # [B, *S] against inputs [B, *S, channels]
            return (jax.nn.sigmoid(logits) if one_logit else jax.nn.softmax(logits, axis=-1))[None]

        return in_batches(probabilities, x, _segmentation_batch(x, eval_batch_size))

    def init_params(key, input_shape):
        from bfedjax.models.zoo import init_params as zoo_init
        return zoo_init(model, tuple(input_shape), key)

    return Task(model, apply_fn, train_loss, evaluate, predict, init_params)


TASKS = {"classification": classification, "segmentation": segmentation}

__all__ = ["EVAL_BATCH_SIZE", "PREDICT_BATCH_SIZE", "TASKS", "Task", "classification", "in_batches", "segmentation"]
