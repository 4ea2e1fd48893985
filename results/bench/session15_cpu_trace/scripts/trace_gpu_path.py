"""Traces the variational ResNet-20 round (10 x 96, B=32) on the accelerators' path (fixed-step scan,
auto unroll decided as on a GPU) three times; prints trace time and the time spent in the unroll decision."""
import time, sys
import jax
import bfedjax as bf
from bfedjax.core import layout
layout.fixed_steps_scan = lambda **k: True
_auto = layout.auto_unroll_local_steps
spent = []
def auto(**k):
    t = time.perf_counter(); k["platform"] = "gpu"; r = _auto(**k); spent.append(time.perf_counter() - t); return r
layout.auto_unroll_local_steps = auto
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps
from bfedjax.core.simulate import round_arrays, traced_hparams
model_name = sys.argv[1] if len(sys.argv) > 1 else "resnet20"
fed = federation(10, SHAPES[model_name], n=96)
model = bf.models.get_model(model_name, 10)
algo = bf.algorithms.build("bfl", model, fed, batch_size=32).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = init_state(algo, params, cfg)
for i in range(3):
    spent.clear()
    step = make_round_step(algo, cfg, "vmap", donate_state=True)
    t1 = time.perf_counter()
    traced = step.trace(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1))
    t2 = time.perf_counter()
    print(f"trace {t2-t1:.2f}s unroll decision {sum(spent):.2f}s eqns {len(traced.jaxpr.eqns)}", flush=True)
