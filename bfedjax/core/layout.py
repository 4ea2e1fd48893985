"""The round's layout when the user does not name one: how many clients train at once.

``simulate(..., clients_per_chunk="auto")`` (the default) asks ``auto_clients_per_chunk``,
which decides from the platform, the model's parameters and the cohort, before anything
is traced:

* **CPU, a model with convolutions**: 1, the cohort's clients one after another
  inside the jitted round. Under a client vmap every convolution becomes a grouped
  convolution, which XLA:CPU runs 3-6x slower than its plain NHWC kernels
  (``python -m experiments.bench``: FedReg's CNN, ``vmap`` against ``vmap/c1``).
* **CPU, dense models**: chunks whose training state fits in ``CHUNK_STATE_BYTES``
  or the last-level cache if smaller, of the size ``cheapest_chunk`` estimates cheapest
  (padding against per-chunk overhead). A client's training state is its local state
  (the algorithm's ``client_init``: weights, plus FOLA's Fisher or BFL's scales and Adam
  moments), ``WORKING_COPIES`` model-sized working copies (the gradient and the updated
  weights) and its persistent state; the server state is read by every client of a chunk
  and not counted per client (nor the gradients of a client's other trained state, such as
  BFL's scales or HBFL's local models: the rule is a heuristic, checked by the bench's
  ``default`` rows). One vmap over 100 MLP clients streams 80 MB of weights per step from
  memory; chunks of about 32 MiB of state (784-200-200-10 MLP: 10 FedAvg, FOLA or FedReg
  clients, 5 BFL clients) run a FedAvg or FOLA round 1.5-1.8x faster than one vmap on a
  2-core VM (``results/bench/bench.md``). That VM reports its host's 480 MiB L3, most of
  it other tenants', and the earlier rule, a quarter of the reported cache, gave chunks of
  39 and 19 there, 1.3-1.4x slower than the fastest chunks (``python -m experiments.bench
  --only="mlp K=100" --cpu_chunks=1,2,5`` at 73508be). Counting four copies of the whole
  server state instead gave FOLA (whose server also holds the precision) chunks of 5,
  1.04-1.17x slower than chunks of 10 or one vmap (``results/bench/CHANGES.md``).
* **CPU with several devices** (``use_cpu_cores``: one XLA device per core): the cohort
  split over the devices (``auto_client_devices``; ``RoundConfig.client_devices``), each
  device training its clients one after another (chunks of 1, dense models too). XLA:CPU
  runs one client's small kernels mostly on one core (a FedReg-CNN step, and its
  convolutions alone, take the same time with the Eigen thread pool switched off); a device
  per core keeps every core busy, and there a vmap over a device's clients no longer pays:
  on 2 cores the bench's MLP FedAvg round at K = 100, B = 10 took 0.121 s in chunks of 1 per
  device against 0.167 s in chunks of 10 per device and 0.233 s in chunks of 10 on one
  device (``results/bench/CHANGES.md``).
* **GPU/TPU**: one vmap over the whole cohort (the padded work runs in
  parallel), or chunks when every client's training state would not fit in
  ``MEMORY_SHARE`` of the device's memory.

Not a layout but chosen by platform as well: on a GPU, ``simulate`` lowers its rounds with
JAX's threefry kernel (``random_bits_lowering``), which halved the compile time of a variational
ResNet-20 round on an H100.

Only the float rounding of the result depends on the layout (the engine sorts the
cohort by size and masks the padding either way), so a run can be resumed under
another layout. ``experiments.bench`` times the choice as its ``default`` rows
against every variant.
"""
from __future__ import annotations

import contextlib
import functools
import os

import jax
import numpy as np
from jax._src import config as jax_config  # the scoped form of jax_threefry_gpu_kernel_lowering

