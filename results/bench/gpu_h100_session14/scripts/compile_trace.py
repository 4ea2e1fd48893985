"""Where a round's compile time goes: host events of a jax.profiler trace around lower().compile(). Spec K:algorithm:model:B."""
import sys, glob, gzip, json, collections, shutil, time, os
import jax
import bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.simulate import round_arrays, traced_hparams
spec = sys.argv[1]; k, name, mname, b = spec.split(":"); k, b = int(k), int(b)
fed = federation(k, SHAPES[mname])
model = bf.models.get_model(mname, 10, hidden=(200, 200))
algo = bf.algorithms.build(name, model, fed, batch_size=b, **({} if name == "bfl" else {"lr": 0.01})).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = with_fixed_local_steps(RoundConfig(k, k, evaluate_local=False), arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = with_own_buffers(init_state(algo, params, cfg), params)
step = make_round_step(algo, cfg, "vmap", donate_state=True)
hp = traced_hparams(algo, 1)
t0 = time.perf_counter(); traced = step.trace(state, arrays, jax.random.PRNGKey(0), hp)
t1 = time.perf_counter(); lowered = traced.lower(); t2 = time.perf_counter()
shutil.rmtree("/tmp/cprof", ignore_errors=True)
with jax.profiler.trace("/tmp/cprof", create_perfetto_trace=True):
    compiled = lowered.compile()
t3 = time.perf_counter()
print(f"COMPILE {spec} threefry_kernel={os.environ.get('JAX_THREEFRY_GPU_KERNEL_LOWERING', '0')}: trace {t1-t0:.1f}s lower {t2-t1:.1f}s xla {t3-t2:.1f}s (profiled)")
hlo = compiled.as_text() or ""
print(f"  optimised HLO: {hlo.count(chr(10))} lines, {hlo.count(' fusion(')} fusion calls, {hlo.count('custom-call(')} custom calls")
f = glob.glob("/tmp/cprof/**/*.trace.json.gz", recursive=True)[0]
ev = json.load(gzip.open(f))["traceEvents"]
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("ph") != "X": continue
    n = e["name"]
    n = n.split(":")[0][:80] if len(n) > 80 else n
    tot[n] += e.get("dur", 0); cnt[n] += 1
for n, d in tot.most_common(40):
    print(f"  {d/1e6:8.2f} s x{cnt[n]:6d}  {n}")
