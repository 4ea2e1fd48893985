"""Uncertainty metrics (Fischer spec section 8, item 18) and calibration helpers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax

from bfedjax.metrics import uncertainty as U


def _probs(m=8, t=50, c=10, seed=0):
    logits = jax.random.normal(jax.random.PRNGKey(seed), (m, t, c)) * 2.0
    return jax.nn.softmax(logits, -1), jax.random.randint(jax.random.PRNGKey(seed + 1), (t,), 0, c)


def test_eq9_decomposition_sums_to_total():
    probs, _ = _probs()
    p_bar = U.predictive(probs)
    np.testing.assert_allclose(U.aleatoric(probs) + U.epistemic(probs), jnp.sum(p_bar * (1 - p_bar), -1), rtol=1e-5)
    np.testing.assert_allclose(U.epistemic(probs[:1]), 0.0, atol=1e-7)


def test_entropy_extremes_and_nll_is_cross_entropy_at_m1():
    np.testing.assert_allclose(U.normalised_entropy(jnp.full((1, 10), 0.1)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(U.normalised_entropy(jnp.eye(10)[:1]), 0.0, atol=1e-6)
    logits = jax.random.normal(jax.random.PRNGKey(3), (40, 10))
    y = jnp.arange(40) % 10
    np.testing.assert_allclose(U.nll(jax.nn.softmax(logits)[None][0], y),
                               optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), rtol=1e-5)


def test_ece_brier_and_retention():
    # Perfect one-hot correct predictions: ECE 0, Brier 0, accuracy 1.
    y = jnp.arange(30) % 10
    perfect = jnp.eye(10)[y]
    assert float(U.expected_calibration_error(perfect, y)) < 1e-6 and float(U.brier(perfect, y)) < 1e-12
    # Confidence 0.91 everywhere but only half right: ECE = 0.41.
    wrong = (y + 1) % 10
    p = jnp.where(jnp.arange(30)[:, None] % 2 == 0, 0.9 * jnp.eye(10)[y] + 0.01, 0.9 * jnp.eye(10)[wrong] + 0.01)
    np.testing.assert_allclose(U.expected_calibration_error(p, y), 0.41, atol=1e-5)
    # If uncertainty is high exactly on the errors, retaining fewer points raises accuracy.
    unc = jnp.where(jnp.argmax(p, -1) == y, 0.1, 0.9)
    curve = U.accuracy_vs_retained(p, y, unc, fractions=(0.5, 1.0))
    np.testing.assert_allclose(curve, [1.0, 0.5], atol=1e-6)
    s = U.summary(_probs()[0], _probs()[1])
    assert set(s) == {"accuracy", "nll", "ece", "brier", "entropy", "aleatoric", "epistemic"}


def test_retention_curves_discard_by_entropy_aleatoric_or_epistemic_uncertainty():
    """Four points, M = 2, two classes, each ranking keeping a different first point:
    A: 50/50 twice (aleatoric only, wrong); B: sure of each class once (epistemic only, right);
    C: 0.85 / 0.95 (least entropy, right); D: 0.7 / 0.9 for the wrong class."""
    probs = jnp.asarray([[[.5, .5], [1., 0.], [.85, .15], [.7, .3]],
                         [[.5, .5], [0., 1.], [.95, .05], [.9, .1]]])
    y = jnp.asarray([1, 0, 0, 1])
    curves = U.retention_curves(probs, y, (0.25, 0.5, 1.0))
    np.testing.assert_allclose(curves["entropy"], [1.0, 0.5, 0.5])  # keeps C, then D
    np.testing.assert_allclose(curves["aleatoric"], [1.0, 1.0, 0.5])  # keeps B, then C
    np.testing.assert_allclose(curves["epistemic"], [0.0, 0.5, 0.5])  # keeps A, then C
    with pytest.raises(ValueError, match="choose one of"):
        U.ranked_uncertainty(probs, "variance")


def test_eq9_reductions_and_the_per_sample_nll():
    probs, y = _probs(m=6, t=20, c=5, seed=4)
    p_bar = U.predictive(probs)
    diag_a = np.mean(np.asarray(probs) * (1 - np.asarray(probs)), axis=0)  # [T, C]
    diag_e = np.var(np.asarray(probs), axis=0)
    predicted = np.argmax(np.asarray(p_bar), -1)
    for fn, diag in ((U.aleatoric, diag_a), (U.epistemic, diag_e)):
        np.testing.assert_allclose(fn(probs), diag.sum(-1), rtol=1e-5)
        np.testing.assert_allclose(fn(probs, reduce="mean_diagonal"), diag.mean(-1), rtol=1e-5)
        np.testing.assert_allclose(fn(probs, reduce="predicted_class"), diag[np.arange(20), predicted], rtol=1e-5)
    with np.testing.assert_raises(ValueError):
        U.aleatoric(probs, reduce="max")
    per_sample = -np.mean(np.log(np.asarray(probs)[:, np.arange(20), np.asarray(y)]))
    np.testing.assert_allclose(U.mean_sample_nll(probs, y), per_sample, rtol=1e-5)
    assert float(U.mean_sample_nll(probs, y)) > float(U.nll(p_bar, y))  # Jensen: averaging first lowers the NLL
    np.testing.assert_allclose(U.mean_sample_nll(probs[:1], y), U.nll(probs[0], y), rtol=1e-6)  # M = 1: equal
