"""FedAvg/FOLA/BFL MLP rounds lowered on the accelerators' path (fixed-step scan, unroll decided as on a GPU): md5 of the module text."""
import jax, bfedjax as bf, hashlib
from bfedjax.core import engine, layout
layout.fixed_steps_scan = lambda **k: True
_auto = layout.auto_unroll_local_steps
def auto(**k):
    k["platform"] = "gpu"; r = _auto(**k); print("unroll", r, end=" "); return r
layout.auto_unroll_local_steps = auto
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps
from bfedjax.core.simulate import round_arrays, traced_hparams
fed = federation(10, SHAPES["mlp"])
for name in ("fedavg", "fola", "bfl"):
    algo = bf.algorithms.build(name, bf.models.get_model("mlp", 10, hidden=(200, 200)), fed, batch_size=10, **({} if name == "bfl" else {"lr": 0.01})).replace(evaluate=None)
    arrays = round_arrays(fed); cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
    txt = make_round_step(algo, cfg, "vmap").lower(init_state(algo, algo.init_params(jax.random.PRNGKey(0), fed.input_shape), cfg), arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1)).as_text(debug_info=False)
    print(name, hashlib.md5(txt.encode()).hexdigest(), len(txt))
