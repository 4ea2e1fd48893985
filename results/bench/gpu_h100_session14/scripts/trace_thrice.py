"""Traces and lowers the variational ResNet-20 round (10 clients x 96 samples, B = 32) three times in one process: the first trace sets up NumPyro's AutoNormal prototype. Run from the repository root: PYTHONPATH=. python results/bench/gpu_h100_session14/scripts/trace_thrice.py"""
import time
import jax
import bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps
from bfedjax.core.simulate import round_arrays, traced_hparams
fed = federation(10, SHAPES["resnet20"], n=96)
model = bf.models.get_model("resnet20", 10)
algo = bf.algorithms.build("bfl", model, fed, batch_size=32).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = init_state(algo, params, cfg)
for i in range(3):
    step = make_round_step(algo, cfg, "vmap", donate_state=True)
    t1 = time.perf_counter()
    traced = step.trace(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1))
    t2 = time.perf_counter()
    lowered = traced.lower(); t3 = time.perf_counter()
    print(f"trace {t2-t1:.2f}s lower {t3-t2:.2f}s eqns {len(traced.jaxpr.eqns)} text {len(lowered.as_text())}", flush=True)
