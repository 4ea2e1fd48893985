"""Compile and round time of the variational ResNet-20 round (K=10, B=32) as the library builds it, with XLA options k=v."""
import sys, time, statistics
import jax
import bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.layout import random_bits_lowering
from bfedjax.core.simulate import round_arrays, traced_hparams


def resnet20_round(model=None):
    """``(algorithm, round step, donated state, round arrays, hparams)`` of the round (also resnet_compile_split.py's);
    ``model`` replaces ResNet-20 on the same 32x32x3 images (session 30's block counts)."""
    fed = federation(10, SHAPES["resnet20"])
    model = bf.models.get_model("resnet20", 10) if model is None else model
    algo = bf.algorithms.build("bfl", model, fed, batch_size=32).replace(evaluate=None)
    arrays = round_arrays(fed)
    cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
    params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = with_own_buffers(init_state(algo, params, cfg), params)
    return algo, make_round_step(algo, cfg, "vmap", donate_state=True), state, arrays, traced_hparams(algo, 1)


def timed_compile(fn, *args, compiler_options=None):
    """``(compiled, trace_s, lower_s, xla_s)``: ``fn`` (jitted) traced, lowered and compiled for ``args``, each timed
    (also resnet_compile_split.py's and session 30's compile_probe.py's)."""
    t0 = time.perf_counter(); traced = fn.trace(*args)
    t1 = time.perf_counter(); lowered = traced.lower(); t2 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options); t3 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1, t3 - t2


def main(argv, rounds=13):
    opts = {}
    for a in argv:
        k, v = a.split("=", 1); opts[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v)
    _, step, state, arrays, hp = resnet20_round()
    with random_bits_lowering():
        compiled, trace_s, lower_s, xla_s = timed_compile(step, state, arrays, jax.random.PRNGKey(0), hp,
                                                          compiler_options=opts)
    times = []
    for r in range(rounds):
        s = time.perf_counter(); state, met = compiled(state, arrays, jax.random.PRNGKey(r), hp); jax.block_until_ready((state, met)); times.append(time.perf_counter() - s)
    print(f"CTIME {opts}: trace {trace_s:.2f}s lower {lower_s:.2f}s xla {xla_s:.2f}s round median {1e3*statistics.median(times[min(3, rounds - 1):]):.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
