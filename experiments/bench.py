r"""Benchmark: the vmapped round against the stepwise loop, a PyTorch loop and the matmul ceiling.

    python -m experiments.bench                 # quick mode (< 10 min on 2 CPU cores)
    python -m experiments.bench --noquick       # adds K = 1000, the unchunked skewed splits and
                                                # the variational/FedReg clients at K = 10 and B = 50

For every configuration and algorithm it times whole rounds (after one
compile/warm-up round; the fastest of ``--rounds`` timed rounds, since a shared
machine only ever adds time) of
  * vmap     - the library: one jitted round, clients under vmap,
  * vmap/cN  - the same jitted round in chunks of N clients (``--cpu_chunks``; uniform
               configurations, CPU only); ``vmap/c1`` runs the clients one after another
               inside the round without a vmap (the fast choice for convolutions on CPU),
  * stepwise - one jitted step per client per batch (FedJAX's default design),
  * torch    - a PyTorch loop over clients like the papers' code (needs torch; on the
               GPU when torch sees one),
and reports the round time, client-samples per second, achieved FLOP/s
(training FLOPs on real samples, from XLA's cost analysis of the model,
divided by the round time; for the variational and FedReg clients this
counts only the deterministic model's training FLOPs, so their "% of peak"
understates the work done), the compiled round's memory (XLA memory analysis),
the aggregation's share of a round and the padded-work ratio (and, in the
JSON, the process's peak RSS so far, which only grows). The measured
dense-matmul FLOP/s of the machine is the ceiling (float32 at the backend's
default matmul precision, the precision the models train at). Writes
``bench.json`` and ``bench.md`` into ``--output_dir``.

The same command runs unchanged on a GPU (``pip install -U "jax[cuda12]"``): chunk
variants and the CPU-only skips are dropped there, and the targets checked are the GPU
one (vmap at least 20x the stepwise loop at K = 1000, which needs ``--noquick``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import time

from absl import app, flags, logging

from experiments import bench_torch, errors
from experiments.bench_report import check_targets, markdown

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", True, "Quick mode: fewer configurations, and the variational and FedReg clients "
                  "on fewer of them.")
flags.DEFINE_integer("rounds", None, "Timed rounds per measurement, the fastest reported (default 3; in quick "
                     "mode 1 for the variational and FedReg clients and at K = 3400).")
flags.DEFINE_list("algorithms", ["fedavg", "fola", "bfl", "fedreg"],
                  "Algorithms to time (each configuration lists which of them it runs).")
flags.DEFINE_list("backends", ["vmap", "stepwise", "torch"], "Backends to time.")
flags.DEFINE_list("only", None, "Run only configurations whose name contains one of these strings.")
flags.DEFINE_integer("samples_per_client", 100, "Samples per client in the uniform configurations "
                     "(100: whole batches at B = 10 and 50).")
flags.DEFINE_list("cpu_chunks", ["1", "2", "5"], "On a CPU, also time the round in chunks of these many clients on "
                  "uniform configurations (smaller working set: faster on CPU caches); empty skips them.")
flags.DEFINE_string("output_dir", "results/bench", "Where bench.json and bench.md go (rewritten after every row).")
flags.DEFINE_bool("resume", False, "Keep the rows of --output_dir/bench.json (a run cut off on the same machine) "
                  "and time only the missing ones.")
errors.check_list("backends", lambda b: b in ("vmap", "stepwise", "torch"), "among vmap, stepwise, torch",
                  "vmap,stepwise")
errors.check_list("cpu_chunks", lambda c: int(c) >= 1, "chunk sizes >= 1 (or empty)", "1,2,5")
for _name in ("rounds", "samples_per_client"):
    flags.register_validator(_name, lambda v: v is None or v >= 1, message=f"--{_name} must be >= 1")


@dataclasses.dataclass
class Config:
    name: str
    partition: str          # "uniform" | "dirichlet" | "power_law"
    num_clients: int
    batch_size: int
    clients_per_chunk: int | None = None
    library_only: bool = False  # too slow for the Python loops (e.g. FEMNIST-scale cohorts)
    model: str = "mlp"      # "mlp" (784-200-200-10) | "fedreg_cnn" (FedReg's MNIST CNN)
    algorithms: tuple = ("fedavg", "fola")
    samples_per_client: int | None = None  # None: --samples_per_client
    chunks: tuple | None = None  # chunk sizes timed as vmap/cN; None: --cpu_chunks
    cpu_skip: tuple = ()         # (algorithm, backend) pairs not timed on a CPU (grouped convs: very slow)
    rounds: int | None = None    # timed rounds; None: --rounds


ALL_CLIENTS = ("fedavg", "fola", "bfl", "fedreg")
errors.check_list("algorithms", lambda a: a in ALL_CLIENTS, f"among {', '.join(ALL_CLIENTS)}", "fedavg,fola")


def configurations(quick: bool) -> list[Config]:
    """The benchmarked configurations; quick mode keeps those the targets need (K = 10 and 100)."""
    heavy = (lambda k, b: k == 100 and b == 10) if quick else (lambda k, b: k <= 100)  # + variational, FedReg
    grid = [Config(f"mlp K={k} B={b}", "uniform", k, b, algorithms=ALL_CLIENTS if heavy(k, b) else ("fedavg", "fola"))
            for k in ((10, 100) if quick else (10, 100, 1000)) for b in (10, 50)]
    # The unchunked skewed splits show what padding every client to the largest costs (about 3x
    # the real work); their stepwise and torch rows repeat the chunked configurations'.
    unchunked = [] if quick else [Config("fmnist dir0.01 N=20 B=32 unchunked", "dirichlet", 20, 32),
                                  Config("power-law N=100 B=10 unchunked", "power_law", 100, 10)]
    return grid + [
        # Convolutions under a client vmap become grouped convolutions, slow on XLA:CPU: on a CPU
        # the CNN's library rows that matter are vmap/c1 (clients in turn inside the jitted round).
        Config("fedreg_cnn K=10 B=10", "uniform", 10, 10, model="fedreg_cnn", algorithms=ALL_CLIENTS,
               samples_per_client=20 if quick else 100, chunks=(1,),
               cpu_skip=(("bfl", "vmap"), ("fedreg", "vmap")) if quick else ()),
        *unchunked,
        Config("fmnist dir0.01 N=20 B=32 chunks of 2", "dirichlet", 20, 32, 2),
        Config("power-law N=100 B=10 chunks of 4", "power_law", 100, 10, 4),
        # The memory target is read off the compiled round; one timed round is enough in quick mode.
        Config("mlp K=3400 B=10 chunks of 10", "uniform", 3400, 10, 10, library_only=True,
               rounds=1 if quick else None),
    ]


def make_algorithm(name: str, model, fed, batch_size: int):
    """The benchmarked clients with their factories' default options; lr 0.01 (the variational
    clients keep their Adam default, 1e-3), FOLA without its per-round precision diagnostics.
    bfl: mean-field VI, WC aggregation (Fischer et al.); fedreg: pseudo/perturbed data generation
    and projected steps."""
    import bfedjax as bf
    options = {} if name == "bfl" else {"lr": 0.01}
    if name == "fola":  # the PyTorch loop computes no diagnostics either
        options["precision_diagnostics"] = False
    return bf.algorithms.build(name, model, fed, batch_size=batch_size, **options)


def load_images():
    """28x28 training images: Fashion-MNIST if present, else procedural noise digits."""
    import numpy as np
    import bfedjax as bf
    try:
        return bf.data.load("fashion_mnist")
    except bf.data.DataUnavailableError:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(60000, 28, 28, 1)).astype(np.float32)
        y = rng.integers(0, 10, 60000).astype(np.int32)
        return bf.data.Dataset("procedural28", x, y, x[:2000], y[:2000], 10, "procedural")


def federate(data, config: Config):
    import numpy as np
    import bfedjax as bf
    if config.partition == "uniform":
        n = config.samples_per_client or FLAGS.samples_per_client
        idx = np.resize(np.arange(len(data.y_train)), config.num_clients * n)
        parts = [idx[i * n:(i + 1) * n] for i in range(config.num_clients)]
    elif config.partition == "dirichlet":
        parts = bf.data.partition(data.y_train, "dirichlet_per_class", config.num_clients, seed=0, alpha=0.01)
    else:
        parts = bf.data.partition(data.y_train[:20000], "power_law", config.num_clients, seed=0)
    return bf.data.stack_clients(data.x_train, data.y_train, parts, x_test=data.x_test[:1000],
                                 y_test=data.y_test[:1000], num_classes=10, name=data.name)


def matmul_peak_flops(n: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of an n x n float32 matrix product (n = 1024 on a CPU, 8192 on an accelerator)."""
    import jax
    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n))
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = min(_timed(lambda: f(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def training_flops_per_sample(model, input_shape) -> float:
    """Forward FLOPs of one example from XLA's cost analysis, times 3 (forward + backward)."""
    import jax
    import jax.numpy as jnp
    x = jnp.zeros((1,) + tuple(input_shape))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    cost = jax.jit(lambda p, x: model.apply({"params": p}, x)).lower(params, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return 3.0 * float(cost["flops"])


def time_library(algorithm, fed, config: Config, backend: str, rounds: int) -> dict:
    import jax
    from bfedjax.core import RoundConfig, init_state, make_round_step
    from bfedjax.core.simulate import round_arrays, traced_hparams
    round_config = RoundConfig(fed.num_clients, fed.num_clients, clients_per_chunk=config.clients_per_chunk,
                               evaluate_local=False)
    params = algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state, arrays = init_state(algorithm, params, round_config), round_arrays(fed)
    step = make_round_step(algorithm, round_config, backend)
    out = {}
    if backend == "vmap":  # compile once, ahead of time: the executable gives the memory analysis and runs
        start = time.perf_counter()
        step = step.lower(state, arrays, jax.random.PRNGKey(0), traced_hparams(algorithm, 1)).compile()
        out["compile_only_s"] = time.perf_counter() - start
        mem = step.memory_analysis()
        if mem is not None:
            out["memory_mb"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / 2**20
    times = []
    for r in range(rounds + 1):
        hp = traced_hparams(algorithm, r + 1)
        t = _timed(lambda: jax.block_until_ready(step(state, arrays, jax.random.PRNGKey(r), hp)))
        times.append(t)
    out["compile_s"] = times[0] + out.get("compile_only_s", 0.0)  # compile + first (warm-up) round
    out["round_s"] = min(times[1:])
    return out


def time_aggregation(algorithm, fed, rounds: int = 5) -> float:
    """Seconds of the aggregation alone (``Algorithm.aggregate``, server metrics included) on a cohort's
    worth of messages."""
    import jax
    import jax.numpy as jnp
    from bfedjax.core import ClientContext, ClientData, local_training
    from bfedjax.core.simulate import traced_hparams
    params = algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape)
    server = algorithm.server_init(params)
    hp = traced_hparams(algorithm, 1)
    ctx = ClientContext(server, (), ClientData(jnp.asarray(fed.x[0]), jnp.asarray(fed.y[0]), jnp.int32(0)), hp)
    message, _, _ = jax.eval_shape(lambda: local_training(algorithm, ctx, jax.random.PRNGKey(0)))
    messages = jax.tree.map(lambda s: jnp.ones((fed.num_clients,) + s.shape, s.dtype), message)
    weights, mask, key = jnp.asarray(fed.weights), jnp.ones(fed.num_clients), jax.random.PRNGKey(0)
    update = jax.jit(algorithm.aggregate)
    jax.block_until_ready(update(server, messages, weights, mask, hp, key))
    return min(_timed(lambda: jax.block_until_ready(update(server, messages, weights, mask, hp, key)))
               for _ in range(rounds))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fix: flags take the form --name=value")
    names = [config.name for config in configurations(FLAGS.quick)]
    if FLAGS.only and not any(s in name for s in FLAGS.only for name in names):
        raise app.UsageError(f"--only={','.join(FLAGS.only)} matches no configuration; fix: use part of one of "
                             f"{'; '.join(names)}")
    logging.set_verbosity(logging.WARNING)
    import jax
    import bfedjax as bf

    rounds = FLAGS.rounds or 3
    data = load_images()
    rows, peak = previous_rows(os.path.join(FLAGS.output_dir, "bench.json")) if FLAGS.resume else ([], None)
    peak = peak or matmul_peak_flops()
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    machine = {"platform": device.platform, "device": str(device.device_kind), "cpu_count": os.cpu_count(),
               "processor": platform.processor() or platform.machine(), "jax": jax.__version__}
    print(f"machine: {machine}; matmul peak {peak / 1e9:.1f} GFLOP/s; data: {data.name}", flush=True)
    backends = list(FLAGS.backends)
    if "torch" in backends and not bench_torch.available():
        print("torch is not installed: skipping the PyTorch loop (pip install -e '.[bench]')", flush=True)
        backends.remove("torch")
    models, flops = {}, {}

    done = {(r["config"], r["algorithm"], r["backend"]) for r in rows}
    for config in configurations(FLAGS.quick):
        if FLAGS.only and not any(s in config.name for s in FLAGS.only):
            continue
        if config.model not in models:
            models[config.model] = bf.models.get_model(config.model, 10, hidden=(200, 200))
            flops[config.model] = training_flops_per_sample(models[config.model], data.x_train.shape[1:])
        model, flops_per_sample = models[config.model], flops[config.model]
        fed = federate(data, config)
        real_samples = int(fed.counts.sum())
        ratio = fed.padded_work_ratio(config.batch_size, config.clients_per_chunk)
        for name in [a for a in config.algorithms if a in FLAGS.algorithms]:
            algorithm = make_algorithm(name, model, fed, config.batch_size)
            agg_s = time_aggregation(algorithm, fed)
            # quick mode: one timed round of the variational and FedReg clients (no target reads them)
            timed_rounds = config.rounds or (1 if FLAGS.quick and name not in bench_torch.ALGORITHMS else rounds)
            for backend in variants_of(config, name, backends, on_cpu):
                if (config.name, name, backend) in done:
                    continue
                if backend == "torch":
                    times = bench_torch.time_rounds(fed, algorithm=name, model=config.model, hidden=(200, 200),
                                                    batch_size=config.batch_size, rounds=timed_rounds + 1)
                    result = {"compile_s": times[0], "round_s": min(times[1:])}
                elif backend.startswith("vmap/c"):
                    chunked = dataclasses.replace(config, clients_per_chunk=int(backend[len("vmap/c"):]))
                    result = time_library(algorithm, fed, chunked, "vmap", timed_rounds)
                else:
                    result = time_library(algorithm, fed, config, backend, timed_rounds)
                result.update(config=config.name, algorithm=name, backend=backend, clients=fed.num_clients,
                              batch_size=config.batch_size, padded_work_ratio=ratio if backend.startswith("vmap") else 1.0,
                              samples_per_s=real_samples / result["round_s"],
                              gflops=real_samples * flops_per_sample / result["round_s"] / 1e9,
                              aggregation_share=agg_s / result["round_s"] if backend.startswith("vmap") else None)
                result["peak_fraction"] = result["gflops"] * 1e9 / peak
                result["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                rows.append(result)
                print(f"{config.name:38s} {name:7s} {backend:9s} round {result['round_s']:8.3f}s  "
                      f"{result['samples_per_s']:10.0f} samples/s  {result['gflops']:6.1f} GFLOP/s "
                      f"({100 * result['peak_fraction']:4.1f}% of peak)", flush=True)
                write_report(machine, peak, data.name, rows)  # after every row: a cut-off run keeps its rows
    print("\n" + write_report(machine, peak, data.name, rows))


def previous_rows(path: str) -> tuple[list[dict], float | None]:
    """Rows and matmul peak (FLOP/s) of an earlier run on this device, for --resume."""
    import jax
    if not os.path.exists(path):
        return [], None
    with open(path) as f:
        report = json.load(f)
    kind = str(jax.devices()[0].device_kind)
    if report["machine"]["device"] != kind:
        raise app.UsageError(f"--resume: {path} was measured on {report['machine']['device']!r}, this is {kind!r}; "
                             "fix: pass another --output_dir or drop --resume")
    print(f"resuming: {len(report['rows'])} rows kept from {path}", flush=True)
    return report["rows"], report["matmul_peak_gflops"] * 1e9


def write_report(machine: dict, peak: float, data_name: str, rows: list[dict]) -> str:
    """Writes bench.json and bench.md for the rows so far into --output_dir; returns the markdown."""
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    report = {"machine": machine, "matmul_peak_gflops": peak / 1e9, "data": data_name, "rows": rows,
              "targets": check_targets(rows, machine["platform"])}
    with open(os.path.join(FLAGS.output_dir, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(FLAGS.output_dir, "bench.md"), "w") as f:
        f.write(text)
    return text


def variants_of(config: Config, algorithm: str, backends: list[str], on_cpu: bool = True) -> list[str]:
    """The backends timed for one configuration and algorithm, chunked variants (CPU only) after ``vmap``."""
    variants = list(backends)
    chunks = [int(c) for c in (config.chunks or FLAGS.cpu_chunks) if int(c) < config.num_clients] if on_cpu else []
    if FLAGS.quick and algorithm not in bench_torch.ALGORITHMS:
        chunks = [c for c in chunks if c == 1]  # variational / FedReg: compiles take minutes; c1 only
    if "vmap" in variants and config.partition == "uniform" and not config.clients_per_chunk:
        at = variants.index("vmap") + 1
        variants[at:at] = [f"vmap/c{c}" for c in chunks]
    if config.library_only:
        variants = [b for b in variants if b.startswith("vmap")]
    if "torch" in variants and (config.clients_per_chunk or algorithm not in bench_torch.ALGORITHMS):
        variants.remove("torch")  # chunking is a library notion; torch covers the papers' FedAvg and FOLA loops
    return [b for b in variants if not (on_cpu and (algorithm, b) in config.cpu_skip)]


if __name__ == "__main__":
    errors.run(main)