AUTO = "auto"
# Per-client working set beyond its local state: this many copies of the model (the gradient and the
# updated weights).
WORKING_COPIES = 2
# CPU: a chunk's working set within this many bytes, or the last-level cache if smaller. Not a share of
# the cache alone: a VM reports its host socket's whole cache, which its few cores share with others.
CHUNK_STATE_BYTES = 32 * 2**20
# A chunk's fixed cost (loop step, gathers, smaller products) in clients' work: FedAvg, MLP, K = 100,
# B = 10 (results/bench/bench.md) took 0.359 s in chunks of 1, 0.298 s of 5 and 0.256 s of 10, about
# 2.4 ms per client slot and 1.2 ms per chunk.
CHUNK_OVERHEAD_CLIENTS = 0.5
MEMORY_SHARE = 0.25     # accelerators: chunk only when the cohort's state exceeds this share of memory
# A CPU split into devices holds the round's data and state once per device: at most this share of the RAM.
REPLICA_MEMORY_SHARE = 0.5
DEFAULT_CACHE_BYTES = 8 * 2**20
# GPU: lower random bits with JAX's threefry kernel (``jax_threefry_gpu_kernel_lowering``: one kernel per draw)
# rather than the threefry hash written out in XLA operations, thousands of them per local step of a
# variational client (NumPyro splits a key at every sample site), which XLA's fusion passes and its kernel
# compiler then work through. JAX computes the same threefry function either way. NVIDIA H100, the
# variational ResNet-20 round (10 clients, B = 32, Flipout): compile 45.5 -> 21.4 s, round 66.5 -> 69 ms
# (results/bench/gpu_h100_session14, with JAX_THREEFRY_GPU_KERNEL_LOWERING=1). False: JAX's own setting.
GPU_THREEFRY_KERNEL = True
# Accelerators: a fixed-step epoch of at most UNROLL_MAX_STEPS steps runs unrolled when one local step
# traces to at most UNROLL_MAX_STEP_OPERATIONS jaxpr equations (``jaxpr_operations``), i.e. its steps
# are a few launch-bound kernels and the unrolled epoch stays cheap to compile. On an H100, 10 steps
# (results/bench/gpu_h100_targets/README.md; median of 20 rounds, K = 100, B = 10): FOLA MLP (274
# operations) 6.18 -> 4.19 ms, FOLA CIFAR CNN (524) 40.9 -> 32.6 ms, FedAvg MLP (186) 3.49 -> 3.30 ms,
# FedAvg FedReg CNN (479) 40.5 -> 41.0 ms; a BFL MLP (887, random draws) compiled in 62 s unrolled
# against 7.5 s as a loop, for no faster round. Counts: a step traced for a GPU, jax 0.10.2 (a JAX
# version moves them by a few); FedReg's MLP client (566) and FOLA on FedReg's CNN (623) keep the loop.
UNROLL_MAX_STEPS = 16
UNROLL_MAX_STEP_OPERATIONS = 550


def random_bits_lowering(sharded: bool = False) -> contextlib.AbstractContextManager:
    """The context ``simulate`` runs its rounds in (``experiments.bench`` and the Flower client and strategy
    their jitted stages too): on a GPU, with ``GPU_THREEFRY_KERNEL``, JAX's threefry kernel for random bits;
    elsewhere, or for rounds ``sharded`` over a mesh (the kernel is a custom call XLA's partitioner cannot
    split; not measured), JAX's own setting. JAX reads the setting when it lowers a function (a round's first
    call) and keys its compiled functions by it: the same round called outside the context compiles again."""
    setting = getattr(jax_config, "threefry_gpu_kernel_lowering", None)
    if not GPU_THREEFRY_KERNEL or sharded or setting is None or jax.default_backend() != "gpu":
        return contextlib.nullcontext()
    return setting(True)


