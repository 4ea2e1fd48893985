"""Two BFL rounds (MLP, K = 4) in the tree on PYTHONPATH; saves the server state, raveled, to argv[1] (.npy) to compare trees."""
import jax, numpy as np
import bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
fed = federation(4, SHAPES["mlp"])
model = bf.models.get_model("mlp", 10, hidden=(200, 200))
algo = bf.algorithms.build("bfl", model, fed, batch_size=10).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = RoundConfig(4, 4, evaluate_local=False)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = init_state(algo, params, cfg)
step = make_round_step(algo, cfg, "vmap")
for r in range(2):
    state, _ = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r + 1))
np.save(__import__("sys").argv[1], np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.server)]))
