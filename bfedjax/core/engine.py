"""The round engine: one federated round as one jitted function.

``make_round_step(algorithm, config)`` returns

    round_step(state, arrays, key, hparams) -> (state, metrics)

which samples a cohort, runs every cohort client's local training under
``jax.vmap`` (local steps under ``lax.scan``; cohorts split into chunks of
``clients_per_chunk`` clients run one chunk after another under ``lax.map``),
aggregates, and calls the algorithm's evaluate hook, all inside one
``jax.jit``. ``hparams`` (round index, learning rate, ...) are traced, so
changing them never recompiles. The engine knows no method and no task.

The cohort is ``ids [Kp]`` (client indices; ``N`` marks a padding slot),
``mask [Kp]`` (1 for a real client), ``weights [Kp]`` (the real clients'
share of the aggregate, renormalised to sum to 1) and ``total []`` (the
cohort's share of the federation's base weight, sum_{n in A} pi_n; 1 when
every client takes part at its base weight and none is dropped), which the aggregation reads as
``hparams["cohort_weight"]`` (FOLA's ``fixed_pi``). A padding slot never
trains on data, never counts in an aggregate or a metric, and never writes persistent state. Sampling draws
among the federation's real clients whatever their weights; a round whose
real clients all weigh zero keeps the server state (their persistent state
still moves).

Parallel devices: ``RoundConfig.client_devices = D > 1`` runs the round under ``shard_map`` on
the first ``D`` local devices (``client_device_mesh``), the data and the server state replicated
on each: every device samples the same cohort, trains every ``D``-th of the cohort's size-sorted
chunks, and the per-device results meet in one all-reduce (the streamed sums, each client's new
persistent rows) or all-gather (the messages of a non-streaming aggregation); the aggregation
then runs on every device alike. On a CPU each device is a core (``core.layout.use_cpu_cores``),
so clients train on every core, where XLA:CPU runs one client's small kernels mostly on one.

Architecture groups: ``RoundConfig.client_groups`` maps every client to a
group (an architecture: HBFL's local models, a personalised head). A group's
persistent state is its own pytree ``[N_group, ...]``; the cohort's clients of
one group are gathered into that group's slots and trained under one vmap, and
every group of the round runs inside the same jitted step. Messages must have
one structure across groups (the shared part); they are merged back into the
cohort's ``[Kp]`` order for the aggregation. With one group (the default) this
is the plain round.

Stragglers: ``RoundConfig.straggler_fraction`` makes that fraction of the
federation's clients, drawn afresh each round from the round key (so every
algorithm sees the same draw at a given seed), train ``x ~ U{1..E}`` epochs
instead of E; the engine runs each client under a step budget
(``Cohort.budgets``).

Nested round subsets (FedRef's MNIST/DRIVE protocol): with
``RoundConfig.round_fractions`` every client draws a fraction ``f`` from that
tuple each round (from the round key, so every algorithm sees the same draw at
a given seed) and trains on the first ``round(f * n_k)`` rows of its data; its
weight is scaled by ``f``, so by-size weights become the subset sizes. With the
``nested`` partition (every client holds the same seeded permutation of the
training set) the subsets are nested, overlapping prefixes redrawn every round.

Backends: ``vmap`` (the library), ``sequential`` (one jitted call per client,
the reference the tests compare with), ``stepwise`` (a Python loop over
clients and batches with one jitted step per batch, FedJAX's design and the
baseline of ``experiments/bench.py``) and ``debug`` (the stepwise loop with jit
off: an exception or a non-finite output is reported with the client and the
stage, init / step / final / server / evaluate, where it happened).

Modules: this one builds the vmapped round (chunks, streaming, devices) and
dispatches ``make_round_step``'s backends; ``round_config`` holds
``RoundConfig``, ``RoundArrays``, ``EngineState`` and ``init_state``;
``sampling`` the cohort (sampling, stragglers, round subsets, architecture
groups, the server's key); ``client_half`` one client's inputs, local
training and persistent rows; ``finite`` the non-finite check;
``server_half`` the attack, the non-finite drop and the aggregation
(``finish_round``); ``round_metrics`` the round's record;
``reference_backends`` the sequential, stepwise and debug backends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.core.client_half import group_rows, run_one_client, scatter_persistent
from bfedjax.core.finite import finite_rows, zero_rows
from bfedjax.core.reference_backends import debug_round, sequential_round, stepwise_round
from bfedjax.core.round_config import EngineState, RoundConfig
from bfedjax.core.round_metrics import client_metric_sums, local_metric_sums, round_record
from bfedjax.core.sampling import group_cohorts, merge_groups, sample_cohort, server_key_of, with_round_subsets
from bfedjax.core.server_half import aggregation_hparams, attacked, finish_round
from bfedjax.core.types import Algorithm, ClientData
from bfedjax.tree import weighted_sum

BACKENDS = ("vmap", "sequential", "stepwise", "debug")
PARALLEL_AXIS = "client_devices"  # the mesh axis of RoundConfig.client_devices


def _streamed_group(algorithm, config, state, arrays, sub, train, persistent, group, hparams):
    """One group's chunks under ``lax.scan`` into running sums of ``(client_stats, client metrics,
    local metrics, (kept weight, dropped clients, first dropped id))``; non-finite clients drop out."""
    chunk = config.clients_per_chunk
    n_chunks = sub.ids.shape[0] // chunk
    split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
    chunks = tuple(split(a) for a in (sub.ids, sub.mask, sub.weights, sub.keys, sub.budgets))

    def chunk_sums(ids, mask, w, keys, budgets):
        messages, new_persistent, client_metrics = train(ids, keys, budgets)
        messages = attacked(algorithm, config, state, arrays, ids, keys, messages)
        finite = finite_rows((messages, new_persistent), chunk)
        bad = (mask > 0) & ~finite
        mask, w = jnp.where(bad, 0.0, mask), jnp.where(bad, 0.0, w)
        # the statistics' rows are zeroed rather than the messages', so the select fuses into the running sum
        stats = zero_rows(jax.vmap(algorithm.client_stats)(messages), finite)
        messages = zero_rows(messages, finite)  # for the local metrics only
        dropped = (jnp.sum(w), jnp.sum(bad).astype(jnp.float32),
                   jnp.min(jnp.where(bad, ids, jnp.iinfo(jnp.int32).max)))
        sums = (weighted_sum(stats, w),
                client_metric_sums(client_metrics, mask),
                local_metric_sums(algorithm, config, arrays, messages, w, mask, hparams), dropped)
        return sums, (new_persistent, mask)

    shapes = jax.eval_shape(lambda: chunk_sums(*(c[0] for c in chunks))[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = zeros[:3] + ((zeros[3][0], zeros[3][1], jnp.int32(jnp.iinfo(jnp.int32).max)),)

    def add(total, new):
        (kept, count, first), (new_kept, new_count, new_first) = total[3], new[3]
        return jax.tree.map(jnp.add, total[:3], new[:3]) + ((kept + new_kept, count + new_count,
                                                            jnp.minimum(first, new_first)),)

    def body(carry, xs):
        sums, persistent = carry
        new_sums, (new_persistent, kept) = chunk_sums(*xs)
        persistent = scatter_persistent(persistent, group_rows(config, xs[0], group), kept, new_persistent)
        return (add(sums, new_sums), persistent), None

    if config.client_devices == 1:
        (sums, persistent), _ = jax.lax.scan(body, (zeros, persistent), chunks)
        return sums, persistent, add
    mine = _device_share(chunks, config.client_devices)
    (sums, new_persistent), _ = jax.lax.scan(body, (zeros, persistent), mine)
    (kept, count, first) = sums[3]
    sums = jax.lax.psum((sums[:3], kept, count), PARALLEL_AXIS)
    sums = sums[0] + ((sums[1], sums[2], jax.lax.pmin(first, PARALLEL_AXIS)),)
    written = _written_rows(config, persistent, mine[0], mine[1], group)
    return sums, _merge_persistent(persistent, new_persistent, written), add


def _device_share(chunks, devices: int):
    """This device's chunks, ``[n_chunks, ...] -> [n_chunks / devices, ...]``: every ``devices``-th chunk from its
    index on (the cohort is sorted by size, so the devices' shares are alike)."""
    me = jax.lax.axis_index(PARALLEL_AXIS)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a.reshape((-1, devices) + a.shape[1:]), me, axis=1,
                                                               keepdims=False), chunks)


