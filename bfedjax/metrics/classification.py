"""Classification metrics computed inside jit, in fixed-size test batches."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bfedjax.losses import cross_entropy
from bfedjax.metrics.uncertainty import point_nll

# Test examples per evaluation batch. Smaller batches stay in the CPU's caches (CNN2 on the 10,000
# Fashion-MNIST test images, 2 cores: 0.62 s in batches of 250, 0.95 s in batches of 1,000;
# `python -m experiments.bench_conv`) and leave less padding to score in a small client's test split.
EVAL_BATCH_SIZE = 250
# Per-round scores of a predictive (a posterior's, MC dropout's): M samples (Fischer et al. spec D9), all drawn from
# one key, so rounds and clients are compared on common random numbers.
MC_EVAL_SAMPLES = 50
MC_EVAL_SEED = 0


def padded_batches(x, y, batch_size: int):
    """Reshapes ``x [T, ...]``, ``y [T, ...]`` to ``[nb, b, ...]`` plus a ``[nb, b]`` mask."""
    t = y.shape[0]
    b = min(batch_size, t)
    nb = math.ceil(t / b)
    pad = nb * b - t
    xp = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
    yp = jnp.concatenate([y, jnp.zeros((pad,) + y.shape[1:], y.dtype)]) if pad else y
    mask = (jnp.arange(nb * b) < t).astype(jnp.float32)
    return xp.reshape((nb, b) + x.shape[1:]), yp.reshape((nb, b) + y.shape[1:]), mask.reshape(nb, b)


def map_real_batches(score, batches, masks):
    """``score(batch)`` on each ``batches[i]`` that holds a real example (``masks [nb, b]``), zeros elsewhere.

    Per-client test splits are padded to the largest client's; a batch that is all padding is
    skipped with ``lax.cond``, so a client holding 200 of 2,400 padded rows scores one batch,
    not all. (Under a client vmap both branches run: the saving is for clients in turn, the CPU
    layout for convolutional models.) Returns ``score``'s outputs stacked ``[nb, ...]``.
    """
    def one(batch_and_mask):
        batch, mask = batch_and_mask
        zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(score, batch))
        return jax.lax.cond(jnp.any(mask > 0), lambda _: score(batch), zeros, None)

    return jax.lax.map(one, (batches, masks))


def _batched_scores(per_example, x, y, batch_size: int, mask) -> dict:
    """``{"accuracy", "loss"}`` from ``per_example(x_batch, y_batch) -> (correct [b], loss [b])``, summed over the
    real examples of ``x [T, ...]``, ``y [T]`` (``mask [T]``, optional) in batches of ``batch_size``."""
    xb, yb, mb = padded_batches(x, y, batch_size)
    if mask is not None:
        mb = mb * padded_batches(jnp.zeros_like(y), jnp.asarray(mask, jnp.float32), batch_size)[1]

    def one(args):
        xi, yi, mi = args
        correct, loss = per_example(xi, yi)
        return jnp.sum(correct * mi), jnp.sum(loss * mi)

    correct, loss = map_real_batches(one, (xb, yb, mb), mb)
    t = y.shape[0] if mask is None else jnp.maximum(jnp.sum(mask), 1.0)
    return {"accuracy": jnp.sum(correct) / t, "loss": jnp.sum(loss) / t}


def evaluate(apply_fn, params, x, y, batch_size: int = EVAL_BATCH_SIZE, mask=None) -> dict:
    """``{"accuracy", "loss"}``: top-1 accuracy and mean cross-entropy of ``params`` on ``x [T, ...]``, ``y [T]``.

    ``mask [T]`` (optional, 1 real / 0 padding) restricts both to the real examples
    (a padded per-client test split); with no real example both are 0.
    """
    def per_example(xi, yi):
        logits = apply_fn(params, xi)
        return jnp.argmax(logits, -1) == yi, cross_entropy(logits, yi)

    return _batched_scores(per_example, x, y, batch_size, mask)


def predictive_evaluate(probs_fn, x, y, batch_size: int = EVAL_BATCH_SIZE, mask=None) -> dict:
    """``{"accuracy", "loss"}`` of an MC predictive on ``x [T, ...]``, ``y [T]`` (``mask`` as ``evaluate``'s).

    ``probs_fn(x_batch [b, ...]) -> [M, b, K]``: class probabilities of M Monte Carlo samples (the same M weight
    samples for every batch). Accuracy is the argmax of the averaged predictive p_bar = mean_m p_m (Fischer et
    al. Eq. 7); the loss is the NLL -log p_bar[y] (spec D9), not the mean of the M samples' cross-entropies.
    """
    def per_example(xi, yi):
        p_bar = jnp.mean(probs_fn(xi), axis=0)
        return jnp.argmax(p_bar, -1) == yi, point_nll(p_bar, yi)

    return _batched_scores(per_example, x, y, batch_size, mask)


def accuracy(logits, labels):
    """Top-1 accuracy of ``logits [T, K]`` against ``labels [T]``."""
    return jnp.mean(jnp.argmax(logits, -1) == labels)
