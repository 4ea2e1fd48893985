"""GPU kernel breakdown of one library round (perfetto trace from jax.profiler). Spec K:algorithm:model:mib[:dtype]."""
import sys, glob, gzip, json, collections, shutil, re
import os
import jax
import bfedjax as bf
if os.environ.get("DWMIB"): bf.models.conv.MATMUL_KERNEL_GRAD_MAX_BYTES["gpu"] = int(float(os.environ["DWMIB"]) * 2**20)
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.simulate import round_arrays, traced_hparams
for spec in sys.argv[1:]:
    p = spec.split(":"); k, name, mname, mib = int(p[0]), p[1], p[2], float(p[3]); dtype = p[4] if len(p) > 4 else "float32"
    bf.models.conv.MATMUL_CONV_MAX_BYTES["gpu"] = int(mib * 2**20)
    fed = federation(k, SHAPES[mname])
    model = bf.models.get_model(mname, 10, hidden=(200, 200), compute_dtype=dtype)
    algo = bf.algorithms.build(name, model, fed, batch_size=10, **({} if name == "bfl" else {"lr": 0.01, **({"clip_norm": None} if os.environ.get("NOCLIP") else {}), **({"factored_clip_norm": os.environ["FCN"] == "1"} if os.environ.get("FCN") and name == "fedavg" else {})})).replace(evaluate=None)
    arrays = round_arrays(fed)
    cfg = with_fixed_local_steps(RoundConfig(k, k, evaluate_local=False, unroll_local_steps=int(os.environ['UNROLL']) if os.environ.get('UNROLL') else None), arrays)
    params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = with_own_buffers(init_state(algo, params, cfg), params)
    step = make_round_step(algo, cfg, "vmap", donate_state=True)
    hp = traced_hparams(algo, 1)
    import os, time, statistics
    opts = {}
    for a in filter(None, os.environ.get("COPTS", "").split(",")):
        kk, v = a.split("=", 1); opts[kk] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v)
    step = step.lower(state, arrays, jax.random.PRNGKey(0), hp).compile(compiler_options=opts)
    times = []
    for r in range(23):
        s = time.perf_counter(); state, met = step(state, arrays, jax.random.PRNGKey(r), hp); jax.block_until_ready((state, met)); times.append(time.perf_counter() - s)
    print(f"TIME {spec} {opts}: median {1e3*statistics.median(times[3:]):.2f} ms min {1e3*min(times[3:]):.2f} ms")
    if os.environ.get("NOPROF"): continue
    shutil.rmtree("/tmp/prof", ignore_errors=True)
    R = 5
    with jax.profiler.trace("/tmp/prof", create_perfetto_trace=True):
        for r in range(R):
            state, met = step(state, arrays, jax.random.PRNGKey(r), hp); jax.block_until_ready((state, met))
    f = glob.glob("/tmp/prof/**/*.trace.json.gz", recursive=True)[0]
    ev = json.load(gzip.open(f))["traceEvents"]
    pname = {e["pid"]: e["args"].get("name", "") for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot = collections.Counter(); cnt = collections.Counter(); span = {}
    for e in ev:
        if e.get("ph") != "X": continue
        pn = pname.get(e["pid"], "")
        if "GPU" not in pn and "gpu" not in pn: continue
        key = (pn[:30], e["name"])
        tot[key] += e.get("dur", 0); cnt[key] += 1
    print(f"=== {spec}: pids {sorted(set(pname.values()))[:8]}")
    bypid = collections.Counter()
    for (pn, n), d in tot.items(): bypid[pn] += d
    for pn, d in bypid.items(): print(f"  {pn}: {d/R/1e3:.3f} ms/round busy, {sum(c for (q, _), c in cnt.items() if q == pn)/R:.0f} events/round")
    for (pn, n), d in tot.most_common(30):
        print(f"  {d/R/1e3:8.3f} ms/round x{cnt[(pn, n)]/R:6.1f}  {pn[:12]} {n[:110]}")