def _gathered_shares(per_device):
    """Every device's ``_device_share`` outputs ``[n_chunks / D, ...]`` on every device, in chunk order
    ``[n_chunks, ...]``."""
    everyone = jax.lax.all_gather(per_device, PARALLEL_AXIS)  # [D, n_chunks / D, ...]
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:]), everyone)


def _written_rows(config, persistent, ids, mask, group: int):
    """``[N_group]`` bool: the persistent rows this device's real clients (``ids``, ``mask``: any shape) own."""
    if not jax.tree.leaves(persistent):
        return None
    rows = jax.tree.leaves(persistent)[0].shape[0]
    owned = jnp.where(mask.reshape(-1) > 0, group_rows(config, ids.reshape(-1), group), rows)
    return jnp.zeros((rows,), bool).at[owned].set(True, mode="drop")


def _merge_persistent(old, new, written):
    """Every device's copy of the persistent state with every device's written rows: each row comes from
    the one device that trained its client (an all-reduce of it and zeros, so exactly), else stays ``old``."""
    if written is None:
        return old
    anyone = jax.lax.psum(written.astype(jnp.int32), PARALLEL_AXIS) > 0

    def merge(o, n):
        shape = (-1,) + (1,) * (o.ndim - 1)
        exact = n.astype(jnp.int32) if n.dtype == jnp.bool_ else n
        ours = jax.lax.psum(jnp.where(written.reshape(shape), exact, jnp.zeros_like(exact)), PARALLEL_AXIS)
        return jnp.where(anyone.reshape(shape), ours.astype(o.dtype), o)

    return jax.tree.map(merge, old, new)


