r"""Benchmark: the vmapped round against the stepwise loop, PyTorch, a centralised ceiling and a roofline.

    python -m experiments.bench                 # quick mode (< 10 min on 2 CPU cores)
    python -m experiments.bench --noquick       # adds K = 1000, K = 10 at B = 50, the unchunked skewed
                                                # splits, the variational/FedReg clients at K = 10,
                                                # B = 50 and in every layout, chunks of 5, the layout
                                                # simulate picks on one device, FedAvg on the skewed
                                                # splits, FOLA on the FedReg CNN, and K = 3400's rounds

For every configuration and algorithm it times whole rounds (after one
compile/warm-up round; the fastest of ``--rounds`` timed rounds, since a shared
machine only ever adds time) of
  * vmap     - the library: one jitted round, clients under vmap,
  * vmap/cN  - the same jitted round in chunks of N clients (``--cpu_chunks``; uniform
               configurations, CPU only); ``vmap/c1`` runs the clients one after another
               inside the round without a vmap (the fast choice for convolutions on CPU),
  * vmap/cNxD - chunks of N split over D devices (``RoundConfig.client_devices``): on a CPU,
               ``--cpu_devices`` (default: one per core, ``core.layout.use_cpu_cores``) and
               ``simulate``'s default there; with D > 1 the chunk variants run on D devices, and
               the layout ``simulate`` picks on one device is timed too (``vmap`` or ``vmap/cN``),
  * stepwise - one jitted step per client per batch (FedJAX's default design),
  * torch    - a PyTorch loop over clients like the papers' code (needs torch; on the
               GPU when torch sees one),
  * torch.func, torch.func+compile - the strongest PyTorch design: one step of every
               client at once, ``torch.func.vmap(grad(...))`` over stacked client
               parameters, eager and under ``torch.compile`` (FedAvg and FOLA),
  * centralised - the ceiling a round can approach: one model trained by one jitted SGD
               scan on the same samples at batch K x B (as many sequential steps as a client),
  * alternated - at K = 100 (B = 10 and 50), FedAvg's and FOLA's default layouts once more, their
               rounds taken in turn (at least 10 each): FOLA / FedAvg's target reads these, a ratio
               under one machine load (rows timed minutes apart drift by 5-10% on a shared machine),
  * paired   - FedAvg's and FOLA's default layout and their fastest other library variant once
               more, their rounds taken in turn (at least 10 each, continuing the rows' compiled
               rounds): the default / fastest variant target reads these (a layout's rounds can run a
               third slower for seconds at a time on the 2-core VM, so rows timed one after another
               can swap which layout looks fastest),
and marks as ``default`` the library row of the layout ``simulate`` picks by itself
(``clients_per_chunk="auto"``, ``bfedjax.core.layout``). It reports the round time, client-samples per second, achieved FLOP/s
(training FLOPs on real samples, from XLA's cost analysis of the model,
divided by the round time; for the variational and FedReg clients this
counts only the deterministic model's training FLOPs, so their "% of peak"
understates the work done), the compiled round's memory (XLA memory analysis),
the aggregation's share of a round and the padded-work ratio (and, in the
JSON, the process's peak RSS so far, which only grows). The measured
dense-matmul FLOP/s of the machine is the ceiling (float32 at the backend's
default matmul precision, the precision the models train at). The roofline
column is the larger of the round's training FLOPs over that peak and its
per-client parameter traffic (every local step reads and writes each client's
weights and gradient, FOLA also its prior and Fisher; ``bench_anchors``) over
the measured memory bandwidth, as a fraction of the round time. Every round,
the library's and PyTorch's alike, trains only: the algorithms' evaluation hook
is off (the PyTorch loops evaluate nothing either). The compile column is the
first round's time (compilation plus one round). Writes ``bench.json`` and
``bench.md`` into ``--output_dir``.

The same command runs unchanged on a GPU (``pip install -U "jax[cuda12]"``): chunk
variants and the CPU-only skips are dropped there, FedReg's CNN and FOLA's CIFAR CNN
are timed at K = 100, a round of variational ResNet-20 clients (``bfl``, K = 10, B = 32)
is timed for its compile column, and the targets checked are the GPU ones
(``bench_report``). On this 2-core CPU that ResNet-20 row (run by lifting its
``gpu_only``) compiled in 83 s and trained a round in 18.2 s.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import time
from typing import NamedTuple

import numpy as np
from absl import app, flags, logging

from experiments import bench_anchors, bench_torch, errors
from experiments.bench_report import (ALTERNATED, ALTERNATED_CONFIGS, PAIRED, RESNET_COMPILE_CONFIG, changed_setting,
                                     check_targets, markdown)

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", True, "Quick mode: fewer configurations, and the variational and FedReg clients "
                  "on fewer of them.")
flags.DEFINE_integer("rounds", None, "Timed rounds per measurement, the fastest reported (default 3, 10 at "
                     "K = 10 and 5 at K = 100 for the MLP; in quick mode 1 for the variational and FedReg clients, "
                     "and none at K = 3400, whose round is only compiled).")
flags.DEFINE_list("algorithms", ["fedavg", "fola", "bfl", "fedreg"],
                  "Algorithms to time (each configuration lists which of them it runs).")
BACKENDS = ("vmap", "stepwise", "torch", "torch.func", "torch.func+compile", "centralised")
flags.DEFINE_list("backends", list(BACKENDS), "Backends to time (torch.func and centralised on the "
                  "configurations that have them).")
flags.DEFINE_list("only", None, "Run only configurations whose name contains one of these strings.")
flags.DEFINE_integer("samples_per_client", 100, "Samples per client in the uniform configurations "
                     "(100: whole batches at B = 10 and 50).")
flags.DEFINE_list("cpu_chunks", None, "On a CPU, also time the round in chunks of these many clients on uniform "
                  "configurations (smaller working set: faster on CPU caches); empty skips them; default 1,2,5, in "
                  "quick mode 1,2 (chunks of 5 were never within 10% of the fastest layout).")
flags.DEFINE_string("output_dir", "results/bench", "Where bench.json and bench.md go (rewritten after every row).")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "The library's and the centralised "
                  "ceiling's compute dtype (models.COMPUTE_DTYPES; parameters stay float32), and the dtype of the "
                  "matmul peak; the PyTorch rows stay float32. Give bfloat16 runs their own --output_dir.")
flags.DEFINE_string("bfl_gradient_estimator", "flipout", "Gradient estimator of the variational (bfl) clients, "
                    "one of bfedjax.vi.GRADIENT_ESTIMATORS. Give other estimators their own --output_dir.")
flags.DEFINE_bool("fixed_local_steps", True, "Let the library's rounds take fixed local steps where every client "
                  "fills its batches (RoundConfig.fixed_local_steps, as simulate does); false keeps the per-step "
                  "while_loop. Give --nofixed_local_steps runs their own --output_dir.")
flags.DEFINE_float("matmul_conv_max_mib", None, "On this platform, the largest per-client im2col patch matrix (MiB) "
                   "whose trained convolution runs as a matrix product (bfedjax.models.conv.MATMUL_CONV_MAX_BYTES; "
                   "0: XLA's convolutions only); default: the library's. Give other values their own --output_dir.")
flags.DEFINE_float("matmul_kernel_grad_max_mib", None, "On this platform, the largest per-client im2col patch matrix "
                   "(MiB) for which a convolution left to XLA takes its kernel gradient as a matrix product "
                   "(bfedjax.models.conv.MATMUL_KERNEL_GRAD_MAX_BYTES; 0: a convolution over the batch axis); "
                   "default: the library's. Give other values their own --output_dir.")
flags.DEFINE_float("matmul_alone_conv_max_mib", None, "On this platform, the largest im2col patch matrix (MiB) whose "
                   "trained convolution runs as a matrix product when no vmap batches it, a client trained alone "
                   "(bfedjax.models.conv.ALONE_MATMUL_CONV_MAX_BYTES; 0: XLA's convolutions there); default: the "
                   "library's. Give other values their own --output_dir.")
flags.DEFINE_bool("gpu_threefry_kernel", True, "On a GPU, lower the library's rounds with JAX's threefry kernel "
                  "(core.layout.GPU_THREEFRY_KERNEL, simulate's default); --nogpu_threefry_kernel: JAX's own setting "
                  "(the threefry hash written out in XLA operations unless JAX_THREEFRY_GPU_KERNEL_LOWERING=1); the "
                  "report records the setting in effect.")
flags.DEFINE_bool("winograd", True, "Let a client trained alone take Winograd convolutions where the platform lists "
                  "them (bfedjax.models.conv.WINOGRAD_TILES; --nowinograd: XLA's convolutions there). Give "
                  "--nowinograd runs their own --output_dir.")
flags.DEFINE_string("cpu_devices", "auto", "On a CPU, split it into this many JAX devices before anything runs "
                    "(bfedjax.core.layout.use_cpu_cores; 'auto': one per usable core; 1: one device): the library's "
                    "chunk variants and default layout then train on all of them.")
flags.register_validator("cpu_devices", lambda v: v == "auto" or (v.isdigit() and int(v) >= 1),
                         message="--cpu_devices must be auto or a number >= 1, e.g. --cpu_devices=2")
flags.DEFINE_bool("resume", False, "Keep the rows of --output_dir/bench.json (a run cut off on the same machine) "
                  "and time only the missing ones.")
errors.check_list("backends", lambda b: b in BACKENDS, f"among {', '.join(BACKENDS)}", "vmap,stepwise")
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
    model: str = "mlp"      # "mlp" (784-200-200-10) | "fedreg_cnn" (FedReg's MNIST CNN) | "fola_cnn" (32x32x3)
    #                         | "resnet20" (32x32x3)
    algorithms: tuple = ("fedavg", "fola")
    samples_per_client: int | None = None  # None: --samples_per_client
    chunks: tuple | None = None  # chunk sizes timed as vmap/cN; None: --cpu_chunks (or its default)
    cpu_skip: tuple = ()         # (algorithm, backend) pairs not timed on a CPU (grouped convs: very slow)
    rounds: int | None = None    # timed rounds unless --rounds is given; None: 3 (quick rules aside)
    anchors: bool = False        # also time torch.func and the centralised ceiling
    gpu_only: bool = False       # skipped on a CPU
    compile_only: bool = False   # the library's round compiled for its memory and compile time, no round run


ALL_CLIENTS = ("fedavg", "fola", "bfl", "fedreg")
ALL_CHUNKS, QUICK_CHUNKS = (1, 2, 5), (1, 2)  # --cpu_chunks' defaults
errors.check_list("algorithms", lambda a: a in ALL_CLIENTS, f"among {', '.join(ALL_CLIENTS)}", "fedavg,fola")


def configurations(quick: bool) -> list[Config]:
    """The benchmarked configurations; quick mode keeps those the targets need, times the variational and
    FedReg clients only in the library's layouts (no stepwise rows), the FedReg CNN and the skewed splits
    with the one algorithm their targets read, and compiles the K = 3400 memory row without running it."""
    heavy = (lambda k, b: k == 100 and b == 10) if quick else (lambda k, b: k <= 100)  # + variational, FedReg
    quick_skip = tuple((a, b) for a in ("bfl", "fedreg") for b in ("vmap", "stepwise")) if quick else ()
    sizes = ((10, 10), (100, 10), (100, 50)) if quick else tuple((k, b) for k in (10, 100, 1000) for b in (10, 50))
    # K = 10 rounds take about 30 ms on a CPU: the fastest of 10 rather than 3, or scheduling noise
    # decides which layout looks fastest; K = 100 rounds (0.06-0.5 s) the fastest of 5, against the
    # shared VM's bursts of load
    grid = [Config(f"mlp K={k} B={b}", "uniform", k, b, algorithms=ALL_CLIENTS if heavy(k, b) else ("fedavg", "fola"),
                   anchors=k >= 100, cpu_skip=quick_skip, rounds={10: 10, 100: 5}.get(k)) for k, b in sizes]
    # The unchunked skewed splits show what padding every client to the largest costs (about 3x
    # the real work); their stepwise and torch rows repeat the chunked configurations'.
    skewed_algorithms = ("fola",) if quick else ("fedavg", "fola")
    unchunked = [] if quick else [Config("fmnist dir0.01 N=20 B=32 unchunked", "dirichlet", 20, 32),
                                  Config("power-law N=100 B=10 unchunked", "power_law", 100, 10)]
    return grid + [
        # On a CPU the zoo's convolutions are matrix products (models.conv), and the default
        # layout runs a CNN's clients in turn (vmap/c1).
        # Quick mode times FedAvg only (the target against the PyTorch loop reads it; the MLP's K = 100 rows
        # time the other clients' layouts): the CNN's FOLA, variational and FedReg rounds each compile for
        # 6-16 s on a 2-core machine.
        Config("fedreg_cnn K=10 B=10", "uniform", 10, 10, model="fedreg_cnn",
               algorithms=("fedavg",) if quick else ALL_CLIENTS,
               samples_per_client=20 if quick else 100, chunks=(1,), cpu_skip=quick_skip, anchors=True),
        # The GPU targets' CNN rounds (on a CPU they would take minutes per backend).
        Config("fedreg_cnn K=100 B=10", "uniform", 100, 10, model="fedreg_cnn", gpu_only=True, anchors=True),
        Config("fola_cnn K=100 B=10", "uniform", 100, 10, model="fola_cnn", algorithms=("fola",), gpu_only=True,
               anchors=True),
        # Issue 18's compile-time target: a round of variational (mean-field, Flipout) ResNet-20 clients.
        Config(RESNET_COMPILE_CONFIG, "uniform", 10, 32, model="resnet20", algorithms=("bfl",), gpu_only=True),
        *unchunked,
        # Their targets (padded work, vmap over stepwise) read FOLA's rows; quick mode times FOLA only.
        *(Config(name, partition, k, b, chunk, algorithms=skewed_algorithms)
          for name, partition, k, b, chunk in (("fmnist dir0.01 N=20 B=32 chunks of 2", "dirichlet", 20, 32, 2),
                                               ("power-law N=100 B=10 chunks of 4", "power_law", 100, 10, 4))),
        # The memory target is read off the compiled round (FOLA's is the larger); quick mode compiles
        # FOLA's round without running it (a round takes 10-20 s on 2 cores).
        Config("mlp K=3400 B=10 chunks of 10", "uniform", 3400, 10, 10, library_only=True,
               algorithms=("fola",) if quick else ("fedavg", "fola"), compile_only=quick),
    ]


def make_algorithm(name: str, model, fed, batch_size: int, gradient_estimator: str = "flipout"):
    """The benchmarked clients with their factories' default options; lr 0.01 (the variational
    clients keep their Adam default, 1e-3), FOLA without its per-round precision diagnostics.
    bfl: mean-field VI, WC aggregation (Fischer et al.), with ``gradient_estimator``; fedreg:
    pseudo/perturbed data generation and projected steps."""
    import bfedjax as bf
    options = {"gradient_estimator": gradient_estimator} if name == "bfl" else {"lr": 0.01}
    if name == "fola":  # the PyTorch loop computes no diagnostics either
        options["precision_diagnostics"] = False
    algorithm = bf.algorithms.build(name, model, fed, batch_size=batch_size, **options)
    return algorithm.replace(evaluate=None)  # rounds train only: the PyTorch loops evaluate nothing either


def load_images(shape=(28, 28, 1)):
    """Training images: Fashion-MNIST if present (28x28x1), else procedural noise of ``shape``
    (32x32x3 for FOLA's CIFAR CNN: CIFAR-10 needs a download; only the speed is measured)."""
    import numpy as np
    import bfedjax as bf
    if tuple(shape) == (28, 28, 1):
        try:
            return bf.data.load("fashion_mnist")
        except bf.data.DataUnavailableError:
            pass
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20000,) + tuple(shape)).astype(np.float32)
    y = rng.integers(0, 10, 20000).astype(np.int32)
    return bf.data.Dataset(f"procedural{shape[0]}x{shape[1]}x{shape[2]}", x, y, x[:1000], y[:1000], 10, "procedural")


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


