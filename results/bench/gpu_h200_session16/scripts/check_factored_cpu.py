"""On the CPU, forced: the factored dense update (v3 = factored + large kernels only) against the plain step, two FedAvg rounds."""
import jax, jax.numpy as jnp
import bfedjax as bf
from bfedjax.algorithms import dense_update
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams

def run(force):
    dense_update.FUSED_PLATFORMS = ("cpu",) if force else ()
    fed = federation(4, SHAPES["mlp"])
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    algo = bf.algorithms.build("fedavg", model, fed, batch_size=10, lr=0.05).replace(evaluate=None)
    arrays = round_arrays(fed)
    cfg = RoundConfig(4, 4, evaluate_local=False)
    params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = init_state(algo, params, cfg)
    step = make_round_step(algo, cfg, "vmap")
    for r in range(2):
        state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r + 1))
    return jax.tree.leaves(state.server), jax.tree.leaves(params)

a, p0 = run(True)
b, _ = run(False)
diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))
change = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(b, p0))
print(f"max |factored - plain| {diff:.2e} on changes up to {change:.2e}")