def _streamed_round(algorithm, config, state, arrays, cohort, groups, trainer, hparams, server_key):
    """Chunks run under ``lax.scan`` into a running weighted sum of ``client_stats``.

    Memory holds one chunk's clients and one copy of the statistics, whatever
    the cohort size; client and local metrics are summed chunk by chunk too.
    """
    persistent, totals = list(state.persistent), None
    for g, _, sub in groups:
        sums, persistent[g], add = _streamed_group(algorithm, config, state, arrays, sub, trainer(g), persistent[g], g,
                                                   hparams)
        totals = sums if totals is None else add(totals, sums)
    stats, client_sums, local_sums, (kept_weight, dropped, first) = totals
    # dropping clients leaves the weights summing to kept_weight: renormalise the (linear) sums
    scale = jnp.where(dropped > 0, 1.0 / jnp.maximum(kept_weight, 1e-30), 1.0)
    stats = jax.tree.map(lambda x: x * scale.astype(x.dtype), stats)
    local_sums = {name: value * scale for name, value in local_sums.items()}
    mask = cohort.mask  # the real count for the client-metric means: the kept clients
    real = jnp.sum(mask) - dropped
    total = jnp.where(dropped > 0, cohort.total * kept_weight, cohort.total)
    server, server_metrics = algorithm.server_from_stats(state.server, stats, mask,
                                                         aggregation_hparams(hparams, total), server_key)
    server = jax.tree.map(lambda new, old: jnp.where(kept_weight > 0, new, old), server, state.server)
    fault_metrics = {"nonfinite_clients": dropped}
    if config.on_nonfinite == "stop":
        fault_metrics["first_nonfinite_client"] = jnp.where(dropped > 0, first, -1).astype(jnp.float32)
    kept_mask = jnp.where(jnp.arange(mask.shape[0]) < real, 1.0, 0.0)  # only its sum is read
    metrics = round_record(algorithm, config, arrays, server, {**server_metrics, **fault_metrics}, client_sums,
                             kept_mask, local_sums, hparams)
    return EngineState(server, tuple(persistent)), metrics