def time_compilations_afresh() -> None:
    """No persistent compilation cache in this process, even where ``JAX_COMPILATION_CACHE_DIR`` names one: the
    compile columns time XLA's compilation. Call it before JAX's first compilation (JAX checks once)."""
    import jax
    jax.config.update("jax_enable_compilation_cache", False)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def training_flops_per_sample(model, input_shape) -> float:
    """Forward FLOPs of one example from XLA's cost analysis, times 3 (forward + backward). Compiled for the
    CPU on every machine: a GPU executable's analysis counts none of the convolutions it hands to cuDNN."""
    import jax
    import jax.numpy as jnp
    from bfedjax.models import apply_fn_of, zoo
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        x = jnp.zeros((1,) + tuple(input_shape))
        params = zoo.init_params(model, tuple(input_shape), jax.random.PRNGKey(0))  # BatchNorm statistics included
        params, x = jax.device_put((params, x), cpu)  # committed: the executable is the CPU's
        cost = jax.jit(apply_fn_of(model)).lower(params, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return 3.0 * float(cost["flops"])


def prepared_round(algorithm, fed, config: Config, backend: str, fixed_local_steps: bool = True,
                   client_devices: int = 1) -> list:
    """``[step, state, arrays, out]``: one library configuration's round step, its donated state and round
    arrays, as ``simulate`` runs it (vmap: compiled ahead of time, ``out`` holding ``"trace_s"``, ``"lower_s"``,
    ``"compile_only_s"`` and ``"memory_mb"``); ``fixed_local_steps`` lets ``with_fixed_local_steps`` decide,
    as ``simulate``; ``client_devices``: the chunks split over this many devices (``RoundConfig.client_devices``)."""
    import jax
    from bfedjax.core import (RoundConfig, init_state, layout, make_round_step, replicated_on, with_fixed_local_steps,
                              with_own_buffers)
    from bfedjax.core.simulate import round_arrays, traced_hparams
    arrays = round_arrays(fed)
    round_config = RoundConfig(fed.num_clients, fed.num_clients, clients_per_chunk=config.clients_per_chunk,
                               evaluate_local=False, client_devices=client_devices if backend == "vmap" else 1)
    if fixed_local_steps:
        round_config = with_fixed_local_steps(round_config, arrays)
    params = algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape)
    state = init_state(algorithm, params, round_config)
    state, arrays = replicated_on(round_config, (state, arrays))  # one device: as they are
    state = with_own_buffers(state, params)  # donated below
    step = make_round_step(algorithm, round_config, backend, donate_state=backend == "vmap")  # as simulate runs it
    out = {}
    if backend == "vmap":  # compile once, ahead of time: the executable gives the memory analysis and runs
        start = time.perf_counter()
        with layout.random_bits_lowering():  # as simulate lowers its rounds
            traced = step.trace(state, arrays, jax.random.PRNGKey(0), traced_hparams(algorithm, 1))
            out["trace_s"] = time.perf_counter() - start
            lowered = traced.lower()
            out["lower_s"] = time.perf_counter() - start - out["trace_s"]
            step = lowered.compile()
        out["compile_only_s"] = time.perf_counter() - start  # tracing, lowering and XLA's compilation
        mem = step.memory_analysis()
        if mem is not None:
            out["memory_mb"] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                                - mem.alias_size_in_bytes) / 2**20  # the donated state is held once
    return [step, state, arrays, out]


