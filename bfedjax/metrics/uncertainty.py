"""Uncertainty metrics of an MC-sampled predictive (Fischer et al. section 2.3).

Inputs are class probabilities of M Monte Carlo weight samples,
``probs [M, T, C]`` (T test points, C classes), or their mean ``p_bar [T, C]``
(Eq. 7) and integer labels ``y [T]``. All functions are jit-friendly.
"""
from __future__ import annotations

import jax.numpy as jnp

_TINY = 1e-12


def predictive(probs):
    """Eq. 7: the MC-averaged predictive ``[T, C]``."""
    return jnp.mean(probs, axis=0)


def accuracy(p_bar, y):
    return jnp.mean(jnp.argmax(p_bar, -1) == y)


def point_nll(p_bar, y):
    """``[T]``: -log p_bar[y] of each test point."""
    return -jnp.log(jnp.take_along_axis(p_bar, y[:, None].astype(jnp.int32), -1)[:, 0] + _TINY)


def nll(p_bar, y):
    """Mean over test points of -log p_bar[y] (of the MC-averaged predictive, not the mean per-sample NLL)."""
    return jnp.mean(point_nll(p_bar, y))


def mean_sample_nll(probs, y):
    """The spec's alternative NLL (D9): the mean over samples and test points of -log p_m[y], ``probs [M, T, C]``
    (at least ``nll`` of the averaged predictive, by Jensen's inequality)."""
    picked = jnp.take_along_axis(probs, jnp.broadcast_to(y[None, :, None], probs.shape[:2] + (1,)), -1)[..., 0]
    return -jnp.mean(jnp.log(picked + _TINY))


def brier(p_bar, y):
    """Mean over test points of sum_c (p_bar_c - onehot_c)^2."""
    onehot = jnp.eye(p_bar.shape[-1])[y]
    return jnp.mean(jnp.sum(jnp.square(p_bar - onehot), -1))