def auto_clients_per_chunk(*, convolutional: bool, model_bytes: int, local_state_bytes: int,
                           persistent_bytes_per_client: float, cohort: int, platform: str,
                           device_memory_bytes: int | None = None, cache_bytes: int | None = None,
                           devices: int = 1) -> int | None:
    """Clients per chunk for a round (``None``: the whole cohort in one vmap).

    Args:
      convolutional: whether a client trains a convolutional model (``has_conv_kernels``).
      model_bytes: bytes of the global model (``Algorithm.global_params``).
      local_state_bytes: bytes of one client's local training state (``Algorithm.client_init``'s output;
        the largest over architecture groups).
      persistent_bytes_per_client: bytes of one client's persistent state (0 for most algorithms).
      cohort: K, clients per round.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      device_memory_bytes: the accelerator's memory (``None``: unknown, never chunk).
      cache_bytes: the CPU's last-level cache (``None``: read from the OS, else 8 MiB).
      devices: the devices the round may split its chunks over (``auto_client_devices``): a CPU split into
        several trains each device's clients one after another (1).
    """
    client_bytes = local_state_bytes + WORKING_COPIES * model_bytes + persistent_bytes_per_client
    if platform == "cpu":
        if convolutional or devices > 1:
            return 1
        budget = min(CHUNK_STATE_BYTES, cache_bytes or last_level_cache_bytes())
        chunk = cheapest_chunk(cohort, int(max(1, budget // client_bytes)))
        return None if chunk >= cohort else chunk  # the whole cohort fits: one vmap
    if device_memory_bytes is None or cohort * client_bytes <= MEMORY_SHARE * device_memory_bytes:
        return None
    return cheapest_chunk(cohort, int(max(1, MEMORY_SHARE * device_memory_bytes // client_bytes)))


def auto_unroll_local_steps(*, platform: str, steps_per_epoch: int, step_operations) -> int:
    """Local steps per iteration of the fixed-step epoch scan (``RoundConfig.unroll_local_steps``): the whole
    epoch on an accelerator when it is short (``UNROLL_MAX_STEPS``) and one step small
    (``step_operations()``, its jaxpr equations, at most ``UNROLL_MAX_STEP_OPERATIONS``); else 1.
    ``step_operations`` is a callable, traced only when the other two allow unrolling."""
    if platform == "cpu" or steps_per_epoch > UNROLL_MAX_STEPS or steps_per_epoch < 2:
        return 1
    return steps_per_epoch if step_operations() <= UNROLL_MAX_STEP_OPERATIONS else 1


def fixed_steps_scan(*, platform: str, unroll: int | None) -> bool:
    """Whether a fixed-step epoch (``RoundConfig.fixed_local_steps``) runs as a ``lax.scan`` of exactly its
    steps, an empty client skipped by a ``lax.cond``, rather than the ``lax.while_loop`` that tests every step.

    The scan on an accelerator, where the loop's test is a host round trip per step, and wherever steps are
    unrolled (``unroll`` > 1). The loop on a CPU: its test costs nothing there, while the cond keeps XLA from
    hoisting what a step computes from the server state alone (FOLA's prior weights ``lam * S / r``) out of
    the loop over clients: the branch recomputes it, and copies the server arrays it reads, once per client.
    """
    return platform != "cpu" or (unroll or 1) > 1


def jaxpr_operations(jaxpr) -> int:
    """Equations of a (closed) jaxpr, counting those of the jaxprs nested in its equations' parameters
    (``jit``, ``custom_vjp``, ``cond`` and loop bodies) too."""
    from jax.extend import core as jex_core
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(1 + sum(jaxpr_operations(sub) for sub in jex_core.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)


def auto_client_devices(*, platform: str, local_devices: int, clients_per_chunk: int | None, cohort: int,
                        replicated_bytes: int = 0, memory_bytes: int | None = None) -> int:
    """Devices to split the cohort's chunks over (``RoundConfig.client_devices``): on a CPU every local
    device (``use_cpu_cores``), at most one per chunk, and only as many as hold a copy each of the
    ``replicated_bytes`` (the round's data and state) in ``REPLICA_MEMORY_SHARE`` of ``memory_bytes``
    (default: the machine's RAM); 1 elsewhere (an accelerator trains a chunk's clients in parallel itself;
    several accelerators take ``simulate(mesh=...)``)."""
    if platform != "cpu" or local_devices < 2:
        return 1
    chunks = cohort if clients_per_chunk is None else -(-cohort // clients_per_chunk)
    devices = min(local_devices, chunks)
    if replicated_bytes > 0:
        memory = memory_bytes or physical_memory_bytes()
        devices = min(devices, int(REPLICA_MEMORY_SHARE * memory // replicated_bytes))
    return max(1, devices)


def physical_memory_bytes() -> int:
    """The machine's RAM (``os.sysconf``), else 8 GiB where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30


def use_cpu_cores(devices: int | None = None) -> int:
    """Lets JAX's CPU backend show ``devices`` devices (default: this process's usable cores), so that
    ``simulate`` trains clients on every core (``auto_client_devices``). Call it before JAX's first
    computation (``experiments.run`` does, from ``--cpu_devices``); afterwards the device count is
    fixed and this raises. Arrays and computations not placed otherwise stay on device 0. Returns the count."""
    count = int(devices) if devices is not None else usable_cores()
    if count < 1:
        raise ValueError(f"use_cpu_cores({devices}); fix: give a device count >= 1")
    if jax_started():
        if len(jax.devices("cpu")) == count:
            return count
        raise RuntimeError(f"use_cpu_cores({count}) after JAX's first computation; fix: call it first (right after "
                           "the imports), or leave the CPU as one device")
    jax.config.update("jax_num_cpu_devices", count)
    return count


def jax_started() -> bool:
    """Whether JAX's backends exist yet (after them the CPU's device count is fixed)."""
    from jax._src import xla_bridge  # no public API says
    return xla_bridge.backends_are_initialized()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cheapest_chunk(cohort: int, largest: int) -> int:
    """The chunk size in ``[1, largest]`` (capped at the cohort) with the least estimated round work:
    ``ceil(cohort / c)`` chunks, each costing its ``c`` client slots (padding included) plus
    ``CHUNK_OVERHEAD_CLIENTS`` (the larger on a tie). 100 clients with room for 7 run in chunks of 5
    (20 x 5.5) rather than 7 (15 x 7.5: the last chunk mostly padding that still computes)."""
    largest = max(1, min(largest, cohort))
    return min(range(1, largest + 1), key=lambda c: (-(-cohort // c) * (c + CHUNK_OVERHEAD_CLIENTS), -c))


def has_conv_kernels(params, persistent=()) -> bool:
    """Whether the model is convolutional: a ``*kernel*`` leaf of 4 dimensions (``[H, W, I, O]``) in the
    global parameters, or of 5 (``[N_group, H, W, I, O]``) in the clients' persistent state (the
    local models of architecture groups)."""
    def found(tree, ndim):
        return any(leaf.ndim >= ndim and "kernel" in str(getattr(path[-1], "key", path[-1]))
                   for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if path)
    return found(params, 4) or found(persistent, 5)


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (``/sys/devices/system/cpu/cpu0/cache``), else 8 MiB."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    for entry in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip().upper()
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):  # not a cache entry (e.g. uevent)
            continue
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def device_memory_bytes(device) -> int | None:
    """The device's memory limit from ``memory_stats()`` (``None`` on a CPU or when unreported)."""
    try:
        stats = device.memory_stats() or {}
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return stats.get("bytes_limit")


def tree_bytes(tree) -> int:
    return int(sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))