def timed_round(algorithm, step, state, arrays, round_index: int) -> tuple:
    """``(seconds, new state)`` of round ``round_index`` (0-based), run to completion."""
    import jax
    from bfedjax.core import layout
    from bfedjax.core.simulate import traced_hparams
    hp = traced_hparams(algorithm, round_index + 1)
    start = time.perf_counter()
    with layout.random_bits_lowering():  # as simulate runs its rounds (the loop backends compile on first calls)
        state, metrics = step(state, arrays, jax.random.PRNGKey(round_index), hp)
    jax.block_until_ready((state, metrics))
    return time.perf_counter() - start, state


def time_library(algorithm, fed, config: Config, backend: str, rounds: int, fixed_local_steps: bool = True,
                 client_devices: int = 1) -> dict:
    """One library configuration's ``{"compile_s", "round_s" (fastest), "median_round_s", ...}`` over ``rounds``
    timed rounds after a warm-up (``prepared_round``'s arguments and entries)."""
    return time_prepared(algorithm, prepared_round(algorithm, fed, config, backend, fixed_local_steps, client_devices),
                         rounds)


def time_prepared(algorithm, prepared: list, rounds: int) -> dict:
    """``time_library``'s dict for a prepared round (``[step, state, arrays, out]``, from ``prepared_round``), whose
    state advances in place: the list can go on to ``time_in_turn``."""
    times = []
    for r in range(rounds + 1):
        seconds, prepared[1] = timed_round(algorithm, prepared[0], prepared[1], prepared[2], r)
        times.append(seconds)
    out = dict(prepared[3])
    out["compile_s"] = times[0] + out.get("compile_only_s", 0.0)  # compile + first (warm-up) round
    out["round_s"] = min(times[1:])
    out["median_round_s"] = float(np.median(times[1:]))
    return out


