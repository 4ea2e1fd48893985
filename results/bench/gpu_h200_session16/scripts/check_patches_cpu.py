"""The patched trees of ``next_call.sh`` on the CPU, two rounds of an MLP federation (K = 4) in the tree on PYTHONPATH:

``factored``        (a tree with ``factored_dense_update.patch``) FedAvg with the factored dense update forced onto
                    the CPU against the plain step: prints the largest difference and the largest change;
``flatten OUT``     BFL's server state after the rounds, raveled, saved to ``OUT`` (.npy), to compare a tree with
                    ``optax_flatten.patch`` against HEAD's."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import bfedjax as bf
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from experiments.bench_round import SHAPES, federation


def two_rounds(name, **options):
    """``(server leaves after two rounds, initial parameter leaves)`` of ``name`` on the MLP, K = 4, B = 10."""
    fed = federation(4, SHAPES["mlp"])
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    algo = bf.algorithms.build(name, model, fed, batch_size=10, **options).replace(evaluate=None)
    arrays = round_arrays(fed)
    cfg = RoundConfig(4, 4, evaluate_local=False)
    params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = init_state(algo, params, cfg)
    step = make_round_step(algo, cfg, "vmap")
    for r in range(2):
        state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r + 1))
    return jax.tree.leaves(state.server), jax.tree.leaves(params)


def factored():
    from bfedjax.algorithms import dense_update  # only in a tree with factored_dense_update.patch
    results = []
    for platforms in (("cpu",), ()):
        dense_update.FUSED_PLATFORMS = platforms
        results.append(two_rounds("fedavg", lr=0.05))
    (forced, initial), (plain, _) = results
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(forced, plain))
    change = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(plain, initial))
    print(f"max |factored - plain| {diff:.2e} on changes up to {change:.2e}")


def flatten(out):
    server, _ = two_rounds("bfl")
    np.save(out, np.concatenate([np.ravel(x) for x in server]))


if __name__ == "__main__":
    factored() if sys.argv[1] == "factored" else flatten(sys.argv[2])
