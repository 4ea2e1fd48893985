"""Mean-field VI clients on NumPyro and the Fischer et al. algorithm in the round engine."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.metrics import uncertainty
from bfedjax.vi import MeanFieldVI


@pytest.fixture(scope="module")
def vi_model():
    return bf.models.get_model("mlp", 10, hidden=(8,))


def test_posterior_svi_param_round_trip(vi_model):
    vi = MeanFieldVI(vi_model, (8, 8, 1))
    assert vi.variational == {"Dense_0.kernel", "Dense_1.kernel"}
    post = vi.init_posterior(jax.random.PRNGKey(0))
    chex.assert_trees_all_close(vi.posterior(vi.svi_params(post)), post)
    biases = MeanFieldVI(vi_model, (8, 8, 1), bf.vi.MeanFieldConfig(variational_biases=True))
    assert "Dense_0.bias" in biases.variational
    probs = vi.predict_proba(post, jnp.zeros((5, 8, 8, 1)), jax.random.PRNGKey(1), num_samples=3)
    assert probs.shape == (3, 5, 10)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("rule,weighting", [("wc", "by_size"), ("lp", "max_discrepancy")])
def test_variational_round_vmap_matches_sequential(rule, weighting, small_fed, vi_model):
    algo = bf.algorithms.bfl(vi_model, small_fed.input_shape, rule=rule, weighting=weighting, lr=1e-2,
                             batch_size=16)
    params = vi_model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    config = RoundConfig(num_clients=5, clients_per_round=3, clients_per_chunk=2)
    out = {}
    for backend in ("vmap", "sequential"):
        state = init_state(algo, params, config)
        out[backend] = make_round_step(algo, config, backend)(state, round_arrays(small_fed), jax.random.PRNGKey(2),
                                                              traced_hparams(algo, 1))
    chex.assert_trees_all_close(out["vmap"], out["sequential"], rtol=2e-4, atol=2e-6)


def test_bfl_learns_and_reports_posterior_scale(digits, vi_model):
    fed = bf.data.from_partition(digits, bf.data.partition(digits.y_train, "iid", 4, seed=0))
    runs = {rule: bf.simulate(bf.algorithms.bfl(vi_model, fed.input_shape, rule=rule, lr=1e-2, batch_size=32),
                              fed, rounds=2, key=jax.random.PRNGKey(0), evaluate_local=False)
            for rule in ("nwa", "conflation")}
    for res in runs.values():
        assert res.metrics["global_accuracy"][-1] > 0.3
    # Conflation divides the variance by about K per round; NWA keeps it.
    assert runs["conflation"].metrics["mean_posterior_scale"][-1] < 0.5 * runs["nwa"].metrics["mean_posterior_scale"][-1]
    vi = MeanFieldVI(vi_model, fed.input_shape)
    probs = vi.predict_proba(runs["nwa"].state.server, jnp.asarray(fed.x_test), jax.random.PRNGKey(0), num_samples=4)
    summary = uncertainty.summary(probs, jnp.asarray(fed.y_test))
    assert 0 < float(summary["nll"]) < 5 and 0 <= float(summary["ece"]) <= 1


def test_bad_rule_and_weighting(vi_model):
    with pytest.raises(ValueError, match="rule"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), rule="median")
    with pytest.raises(ValueError, match="weighting"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), weighting="loss")