def time_in_turn(rounds_of: dict, rounds: int) -> dict:
    """``{name: fastest round}`` of prepared rounds (``rounds_of``: ``{name: (algorithm, prepared_round's list)}``,
    e.g. two layouts of one algorithm, or two algorithms' default layouts), their rounds taken in turn (A, B, A,
    B, ...) after an untimed one each, so that a ratio of two of them is measured under one machine load: rows
    timed minutes apart on a shared 2-core machine drift by 5-10%, and a layout's rounds can run a third slower
    for seconds at a time. The states advance in place."""
    best = {}
    for r in range(rounds + 1):
        for name, (algorithm, prepared) in rounds_of.items():
            seconds, prepared[1] = timed_round(algorithm, prepared[0], prepared[1], prepared[2], r)
            if r:
                best[name] = min(best.get(name, seconds), seconds)
    return best


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


IN_TURN_ROUNDS = 10  # rounds of each side of a measurement in turn (alternated or paired rows; at least)


class Measured(NamedTuple):
    """One algorithm of a configuration, for its alternated rows: the algorithm, its default variant (e.g.
    ``vmap/c1x2``), and the aggregation's and the roofline's seconds."""
    algorithm: object
    default: str | None
    aggregation_s: float
    roofline_s: float


INPUT_SHAPES = {"mlp": (28, 28, 1), "fedreg_cnn": (28, 28, 1), "fola_cnn": (32, 32, 3), "resnet20": (32, 32, 3)}


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
    cpu_devices = bf.core.layout.use_cpu_cores(None if FLAGS.cpu_devices == "auto" else int(FLAGS.cpu_devices))
    time_compilations_afresh()
    if FLAGS.bfl_gradient_estimator not in bf.vi.GRADIENT_ESTIMATORS:
        raise app.UsageError(f"--bfl_gradient_estimator={FLAGS.bfl_gradient_estimator}; fix: use one of "
                             f"{', '.join(bf.vi.GRADIENT_ESTIMATORS)}")

    if FLAGS.matmul_conv_max_mib is not None:
        limits = bf.models.conv.MATMUL_CONV_MAX_BYTES
        limits[jax.default_backend()] = int(FLAGS.matmul_conv_max_mib * 2**20)
    if FLAGS.matmul_kernel_grad_max_mib is not None:
        limits = bf.models.conv.MATMUL_KERNEL_GRAD_MAX_BYTES
        limits[jax.default_backend()] = int(FLAGS.matmul_kernel_grad_max_mib * 2**20)
    if FLAGS.matmul_alone_conv_max_mib is not None:
        limits = bf.models.conv.ALONE_MATMUL_CONV_MAX_BYTES
        limits[jax.default_backend()] = int(FLAGS.matmul_alone_conv_max_mib * 2**20)
    if not FLAGS.winograd:
        bf.models.conv.WINOGRAD_TILES.pop(jax.default_backend(), None)
    bf.core.layout.GPU_THREEFRY_KERNEL = FLAGS.gpu_threefry_kernel
    rounds = FLAGS.rounds or 3
    rows, peak, bandwidth = (previous_rows(os.path.join(FLAGS.output_dir, "bench.json")) if FLAGS.resume
                             else ([], None, None))
    peak = peak or bench_anchors.matmul_peak_flops(dtype=FLAGS.compute_dtype)
    bandwidth = bandwidth or bench_anchors.memory_bandwidth_bytes_per_s()
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    machine = {"platform": device.platform, "device": str(device.device_kind), "cpu_count": os.cpu_count(),
               "processor": platform.processor() or platform.machine(), "jax": jax.__version__,
               **library_settings()}
    if on_cpu:  # the default layout's chunks depend on it (core.layout)
        machine["last_level_cache_mib"] = bf.core.layout.last_level_cache_bytes() / 2**20
    data = {shape: load_images(shape) for shape in {INPUT_SHAPES["mlp"]}}
    print(f"machine: {machine}; matmul peak {peak / 1e9:.1f} GFLOP/s; memory bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"data: {data[INPUT_SHAPES['mlp']].name}", flush=True)
    backends = list(FLAGS.backends)
    if any(b.startswith("torch") for b in backends) and not bench_torch.available():
        print("torch is not installed: skipping the PyTorch rounds (pip install -e '.[bench]')", flush=True)
        backends = [b for b in backends if not b.startswith("torch")]
    models, flops, param_counts = {}, {}, {}

    done = {(r["config"], r["algorithm"], r["backend"]) for r in rows}
    for config in configurations(FLAGS.quick):
        if (FLAGS.only and not any(s in config.name for s in FLAGS.only)) or (config.gpu_only and on_cpu):
            continue
        shape = INPUT_SHAPES[config.model]
        if shape not in data:
            data[shape] = load_images(shape)
        if config.model not in models:
            models[config.model] = bf.models.get_model(config.model, 10, hidden=(200, 200),
                                                       compute_dtype=FLAGS.compute_dtype)
            flops[config.model] = training_flops_per_sample(models[config.model], shape)
            param_counts[config.model] = sum(
                p.size for p in jax.tree.leaves(bf.models.zoo.init_params(models[config.model], shape,
                                                                          jax.random.PRNGKey(0))))
        model, flops_per_sample = models[config.model], flops[config.model]
        fed = federate(data[shape], config)
        real_samples = int(fed.counts.sum())
        steps = int(np.ceil(fed.counts / config.batch_size).sum())  # local steps of all clients in a round
        ratio = fed.padded_work_ratio(config.batch_size, config.clients_per_chunk)
        measured = {}  # name -> Measured
        kept = {}  # name -> {library variant: prepared round}: FedAvg's and FOLA's, for the rows in turn

        def compiled(name, algorithm, variant):
            """The kept prepared round of ``variant``, or a new one (a resumed run did not keep it)."""
            return kept[name].get(variant) or prepared_variant(algorithm, fed, config, variant)

        def record(result, name, backend, agg_s, roofline_s, default):
            library = backend.startswith(("vmap", ALTERNATED, PAIRED))
            result.update(config=config.name, algorithm=name, backend=backend, clients=fed.num_clients,
                          batch_size=config.batch_size, padded_work_ratio=ratio if library else 1.0,
                          default=backend == default)
            seconds = result.setdefault("round_s", None)  # None: compiled only (Config.compile_only)
            result.update(samples_per_s=None, gflops=None, aggregation_share=None, roofline_fraction=None,
                          peak_fraction=None)
            if seconds is not None:
                result.update(samples_per_s=real_samples / seconds,
                              gflops=real_samples * flops_per_sample / seconds / 1e9,
                              aggregation_share=agg_s / seconds if library else None,
                              roofline_fraction=roofline_s / seconds)
                result["peak_fraction"] = result["gflops"] * 1e9 / peak
            result["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append(result)
            if seconds is None:
                print(f"{config.name:38s} {name:7s} {backend:18s} compiled only: {result['compile_s']:.1f} s, "
                      f"{result.get('memory_mb', 0):.0f} MB", flush=True)
            else:
                print(f"{config.name:38s} {name:7s} {backend:18s} round {seconds:8.3f}s  "
                      f"{result['samples_per_s']:10.0f} samples/s  {result['gflops']:6.1f} GFLOP/s "
                      f"({100 * result['peak_fraction']:4.1f}% of peak, {100 * result['roofline_fraction']:4.1f}% of "
                      f"roofline){'  default' if result['default'] else ''}", flush=True)
            write_report(machine, peak, bandwidth, data[INPUT_SHAPES["mlp"]].name, rows)

        for name in [a for a in config.algorithms if a in FLAGS.algorithms]:
            algorithm = make_algorithm(name, model, fed, config.batch_size, FLAGS.bfl_gradient_estimator)
            agg_s = 0.0 if config.compile_only else time_aggregation(algorithm, fed)  # no round to share
            # a configuration that names its chunks has no default row
            default = default_variant(algorithm, fed, config) if not config.clients_per_chunk else None
            one_device = (default_variant(algorithm, fed, config, client_devices=1)  # what the split gains
                          if default and "x" in default and not FLAGS.quick else None)
            # bfl and fedreg move more than FedAvg per step: counting them as FedAvg gives a lower bound
            traffic = bench_anchors.round_traffic_bytes(param_counts[config.model], 1, steps,
                                                        name if name == "fola" else "fedavg")
            roofline_s = bench_anchors.roofline_seconds(real_samples * flops_per_sample, traffic, peak, bandwidth)
            measured[name] = Measured(algorithm, default, agg_s, roofline_s)
            # quick mode: one timed round of the variational and FedReg clients (no target reads them)
            timed_rounds = FLAGS.rounds or (1 if FLAGS.quick and name not in bench_torch.ALGORITHMS
                                            else config.rounds or rounds)
            kept[name] = {}  # only the default and the fastest other variant so far stay compiled
            for backend in variants_of(config, name, backends, on_cpu, default, cpu_devices if on_cpu else 1,
                                       one_device):
                if (config.name, name, backend) not in done:
                    record(measure(backend, algorithm, fed, config, name, model, timed_rounds,
                                   kept[name] if default and name in bench_torch.ALGORITHMS else None),
                           name, backend, agg_s, roofline_s, default)
                    other = fastest_other_variant(rows, config.name, name, default)
                    kept[name] = {v: p for v, p in kept[name].items() if v in (default, other)}
            other = fastest_other_variant(rows, config.name, name, default)
            if (other and name in bench_torch.ALGORITHMS
                    and not any(c == config.name and a == name and b.startswith(PAIRED) for c, a, b in done)):
                # the default / fastest variant target: the two layouts' rounds in turn, under one machine load
                best = time_in_turn({v: (algorithm, compiled(name, algorithm, v)) for v in (default, other)},
                                    max(timed_rounds, IN_TURN_ROUNDS))
                for v in (default, other):
                    record({"round_s": best[v]}, name, f"{PAIRED} {v}", agg_s, roofline_s, None)
            kept[name] = {v: p for v, p in kept[name].items() if v == default}  # the alternated rows' below
        pair = ("fedavg", "fola")
        if (config.name in ALTERNATED_CONFIGS and all(n in measured and measured[n].default for n in pair)
                and "vmap" in backends and not any(c == config.name and b.startswith(ALTERNATED) for c, _, b in done)):
            # FOLA / FedAvg's target: their default layouts' rounds in turn, the ratio under one machine load
            rounds_of = {n: (measured[n].algorithm, compiled(n, measured[n].algorithm, measured[n].default))
                         for n in pair}
            best = time_in_turn(rounds_of, max(FLAGS.rounds or rounds, IN_TURN_ROUNDS))
            for n in pair:
                m = measured[n]
                record({"round_s": best[n]}, n, f"{ALTERNATED} {m.default}", m.aggregation_s, m.roofline_s, None)
    print("\n" + write_report(machine, peak, bandwidth, data[INPUT_SHAPES["mlp"]].name, rows))


def measure(backend: str, algorithm, fed, config: Config, name: str, model, rounds: int,
            kept: dict | None = None) -> dict:
    """``{"round_s": best round, "compile_s": first round (compile + run), ...}`` of one backend (with
    ``config.compile_only``: the library's ``compile_s`` is the compilation alone, and no ``round_s``); ``kept``: a dict
    that receives a library variant's (``vmap``, ``vmap/cN``, ``vmap/cNxD``) prepared round under its name, its
    state as the timed rounds left it, for ``time_in_turn``."""
    torch_options = dict(algorithm=name, model=config.model, hidden=(200, 200), batch_size=config.batch_size,
                         rounds=rounds + 1)
    if backend == "torch":
        times = bench_torch.time_rounds(fed, **torch_options)
    elif backend.startswith("torch.func"):
        times = bench_torch.time_func_rounds(fed, compiled=backend.endswith("+compile"), **torch_options)
    elif backend == "centralised":
        first, best = bench_anchors.centralised_round_seconds(model, fed, config.batch_size, rounds=rounds)
        return {"compile_s": first, "round_s": best}
    else:
        prepared = prepared_variant(algorithm, fed, config, backend)
        if config.compile_only:  # the compiled round's memory analysis and compile time; no round run
            return {**prepared[3], "compile_s": prepared[3]["compile_only_s"]}
        if kept is not None and backend.startswith("vmap"):  # for the rows in turn
            kept[backend] = prepared
        return time_prepared(algorithm, prepared, rounds)
    return {"compile_s": times[0], "round_s": min(times[1:])}


def library_layout(backend: str, fed, config: Config) -> tuple:
    """``(config, backend, client_devices)`` that ``time_library`` runs a library variant (``vmap``, ``vmap/cN``,
    ``vmap/cNxD``, ``stepwise``, ...) with."""
    if backend.startswith("vmap/c"):
        chunk, _, devices = backend[len("vmap/c"):].partition("x")
        return dataclasses.replace(config, clients_per_chunk=int(chunk)), "vmap", int(devices or 1)
    if backend == "vmap" and config.clients_per_chunk:  # named chunks: split over the devices as simulate would
        return config, backend, default_devices(fed, config.clients_per_chunk)
    return config, backend, 1


def prepared_variant(algorithm, fed, config: Config, variant: str) -> list:
    """``prepared_round`` of a library variant (``vmap``, ``vmap/cN``, ``vmap/cNxD``)."""
    layout_config, backend, devices = library_layout(variant, fed, config)
    return prepared_round(algorithm, fed, layout_config, backend, FLAGS.fixed_local_steps, devices)


def fastest_other_variant(rows, config_name: str, algorithm: str, default: str | None) -> str | None:
    """The library variant other than ``default`` with the fastest row of ``config_name`` and ``algorithm`` (None
    if there is no default or no other variant)."""
    others = [r for r in rows if r["config"] == config_name and r["algorithm"] == algorithm
              and r["backend"].startswith("vmap") and r["backend"] != default and r["round_s"] is not None]
    return min(others, key=lambda r: r["round_s"])["backend"] if default and others else None


def default_variant(algorithm, fed, config: Config, client_devices="auto") -> str:
    """The library variant ``simulate`` runs with ``client_devices`` (default: its own choice) and its
    automatic chunks: ``vmap``, ``vmap/cN`` or ``vmap/cNxD``."""
    import jax
    from bfedjax.core import RoundConfig, init_state, with_client_devices
    from bfedjax.core.simulate import auto_layout, round_arrays
    round_config = RoundConfig(fed.num_clients, fed.num_clients, evaluate_local=False)
    state = init_state(algorithm, algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape), round_config)
    chunk = auto_layout(algorithm, round_config, state, round_arrays(fed), client_devices)
    round_config = with_client_devices(dataclasses.replace(round_config, clients_per_chunk=chunk), client_devices)
    chunk, devices = round_config.clients_per_chunk, round_config.client_devices
    if devices > 1:
        return f"vmap/c{chunk}x{devices}"
    return "vmap" if chunk is None or chunk >= fed.num_clients else f"vmap/c{chunk}"


def default_devices(fed, clients_per_chunk: int) -> int:
    """The devices ``simulate`` splits a cohort of the whole federation in chunks of ``clients_per_chunk`` over."""
    from bfedjax.core import RoundConfig, with_client_devices
    config = RoundConfig(fed.num_clients, fed.num_clients, clients_per_chunk=clients_per_chunk)
    return with_client_devices(config).client_devices


def previous_rows(path: str) -> tuple[list[dict], float | None, float | None]:
    """Rows, matmul peak (FLOP/s) and memory bandwidth (bytes/s) of an earlier run on this device, for --resume."""
    import jax
    if not os.path.exists(path):
        return [], None, None
    with open(path) as f:
        report = json.load(f)
    kind = str(jax.devices()[0].device_kind)
    if report["machine"]["device"] != kind:
        raise app.UsageError(f"--resume: {path} was measured on {report['machine']['device']!r}, this is {kind!r}; "
                             "fix: pass another --output_dir or drop --resume")
    changed = changed_setting(report["machine"], library_settings())  # the library rows need the stored settings
    if changed is not None:
        name, stored = changed
        also = " (with JAX_THREEFRY_GPU_KERNEL_LOWERING unset)" if name == "gpu_threefry_kernel" and not stored else ""
        raise app.UsageError(f"--resume: {path} was measured with {_as_flag(name, stored)}; fix: pass "
                             f"{_as_flag(name, stored)}{also}, another --output_dir, or drop --resume")
    print(f"resuming: {len(report['rows'])} rows kept from {path}", flush=True)
    bandwidth = report.get("memory_gb_per_s")  # absent in reports from before the roofline column
    return report["rows"], report["matmul_peak_gflops"] * 1e9, bandwidth * 1e9 if bandwidth else None


def library_settings() -> dict:
    """The flags that change the library's rows, as ``bench.json``'s machine entry records them."""
    import jax
    import bfedjax as bf
    platform = jax.devices()[0].platform
    cpu = {"cpu_devices": len(jax.devices())} if platform == "cpu" else {}  # the default layouts depend on it
    gpu = {}
    if platform == "gpu":  # the setting in effect in the rounds' context (JAX_THREEFRY_GPU_KERNEL_LOWERING too)
        with bf.core.layout.random_bits_lowering():
            gpu["gpu_threefry_kernel"] = bool(jax.config.jax_threefry_gpu_kernel_lowering)
    return {**cpu, **gpu, "compute_dtype": FLAGS.compute_dtype, "bfl_gradient_estimator": FLAGS.bfl_gradient_estimator,
            "fixed_local_steps": FLAGS.fixed_local_steps,
            "matmul_conv_max_mib": bf.models.conv.MATMUL_CONV_MAX_BYTES.get(platform, 0) / 2**20,
            "matmul_kernel_grad_max_mib": bf.models.conv.MATMUL_KERNEL_GRAD_MAX_BYTES.get(platform, 0) / 2**20,
            "matmul_alone_conv_max_mib": bf.models.conv.ALONE_MATMUL_CONV_MAX_BYTES.get(
                platform, bf.models.conv.MATMUL_CONV_MAX_BYTES.get(platform, 0)) / 2**20,
            "winograd_tiles": {str(r): m for r, m in bf.models.conv.WINOGRAD_TILES.get(platform, {}).items()}}


def _as_flag(name: str, value) -> str:
    if name == "winograd_tiles":  # recorded as the table, set by --winograd
        return "--winograd" if value else "--nowinograd"
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no{name}"
    return f"--{name}={value:g}" if isinstance(value, float) else f"--{name}={value}"


def write_report(machine: dict, peak: float, bandwidth: float, data_name: str, rows: list[dict]) -> str:
    """Writes bench.json and bench.md for the rows so far into --output_dir; returns the markdown."""
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    report = {"machine": machine, "matmul_peak_gflops": peak / 1e9, "memory_gb_per_s": bandwidth / 1e9,
              "data": data_name, "rows": rows,
              "targets": check_targets(rows, machine["platform"])}
    with open(os.path.join(FLAGS.output_dir, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(FLAGS.output_dir, "bench.md"), "w") as f:
        f.write(text)
    return text


def variants_of(config: Config, algorithm: str, backends: list[str], on_cpu: bool = True,
                default: str | None = "vmap", devices: int = 1, one_device: str | None = None) -> list[str]:
    """The backends timed for one configuration and algorithm: library variants (chunked ones on a CPU, split
    over ``devices`` when several, always the ``default`` layout and ``one_device``, the layout ``simulate``
    picks on one device) first, then the references."""
    sizes = config.chunks or FLAGS.cpu_chunks
    sizes = sizes if sizes is not None else QUICK_CHUNKS if FLAGS.quick else ALL_CHUNKS
    chunks = [int(c) for c in sizes if int(c) < config.num_clients] if on_cpu else []
    if FLAGS.quick and algorithm not in bench_torch.ALGORITHMS:
        chunks = [c for c in chunks if c == 1]  # variational / FedReg: compiles take minutes; c1 only
    library = []
    if "vmap" in backends:
        library = ["vmap"]
        if config.partition == "uniform" and not config.clients_per_chunk:
            split = devices if devices > 1 else None  # with several devices the chunks run split over them
            library += [f"vmap/c{c}x{split}" if split else f"vmap/c{c}" for c in chunks
                        if not split or -(-config.num_clients // c) >= split]
        if default is not None and default not in library:
            library.append(default)
        if one_device and one_device not in library:
            library.append(one_device)
    references = [b for b in backends if not b.startswith("vmap")]
    if config.library_only:
        references = []
    if config.clients_per_chunk or algorithm not in bench_torch.ALGORITHMS:
        references = [b for b in references if not b.startswith("torch")]  # the papers' FedAvg and FOLA loops
    if not config.anchors or config.clients_per_chunk or (algorithm != config.algorithms[0]):
        # the anchors time the first algorithm of a configuration (FedAvg; FOLA on FOLA's CNN)
        references = [b for b in references if not b.startswith("torch.func") and b != "centralised"]
    return [b for b in library + references if b == default or not (on_cpu and (algorithm, b) in config.cpu_skip)]


if __name__ == "__main__":
    errors.run(main, interrupted="rerun it with --resume to keep the rows measured so far")
