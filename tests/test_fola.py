"""FOLA's options beyond the engine tests (tests/test_algorithms.py): parameter compression (spec D21)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.algorithms.fola import prune_precision
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams


def test_parameter_compression_keeps_the_top_precisions_and_the_mean_of_the_rest():
    w = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1.0, 21.0)).reshape(4, 5), jnp.float32)
    pruned = prune_precision({"k": w, "b": jnp.asarray([3.0, 1.0, 2.0])}, 0.25)
    flat = np.asarray(pruned["k"]).ravel()
    original = np.asarray(w).ravel()
    # the authors' threshold: the int(0.25 * 20) = 5th largest (0-based), i.e. 15; 15..20 kept, 1..14 -> 7.5
    np.testing.assert_array_equal(flat[original >= 15], original[original >= 15])
    np.testing.assert_allclose(flat[original < 15], 7.5)
    assert flat.sum() == pytest.approx(original.sum())  # the tensor's total precision is kept
    np.testing.assert_allclose(pruned["b"], [3.0, 1.5, 1.5])  # int(0.25 * 3) = 0: only the largest kept
    with pytest.raises(ValueError, match="prune_p"):
        bf.algorithms.fola(bf.models.get_model("logistic", 10), prune_p=1.0)


def test_compressed_fola_clients_send_few_distinct_precisions(small_fed):
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    params = bf.models.init_params(model, small_fed.input_shape, jax.random.PRNGKey(0))
    config = RoundConfig(num_clients=small_fed.num_clients, clients_per_round=2)
    outs = {}
    for prune_p in (None, 0.1):
        algo = bf.algorithms.fola(model, lr=0.05, lam=10.0, batch_size=16, prune_p=prune_p)
        state, _ = make_round_step(algo, config)(init_state(algo, params, config), round_arrays(small_fed),
                                                 jax.random.PRNGKey(1), traced_hparams(algo, 1))
        outs[prune_p] = state.server
    kernel = outs[0.1]["precision"]["Dense_0"]["kernel"]  # [64, 16]: the product of two clients' compressed ones
    assert len(np.unique(np.asarray(kernel))) < 0.3 * kernel.size
    assert len(np.unique(np.asarray(outs[None]["precision"]["Dense_0"]["kernel"]))) > 0.6 * kernel.size