def calibration_bins(p_bar, y, num_bins: int = 15) -> dict:
    """The ``num_bins`` equal-width confidence bins of ECE and of a reliability diagram.

    A point of confidence ``c = max_k p_bar_k`` falls in bin ``ceil(c * B) - 1`` (clipped to
    ``0..B-1``), so bin ``b`` holds ``(b / B, (b + 1) / B]``. Returns ``count [B]`` (points per bin),
    ``confidence [B]`` and ``accuracy [B]`` (their mean confidence and accuracy; 0 for an empty bin).
    """
    conf = jnp.max(p_bar, -1)
    correct = (jnp.argmax(p_bar, -1) == y).astype(jnp.float32)
    bins = jnp.clip(jnp.ceil(conf * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1)
    count = jnp.zeros(num_bins).at[bins].add(1.0)
    conf_sum = jnp.zeros(num_bins).at[bins].add(conf)
    acc_sum = jnp.zeros(num_bins).at[bins].add(correct)
    safe = jnp.maximum(count, 1.0)
    return {"count": count, "confidence": conf_sum / safe, "accuracy": acc_sum / safe}


def expected_calibration_error(p_bar, y, num_bins: int = 15):
    """ECE with ``num_bins`` equal-width confidence bins (:func:`calibration_bins`):
    ``sum_b |B|/T * |acc(B) - conf(B)|``."""
    bins = calibration_bins(p_bar, y, num_bins)
    return jnp.sum(bins["count"] * jnp.abs(bins["accuracy"] - bins["confidence"])) / y.shape[0]


def normalised_entropy(p_bar):
    """Eq. 8: -sum_c p_bar_c log p_bar_c / log C, in [0, 1]; ``[T]``."""
    c = p_bar.shape[-1]
    return -jnp.sum(p_bar * jnp.log(p_bar + _TINY), -1) / jnp.log(c)


REDUCTIONS = ("trace", "predicted_class", "mean_diagonal")  # Eq. 9's matrix to one number per test point (D10)


def _reduced(diagonal, probs, reduce: str):
    """``[T]`` from Eq. 9's diagonal ``[T, C]``: its trace (default), its entry of the predicted class
    (argmax of the MC-averaged predictive) or the mean of the diagonal."""
    if reduce == "trace":
        return jnp.sum(diagonal, -1)
    if reduce == "mean_diagonal":
        return jnp.mean(diagonal, -1)
    if reduce == "predicted_class":
        predicted = jnp.argmax(predictive(probs), -1)
        return jnp.take_along_axis(diagonal, predicted[:, None], -1)[:, 0]
    raise ValueError(f"reduce={reduce!r}; choose one of {REDUCTIONS}")


def aleatoric(probs, reduce: str = "trace"):
    """Eq. 9's aleatoric part, diagonal mean_m p_mc (1 - p_mc), reduced by ``reduce`` (the trace
    sum_c ...); ``[T]``."""
    return _reduced(jnp.mean(probs * (1.0 - probs), axis=0), probs, reduce)


def epistemic(probs, reduce: str = "trace"):
    """Eq. 9's epistemic part, diagonal Var_m p_mc, reduced by ``reduce`` (the trace sum_c ...); ``[T]``."""
    return _reduced(jnp.var(probs, axis=0), probs, reduce)


def accuracy_vs_retained(p_bar, y, uncertainty, fractions=(0.5, 0.6, 0.7, 0.8, 0.9, 1.0)):
    """Accuracy on the ``f`` most certain fraction of the test set, for each ``f`` (Filos et al.).

    Returns ``[len(fractions)]``; a well-calibrated model's curve falls as ``f`` grows.
    """
    order = jnp.argsort(uncertainty)
    correct = (jnp.argmax(p_bar, -1) == y)[order].astype(jnp.float32)
    cumulative = jnp.cumsum(correct)
    t = y.shape[0]
    keep = [max(1, int(round(f * t))) for f in fractions]
    return jnp.stack([cumulative[k - 1] / k for k in keep])


RANKINGS = ("entropy", "aleatoric", "epistemic")  # what accuracy-vs-retained discards first (section 2.3)


def ranked_uncertainty(probs, ranking: str):
    """``[T]``: the uncertainty of ``probs [M, T, C]`` that ``ranking`` names: Eq. 8's normalised entropy of the
    averaged predictive, or the trace of Eq. 9's aleatoric or epistemic part (spec D10)."""
    if ranking == "entropy":
        return normalised_entropy(predictive(probs))
    if ranking == "aleatoric":
        return aleatoric(probs)
    if ranking == "epistemic":
        return epistemic(probs)
    raise ValueError(f"ranking={ranking!r}; choose one of {RANKINGS}")


def retention_curves(probs, y, fractions, rankings=RANKINGS) -> dict:
    """``{ranking: [F]}``: accuracy vs retained data of ``probs [M, T, C]`` with the most uncertain points
    discarded first by each of ``rankings`` (Filos et al., as Fischer et al. section 2.3 ranks them)."""
    p_bar = predictive(probs)
    return {r: accuracy_vs_retained(p_bar, y, ranked_uncertainty(probs, r), fractions) for r in rankings}


SUMMARY_METRICS = ("accuracy", "nll", "ece", "brier", "entropy", "aleatoric", "epistemic")  # summary's keys, in order


def summary(probs, y, num_bins: int = 15) -> dict:
    """All scalar metrics of an MC predictive ``probs [M, T, C]`` (the keys of ``SUMMARY_METRICS``)."""
    p_bar = predictive(probs)
    return {"accuracy": accuracy(p_bar, y), "nll": nll(p_bar, y), "ece": expected_calibration_error(p_bar, y, num_bins),
            "brier": brier(p_bar, y), "entropy": jnp.mean(normalised_entropy(p_bar)),
            "aleatoric": jnp.mean(aleatoric(probs)), "epistemic": jnp.mean(epistemic(probs))}
