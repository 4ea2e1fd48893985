"""Rounds of the library with and without client_half.per_client (patched to the identity), compiled in one process and timed in turn: PYTHONPATH=. python results/bench/gpu_h100_session14/scripts/per_client_in_turn.py K:fixed:algorithm ROUNDS (MLP 784-200-200-10, B = 10, 100 procedural samples per client, one vmap)."""
import sys, time, numpy as np, jax
import bfedjax as bf
from bfedjax.core import client_half
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.simulate import round_arrays, traced_hparams
spec = sys.argv[1]; k, fixed, name = spec.split(":"); k = int(k); fixed = fixed == "1"
fed = federation(k, SHAPES["mlp"])
model = bf.models.get_model("mlp", 10, hidden=(200, 200))
algo = bf.algorithms.build(name, model, fed, batch_size=10, **({} if name == "bfl" else {"lr": 0.01})).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = RoundConfig(k, k, evaluate_local=False)
if fixed: cfg = with_fixed_local_steps(cfg, arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
real = client_half.per_client
steps = {}
for variant in ("old", "new"):
    client_half.per_client = (lambda tree, true: tree) if variant == "old" else real
    state = with_own_buffers(init_state(algo, params, cfg), params)
    step = make_round_step(algo, cfg, "vmap", donate_state=True)
    compiled = step.lower(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1)).compile()
    steps[variant] = [compiled, state]
client_half.per_client = real
best = {v: [] for v in steps}
for r in range(int(sys.argv[2]) + 1):
    for v, (c, st) in steps.items():
        t = time.perf_counter(); st, m = c(st, arrays, jax.random.PRNGKey(r), traced_hparams(algo, 1)); jax.block_until_ready(st)
        steps[v][1] = st
        if r: best[v].append(time.perf_counter() - t)
print(spec, {v: f"min {1e3*min(t):.1f} med {1e3*np.median(t):.1f} ms" for v, t in best.items()})
