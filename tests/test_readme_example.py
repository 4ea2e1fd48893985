"""The README's own algorithm (FedAvg with server momentum) runs vmapped, chunked and as the reference says."""
import chex
import jax
import numpy as np

import bfedjax as bf
from readme_example import run_readme_code


def test_readme_algorithm_learns_and_chunking_changes_nothing():
    ns = run_readme_code()
    result, algo, fed = ns["result"], ns["algo"], ns["fed"]
    assert len(result.metrics["global_accuracy"]) == 5
    assert result.metrics["global_accuracy"][-1] > 0.6  # digits, 10 clients: it learns
    run = lambda **kw: bf.simulate(algo, fed, rounds=2, key=jax.random.PRNGKey(1), **kw)
    vmapped, chunked, sequential = run(clients_per_chunk=None), run(clients_per_chunk=3), run(backend="sequential")
    chex.assert_trees_all_close(chunked.state, vmapped.state, rtol=2e-5, atol=2e-6)
    chex.assert_trees_all_close(sequential.state, vmapped.state, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(chunked.metrics["global_accuracy"], vmapped.metrics["global_accuracy"], atol=1e-6)
    # momentum: the server moves by beta * velocity + the mean update, so it is not FedAvg after round 2
    velocity = vmapped.state.server["velocity"]
    assert float(sum(np.abs(v).sum() for v in jax.tree.leaves(velocity))) > 0
