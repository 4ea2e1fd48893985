"""FOLA Sec. IV-E's analysis: the distance to a known posterior (``posteriors.distance``), the AE / LF layer and
the pi_1 sweep (``algorithms.posterior_analysis``), and a FOLA run's global posterior
(``algorithms.reference_posterior``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import bfedjax as bf
from bfedjax.algorithms import reference_posterior
from bfedjax.algorithms.posterior_analysis import swept_aggregate, sweep_metric
from bfedjax.core.simulate import traced_hparams
from bfedjax.posteriors import DensePrecision
from bfedjax.posteriors.distance import ReferencePosterior, posterior_distance


def test_distance_is_half_the_precision_weighted_square(logistic):
    """D = 1/2 delta^T Lambda delta in ravel_pytree's order, for a full and a diagonal precision; 0 at the mean."""
    _, params = logistic
    theta, unravel = ravel_pytree(params)
    d = theta.size
    rng = np.random.default_rng(0)
    mean = rng.normal(size=d).astype(np.float32)
    root = rng.normal(size=(d, 8)).astype(np.float32)
    dense = root @ root.T + np.eye(d, dtype=np.float32)
    delta = np.asarray(theta, np.float64) - mean
    full = ReferencePosterior(unravel(jnp.asarray(mean)), DensePrecision(jnp.asarray(dense)))
    np.testing.assert_allclose(float(posterior_distance(params, full)), 0.5 * delta @ dense.astype(np.float64) @ delta,
                               rtol=1e-4)
    diagonal = ReferencePosterior(unravel(jnp.asarray(mean)), unravel(jnp.asarray(np.diag(dense))))
    np.testing.assert_allclose(float(posterior_distance(params, diagonal)),
                               0.5 * np.sum(np.diag(dense) * delta ** 2), rtol=1e-4)
    assert float(posterior_distance(unravel(jnp.asarray(mean)), full)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="fix: a reference of the same model"):
        posterior_distance({"other": params}, full)
    with pytest.raises(ValueError, match="neither a pytree like the parameters"):
        posterior_distance(params, ReferencePosterior(params, jnp.asarray(dense)))


def _two_messages(params, key):
    """Two perturbed copies of ``params`` stacked as a cohort's ``{"params": [2, ...]}``."""
    keys = jax.random.split(key, 2)
    return {"params": jax.tree.map(lambda p: jnp.stack([p + 0.3 * jax.random.normal(k, p.shape) for k in keys]),
                                   params)}


def test_posterior_distance_layer_reports_ae_and_weighted_lf(logistic):
    """AE is D of the aggregate the algorithm passes on (unchanged by the layer); LF the weight-averaged D of the
    counted clients' models (a padding slot, mask 0, left out; a real client weighing 0 too)."""
    model, params = logistic
    algo = bf.algorithms.fedavg(model, batch_size=16)
    theta, unravel = ravel_pytree(params)
    reference = ReferencePosterior(unravel(theta + 0.1), unravel(jnp.linspace(0.5, 2.0, theta.size)))
    layered = bf.algorithms.with_posterior_distance(algo, reference)
    messages = _two_messages(params, jax.random.PRNGKey(0))
    three = jax.tree.map(lambda m: jnp.concatenate([m, m[:1] + 5.0]), messages)  # a third, padding slot
    weights, mask = jnp.array([0.7, 0.3, 0.0]), jnp.array([1.0, 1.0, 0.0])
    server = algo.server_init(params)
    hparams = traced_hparams(algo, 1)
    new, metrics = layered.server_update(server, three, weights, mask, hparams, jax.random.PRNGKey(1))
    plain, _ = algo.aggregate(server, three, weights, mask, hparams, jax.random.PRNGKey(1))
    jax.tree.map(np.testing.assert_array_equal, new, plain)
    local = [float(posterior_distance(jax.tree.map(lambda m: m[i], three["params"]), reference)) for i in range(2)]
    np.testing.assert_allclose(float(metrics["local_forgetting"]), 0.7 * local[0] + 0.3 * local[1], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["aggregation_error"]),
                               float(posterior_distance(plain["params"], reference)), rtol=1e-6)
    assert float(metrics["aggregation_error"]) < min(local)  # the mean of two models straddling theta* is nearer
    _, dropped = layered.server_update(server, three, jnp.array([1.0, 0.0, 0.0]), mask, hparams, jax.random.PRNGKey(1))
    np.testing.assert_allclose(float(dropped["local_forgetting"]), local[0], rtol=1e-5)
    with pytest.raises(ValueError, match="message 'params'"):
        layered.server_update(server, {"delta": three["params"]}, weights, mask, hparams, jax.random.PRNGKey(1))


