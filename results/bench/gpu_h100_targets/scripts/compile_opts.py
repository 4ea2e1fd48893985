"""ResNet-20 BFL round: trace / lower / XLA compile under XLA compiler options, then 5 timed rounds.
usage: compile_opts.py LABEL [option=value ...]   (values: ints, true/false, else strings)"""
import sys, time, statistics
import jax
import bfedjax as bf
from experiments.bench_round import federation
from experiments.bench import make_algorithm
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.simulate import round_arrays, traced_hparams
label, opts = sys.argv[1], {}
for a in sys.argv[2:]:
    k, v = a.split("=", 1)
    opts[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v)
k, n, B = 10, 32 * 4, 32
fed = federation(k, (32, 32, 3), n)
model = bf.models.get_model("resnet20", 10)
import os; algo = make_algorithm("bfl", model, fed, B, os.environ.get("EST", "flipout"))
arrays = round_arrays(fed)
cfg = with_fixed_local_steps(RoundConfig(k, k, evaluate_local=False), arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = with_own_buffers(init_state(algo, params, cfg), params)
step = make_round_step(algo, cfg, "vmap", donate_state=True)
t0 = time.perf_counter(); tr = step.trace(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1)); t1 = time.perf_counter()
lo = tr.lower(); t2 = time.perf_counter()
try:
    c = lo.compile(compiler_options=opts) if opts else lo.compile()
except Exception as e:  # an option this XLA does not know
    print(f"{label}: compile failed: {str(e).splitlines()[0][:200]}"); sys.exit(0)
t3 = time.perf_counter()
times = []
for r in range(6):
    s = time.perf_counter(); state, met = c(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r + 1))
    jax.block_until_ready((state, met)); times.append(time.perf_counter() - s)
print(f"RESULT {label}: trace {t1-t0:.1f}s lower {t2-t1:.1f}s xla {t3-t2:.1f}s | round median {1e3*statistics.median(times[1:]):.1f} ms "
      f"min {1e3*min(times[1:]):.1f} ms | first {1e3*times[0]:.1f} ms", flush=True)