def make_round_step(algorithm: Algorithm, config: RoundConfig, backend: str = "vmap", donate_state: bool = False):
    """Builds ``round_step(state, arrays, key, hparams) -> (state, metrics)``.

    ``backend="vmap"`` compiles the whole round once; ``"sequential"`` is the
    reference (a Python loop over clients, one jitted call each); ``"stepwise"``
    loops over clients and batches in Python (one jitted step per batch);
    ``"debug"`` is the stepwise loop with jit off and errors tagged with client and stage.

    ``donate_state=True`` (the vmap backend) donates the incoming ``state``'s buffers to the
    new state (``jax.jit(..., donate_argnums=0)``): the server and per-client state are
    updated in place instead of held twice, and the passed ``state`` is unusable afterwards
    (chain ``state, metrics = round_step(state, ...)``). ``simulate`` does this. The state must
    not share a buffer with arrays still needed (``init_state`` can keep ``params``' own
    arrays) nor hold one buffer twice (FedRef's server starts with three views of one model):
    pass ``with_own_buffers(state, params)`` to the first round.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if config.round_fractions is not None:
        full = make_round_step(algorithm, dataclasses.replace(config, round_fractions=None), backend, donate_state)
        subsets = jax.jit(lambda arrays, key: with_round_subsets(config, arrays, key)) if backend != "debug" else (
            lambda arrays, key: with_round_subsets(config, arrays, key))
        return lambda state, arrays, key, hparams: full(state, subsets(arrays, key), key, hparams)
    if backend == "vmap":
        def round_step(state, arrays, key, hparams):
            return _vmapped_round(algorithm, config, state, arrays, key, hparams)
        if config.client_devices > 1:  # every input and output replicated; _vmapped_round splits the chunks
            mesh = client_device_mesh(config.client_devices)
            replicated = jax.sharding.PartitionSpec()
            round_step = jax.shard_map(round_step, mesh=mesh, in_specs=replicated, out_specs=replicated,
                                       check_vma=False)
        return jax.jit(round_step, donate_argnums=0 if donate_state else ())
    if backend == "sequential":
        return sequential_round(algorithm, config)
    if backend == "stepwise":
        return stepwise_round(algorithm, config)
    return debug_round(algorithm, config)


def client_device_mesh(devices: int) -> jax.sharding.Mesh:
    """The 1-D mesh (axis ``PARALLEL_AXIS``) of the first ``devices`` local devices, for ``client_devices``."""
    local = jax.local_devices()
    if devices > len(local):
        raise ValueError(f"client_devices={devices} but JAX sees {len(local)} local device(s); fix: fewer, or on a CPU "
                         "call bfedjax.core.layout.use_cpu_cores() before JAX's first computation")
    return jax.sharding.Mesh(np.asarray(local[:devices]), (PARALLEL_AXIS,))


def replicated_on(config: RoundConfig, tree):
    """``tree`` placed on every device of ``client_device_mesh`` (as is with one device): the round's inputs."""
    if config.client_devices == 1:
        return tree
    sharding = jax.sharding.NamedSharding(client_device_mesh(config.client_devices), jax.sharding.PartitionSpec())
    return jax.device_put(tree, sharding)