def test_sweep_applies_the_rule_at_each_weight(logistic, halves):
    """The swept aggregate is FedAvg's pi mu_1 + (1 - pi) mu_2 and FOLA's ridge point (pi Lambda_1 mu_1 +
    (1 - pi) Lambda_2 mu_2) / (pi Lambda_1 + (1 - pi) Lambda_2); the layer scores each on the sweep's rounds
    and reports NaN on the others."""
    model, params = logistic
    messages = _two_messages(params, jax.random.PRNGKey(0))
    mask = jnp.ones(2)
    fedavg = bf.algorithms.fedavg(model, batch_size=16)
    hparams = traced_hparams(fedavg, 1)
    for pi in (0.0, 0.3, 1.0):
        swept = swept_aggregate(fedavg, fedavg.server_init(params), messages, jnp.float32(pi), mask, hparams, None)
        want = jax.tree.map(lambda m: pi * m[0] + (1 - pi) * m[1], messages["params"])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), swept["params"], want)
    fola = bf.algorithms.fola(model, lam=1.0, eps=1e-5, precision_diagnostics=False)
    precisions = jax.tree.map(lambda m: jnp.stack([jnp.full(m.shape[1:], 4.0), jnp.full(m.shape[1:], 1.0)]),
                              messages["params"])
    gaussian = {"params": messages["params"], "precision": precisions}
    fola_hparams = {**traced_hparams(fola, 1), "cohort_weight": jnp.float32(1.0)}
    swept = swept_aggregate(fola, fola.server_init(params), gaussian, jnp.float32(0.3), mask, fola_hparams, None)
    ridge = jax.tree.map(lambda m: (0.3 * 4.0 * m[0] + 0.7 * m[1]) / (0.3 * 4.0 + 0.7 + 1e-5), messages["params"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), swept["params"], ridge)

    pis = [0.0, 0.3, 1.0]
    layered = bf.algorithms.with_aggregation_sweep(fedavg, pis, halves.x_test, halves.y_test, rounds=[2])
    server = fedavg.server_init(params)
    weights = jnp.array([0.5, 0.5])
    _, off_round = layered.server_update(server, messages, weights, mask, hparams, None)
    assert all(np.isnan(float(off_round[sweep_metric(p)])) for p in pis)
    _, on_round = layered.server_update(server, messages, weights, mask, traced_hparams(fedavg, 2), None)
    scores = []
    for pi in pis:
        mixed = jax.tree.map(lambda m: pi * m[0] + (1 - pi) * m[1], messages["params"])
        scores.append(float(fedavg.evaluate(mixed, halves.x_test, halves.y_test)["accuracy"]))
        assert float(on_round[sweep_metric(pi)]) == pytest.approx(scores[-1], abs=1e-6)
    assert len(set(scores)) == 3  # the three aggregates score apart: a swapped or ignored weight would show
    with pytest.raises(ValueError, match="two clients"):
        layered.server_update(server, jax.tree.map(lambda m: jnp.concatenate([m, m[:1]]), messages),
                              jnp.ones(3) / 3, jnp.ones(3), traced_hparams(fedavg, 2), None)
    with pytest.raises(ValueError, match="fix: aggregate through the engine"):
        layered.server_update(server, messages, weights, mask, {"lr": 0.1}, None)


def test_sweep_at_the_runs_weight_is_its_ga_and_fola_beats_the_line(logistic, halves):
    """In a run, the sweep at the run's own pi_1 is the round's GA; with disjoint class halves FOLA's product at an
    even weighting scores above the endpoints' mean, where FedAvg's average of the same round-1 models does not
    have to (the paper's Fig. 10b: the ridge against the valley)."""
    model, _ = logistic
    pis = [0.0, 0.51, 1.0]
    results = {}
    for name, algo in {"fedavg": bf.algorithms.fedavg(model, lr=0.05, batch_size=50),
                       "fola": bf.algorithms.fola(model, lr=0.05, lam=1.0, batch_size=50, profile="paper",
                                                  eps=1e-5)}.items():
        layered = bf.algorithms.with_aggregation_sweep(algo, pis, halves.x_test, halves.y_test, rounds=[1, 2])
        results[name] = bf.simulate(layered, halves, rounds=2, key=jax.random.PRNGKey(0),
                                    client_weights=[0.51, 0.49]).metrics
    for metrics in results.values():
        np.testing.assert_allclose(metrics[sweep_metric(0.51)], metrics["global_accuracy"], atol=1e-6)
    fola, fedavg = results["fola"], results["fedavg"]
    for end in (0.0, 1.0):  # round 1 starts from the same model with the same keys: the same local models
        assert fola[sweep_metric(end)][0] == pytest.approx(fedavg[sweep_metric(end)][0], abs=1e-6)
    assert fola[sweep_metric(0.51)][0] > fedavg[sweep_metric(0.51)][0] + 0.05


def test_reference_posterior_is_the_global_precision(logistic):
    """The running sum (default profile) is r Lambda_S after r rounds; the paper's running average and the
    offline diagonal Fisher sent alone are Lambda_S; a full Laplace's matrix becomes a DensePrecision, divided
    by r under the running sum only."""
    _, params = logistic
    d = ravel_pytree(params)[0].size
    server = {"params": params, "precision": jax.tree.map(lambda p: jnp.full(p.shape, 6.0), params)}
    summed = reference_posterior(server, 3)
    assert all(np.allclose(p, 2.0) for p in jax.tree.leaves(summed.precision))
    jax.tree.map(np.testing.assert_array_equal, summed.mean, params)
    for options in ({"profile": "paper"}, {"fisher": "offline"}):
        assert all(np.allclose(p, 6.0) for p in jax.tree.leaves(reference_posterior(server, 3, **options).precision))
    dense = {"params": params, "precision": 4.0 * jnp.eye(d)}
    full = reference_posterior(dense, 2, laplace="full", eps=1e-5)
    assert isinstance(full.precision, DensePrecision)
    assert float(full.precision.times(jnp.ones(d))[0]) == pytest.approx(2.0)
    paper_full = reference_posterior(dense, 2, "paper", laplace="full", eps=1e-5)
    assert float(paper_full.precision.times(jnp.ones(d))[0]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="unknown FOLA options"):
        reference_posterior(server, 3, lamda=1.0)