def with_own_buffers(state, *keep):
    """``state`` with a copy of each array leaf whose device buffer also backs a leaf of ``keep``
    (e.g. the caller's ``init_params``) or an earlier leaf of ``state``; the other leaves are
    returned as they are. Donating the result (``make_round_step(..., donate_state=True)``)
    then invalidates no array of ``keep`` and donates no buffer twice."""
    def buffers(x) -> set[tuple[str, int]]:
        if not x.is_fully_addressable:  # spans processes (its local shards cannot be listed here): the array itself
            return {("array", id(x))}
        return {("buffer", shard.data.unsafe_buffer_pointer()) for shard in x.addressable_shards}

    seen = set().union(*(buffers(x) for x in jax.tree.leaves(keep) if isinstance(x, jax.Array)))

    def own(x):
        if not isinstance(x, jax.Array):
            return x
        mine = buffers(x)
        if mine & seen:
            x = jnp.array(x, copy=True)
            mine = buffers(x)
        seen.update(mine)
        return x

    return jax.tree.map(own, state)


def _vmapped_round(algorithm, config, state, arrays, key, hparams):
    cohort = sample_cohort(config, arrays, key, algorithm.batch_size, algorithm.local_epochs)
    server_key = server_key_of(key)
    chunk = config.clients_per_chunk
    groups = group_cohorts(config, cohort)

    def trainer(g):
        one = lambda cid, k, b: run_one_client(algorithm, config, state, arrays, hparams, cid, k, b, g)
        if chunk == 1:  # one client at a time without a vmap: convolutions stay ungrouped (fast on CPU)
            return lambda ids, keys, budgets: jax.tree.map(lambda x: jnp.asarray(x)[None],
                                                           one(ids[0], keys[0], budgets[0]))
        return jax.vmap(one)

    if chunk is not None and chunk < config.padded_cohort and algorithm.streams:
        return _streamed_round(algorithm, config, state, arrays, cohort, groups, trainer, hparams, server_key)
    everyone = config.clients_per_round == config.num_clients == config.padded_cohort and config.num_groups == 1
    persistent, parts = list(state.persistent), []
    for g, positions, sub in groups:
        slots = sub.ids.shape[0]
        if everyone and chunk is None:
            # Full participation: vmap straight over the stored client axis (no gather copy).
            def train_in_place(data, persistent, cid, k, b):
                return run_one_client(algorithm, config, state, arrays, hparams, cid, k, b, 0, (data, persistent))
            data = ClientData(arrays.x, arrays.y, arrays.counts)
            outputs = jax.vmap(train_in_place)(data, state.persistent[0], sub.ids, sub.keys, sub.budgets)
        elif chunk is None or chunk >= slots:
            outputs = trainer(g)(sub.ids, sub.keys, sub.budgets)
        else:
            n_chunks = slots // chunk
            split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
            chunks = (split(sub.ids), split(sub.keys), split(sub.budgets))
            if config.client_devices > 1:
                chunks = _device_share(chunks, config.client_devices)
            out = jax.lax.map(lambda args: trainer(g)(*args), chunks)
            if config.client_devices > 1:  # every device gets every client's outputs, in cohort order
                out = _gathered_shares(out)
            outputs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
        messages, new_persistent, client_metrics = outputs
        finite = finite_rows((messages, new_persistent), slots)  # a non-finite client keeps its old state
        kept = jnp.where(finite, sub.mask, 0.0)
        persistent[g] = scatter_persistent(persistent[g], group_rows(config, sub.ids, g), kept, new_persistent)
        parts.append((positions, (messages, client_metrics, finite)))
    messages, client_metrics, finite = merge_groups(parts, config.padded_cohort)
    return finish_round(algorithm, config, state, arrays, cohort, messages, client_metrics, finite, tuple(persistent),
                        hparams, server_key)


__all__ = ["BACKENDS", "PARALLEL_AXIS", "client_device_mesh", "make_round_step", "replicated_on", "with_own_buffers"]

