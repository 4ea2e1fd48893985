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
``mask [Kp]`` (1 for a real client) and ``weights [Kp]`` (the real clients'
share of the aggregate). A padding slot never trains on data, never counts in
an aggregate or a metric, and never writes persistent state. Sampling draws
among the federation's real clients whatever their weights; a round whose
real clients all weigh zero keeps the server state (their persistent state
still moves).

Backends: ``vmap`` (the library), ``sequential`` (one jitted call per client,
the reference the tests compare with), ``stepwise`` (a Python loop over
clients and batches with one jitted step per batch, FedJAX's design and the
baseline of ``experiments/bench.py``) and ``debug`` (the stepwise loop with jit
off: an exception or a non-finite output is reported with the client and the
stage, init / step / final / server / evaluate, where it happened).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.core.batching import batch_is_real, epoch_permutation, take_batch
from bfedjax.core.types import Algorithm, ClientContext, ClientData
from bfedjax.tree import tree_stack, weighted_sum

BACKENDS = ("vmap", "sequential", "stepwise", "debug")
SERVER_KEY_STREAM = 0x5E5E  # the server's key is fold_in(round key, this): sampling and client keys stay as they were


class EngineState(NamedTuple):
    """server: the algorithm's server state; persistent: per-client state, leaves ``[N, ...]`` (or ``()``)."""

    server: Any
    persistent: Any


class RoundArrays(NamedTuple):
    """Device arrays a round reads (all clients, padded).

    x: ``[N, max_n, ...]``; y: ``[N, max_n, ...]``; counts: ``[N]`` int32;
    base_weights: ``[N]`` client weights before renormalisation over the cohort
    (pi_n = m_n / m by default); client_mask: ``[N]`` float32, 1 for a client of
    the federation and 0 for an empty client added to fill a device mesh;
    x_test: ``[T, ...]``; y_test: ``[T, ...]``.
    """

    x: jax.Array
    y: jax.Array
    counts: jax.Array
    base_weights: jax.Array
    client_mask: jax.Array
    x_test: jax.Array
    y_test: jax.Array


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static shape of a round (changing any field recompiles).

    num_clients: N, clients in the federation.
    clients_per_round: K, cohort size (K = N: everybody, in order, every round).
    clients_per_chunk: clients trained at once; ``None`` trains the whole cohort in one vmap,
      1 runs them one after another without a vmap.
    evaluate_local: also score every local model with the evaluate hook (LA).
    pad_cohort_to: round the cohort up to a multiple of this (the device count when the
      client axis is sharded); the extra slots are padding.
    """

    num_clients: int
    clients_per_round: int
    clients_per_chunk: int | None = None
    evaluate_local: bool = True
    pad_cohort_to: int = 1

    def __post_init__(self):
        if not 1 <= self.clients_per_round <= self.num_clients:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} must be in [1, num_clients={self.num_clients}]")
        if self.clients_per_chunk is not None and self.clients_per_chunk < 1:
            raise ValueError(f"clients_per_chunk={self.clients_per_chunk} must be >= 1 (or None for no chunking)")

    @property
    def padded_cohort(self) -> int:
        """Cohort size rounded up to a whole number of chunks (extra slots are padding)."""
        multiple = math.lcm(self.clients_per_chunk or 1, self.pad_cohort_to)
        return math.ceil(self.clients_per_round / multiple) * multiple


def init_state(algorithm: Algorithm, params, num_clients: int) -> EngineState:
    """Server state from initial ``params`` and per-client persistent state ``[N, ...]``."""
    server = algorithm.server_init(params)
    if algorithm.persistent_init is None:
        return EngineState(server, ())
    one = algorithm.persistent_init(params)
    persistent = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), one)
    return EngineState(server, persistent)


def local_training(algorithm: Algorithm, ctx: ClientContext, key: jax.Array):
    """Runs one client's local epochs; returns ``client_final``'s ``(message, persistent, metrics)``.

    Epochs run under ``lax.scan``; within an epoch a ``lax.while_loop`` takes
    the client's ``ceil(count / B)`` batches. Under ``vmap`` the loop runs
    until the largest client of the vmapped group is done and leaves finished
    clients' states unchanged, so a group of similar-sized clients (the engine
    sorts the cohort by size before chunking) does little padded work.
    """
    init_key, perm_key, step_key = jax.random.split(key, 3)  # same derivation in _looped_client
    local = algorithm.client_init(ctx, init_key)
    max_n = ctx.data.y.shape[0]
    batch_size = algorithm.batch_size

    def epoch(local, e):
        order = epoch_permutation(perm_key, ctx.data.count, max_n, e)
        epoch_key = jax.random.fold_in(step_key, e)

        def step(carry):
            j, local = carry
            batch = take_batch(ctx.data, order, j, batch_size)
            return j + 1, algorithm.client_step(local, batch, ctx, jax.random.fold_in(epoch_key, j))

        _, local = jax.lax.while_loop(lambda carry: batch_is_real(ctx.data, carry[0], batch_size), step,
                                      (jnp.int32(0), local))
        return local, None

    local, _ = jax.lax.scan(epoch, local, jnp.arange(algorithm.local_epochs))
    return algorithm.client_final(local, ctx)


class Cohort(NamedTuple):
    """The clients of one round. ids: ``[Kp]`` client index (``N`` on padding slots);
    mask: ``[Kp]`` 1 for a real client; weights: ``[Kp]`` sum to 1 over the real clients;
    keys: ``[Kp]`` per-client keys (depend on the round key and the client id only)."""

    ids: jax.Array
    mask: jax.Array
    weights: jax.Array
    keys: jax.Array


def sample_cohort(config: RoundConfig, arrays: RoundArrays, key) -> Cohort:
    """K clients without replacement among the federation's, padded to ``config.padded_cohort`` slots."""
    n, k, kp = config.num_clients, config.clients_per_round, config.padded_cohort
    sample_key, client_key = jax.random.split(key)
    if k == n:
        ids = jnp.arange(n, dtype=jnp.int32)
    else:  # a client's score depends only on (key, id), so padding the federation does not change the draw
        scores = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(sample_key, i)))(jnp.arange(n))
        scores = jnp.where(arrays.client_mask > 0, scores, -1.0)
        ids = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    if config.clients_per_chunk is not None:  # largest first, so each chunk holds similar sizes
        ids = ids[jnp.argsort(-arrays.counts[ids], stable=True)]
    ids = jnp.concatenate([ids, jnp.full((kp - k,), n, jnp.int32)])
    safe = jnp.minimum(ids, n - 1)
    mask = jnp.where(ids < n, arrays.client_mask[safe], 0.0)
    raw = jnp.where(mask > 0, arrays.base_weights[safe], 0.0)
    weights = raw / jnp.maximum(jnp.sum(raw), 1e-30)
    keys = jax.vmap(lambda i: jax.random.fold_in(client_key, i))(ids)
    return Cohort(ids, mask, weights, keys)


def server_key_of(round_key: jax.Array) -> jax.Array:
    """The key ``server_update`` receives (independent of the sampling and client keys)."""
    return jax.random.fold_in(round_key, SERVER_KEY_STREAM)


def _client_inputs(state: EngineState, arrays: RoundArrays, client_id):
    """Data and persistent state of one client (padding id N gives an empty client)."""
    n = arrays.counts.shape[0]
    safe = jnp.minimum(client_id, n - 1)
    count = jnp.where(client_id < n, arrays.counts[safe], 0)
    data = ClientData(arrays.x[safe], arrays.y[safe], count)
    persistent = jax.tree.map(lambda p: p[safe], state.persistent)
    return data, persistent


def _run_one_client(algorithm, state, arrays, hparams, client_id, key):
    data, persistent = _client_inputs(state, arrays, client_id)
    ctx = ClientContext(state.server, persistent, data, hparams)
    return local_training(algorithm, ctx, key)


def _scatter(persistent, ids, mask, new):
    """Writes the real clients' new persistent rows (padding slots are dropped)."""
    n = jax.tree.leaves(persistent)[0].shape[0] if jax.tree.leaves(persistent) else 0
    ids = jnp.where(mask > 0, ids, n)
    return jax.tree.map(lambda all_, new_: all_.at[ids].set(new_, mode="drop"), persistent, new)


def _client_metric_sums(metrics, mask):
    """``{name: sum over real clients}`` of per-client scalar metrics ``[C]``."""
    for name, value in metrics.items():
        if jnp.shape(value) != mask.shape:
            raise ValueError(f"client metric {name!r} has shape {jnp.shape(value)[1:]} per client; client_final's "
                             "metrics must be scalars (fix: reduce it, e.g. jnp.mean)")
    return {name: jnp.sum(jnp.where(mask > 0, value, 0.0)) for name, value in metrics.items()}


def _local_metric_sums(algorithm, config, arrays, messages, weights, mask):
    """``{local_<name>: sum_c w_c * metric(local model c)}`` through the evaluate hook (the LA of the paper)."""
    if not (config.evaluate_local and algorithm.evaluate is not None and "params" in messages):
        return {}
    scores = jax.lax.map(lambda p: algorithm.evaluate(p, arrays.x_test, arrays.y_test), messages["params"])
    return {f"local_{name}": jnp.sum(jnp.where(mask > 0, weights * value, 0.0)) for name, value in scores.items()}


def _global_metrics(algorithm, arrays, server):
    if algorithm.evaluate is None:
        return {}
    scores = algorithm.evaluate(algorithm.global_params(server), arrays.x_test, arrays.y_test)
    return {f"global_{name}": value for name, value in scores.items()}


RESERVED_METRICS = ("round", "seconds", "best_global_accuracy")


def _round_metrics(algorithm, arrays, server, server_metrics, client_sums, mask, local_sums):
    """The round's record: client metrics averaged over real clients, server, global and local metrics."""
    real = jnp.maximum(jnp.sum(mask), 1.0)
    groups = [("client", {name: total / real for name, total in client_sums.items()}), ("server", server_metrics),
              ("evaluate", _global_metrics(algorithm, arrays, server)), ("evaluate", local_sums)]
    metrics = {}
    for source, group in groups:
        for name, value in group.items():
            if name in metrics or name in RESERVED_METRICS:
                raise ValueError(f"{algorithm.name}: the {source} metric {name!r} clashes with another metric of "
                                 "the round; fix: rename it")
            metrics[name] = value
    return metrics


def _kept_if_nobody_counts(new_server, old_server, weights, mask):
    """A cohort whose real clients all weigh zero leaves the server state as it was."""
    counts = jnp.sum(jnp.where(mask > 0, weights, 0.0)) > 0
    return jax.tree.map(lambda new, old: jnp.where(counts, new, old), new_server, old_server)


def _finish(algorithm, config, state, arrays, cohort, outputs, hparams, server_key):
    """Aggregation of stacked messages, persistent-state scatter and evaluation (all backends)."""
    messages, new_persistent, client_metrics = outputs
    server, server_metrics = algorithm.aggregate(state.server, messages, cohort.weights, cohort.mask, hparams,
                                                 server_key)
    server = _kept_if_nobody_counts(server, state.server, cohort.weights, cohort.mask)
    local_sums = _local_metric_sums(algorithm, config, arrays, messages, cohort.weights, cohort.mask)
    metrics = _round_metrics(algorithm, arrays, server, server_metrics, _client_metric_sums(client_metrics, cohort.mask),
                             cohort.mask, local_sums)
    return EngineState(server, _scatter(state.persistent, cohort.ids, cohort.mask, new_persistent)), metrics


def _streamed_round(algorithm, config, state, arrays, cohort, train, hparams, server_key):
    """Chunks run under ``lax.scan`` into a running weighted sum of ``client_stats``.

    Memory holds one chunk's clients and one copy of the statistics, whatever
    the cohort size; client and local metrics are summed chunk by chunk too.
    """
    chunk = config.clients_per_chunk
    n_chunks = config.padded_cohort // chunk
    split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
    chunks = (split(cohort.ids), split(cohort.mask), split(cohort.weights), split(cohort.keys))

    def chunk_sums(ids, mask, w, keys):
        messages, new_persistent, client_metrics = train(ids, keys)
        sums = (weighted_sum(jax.vmap(algorithm.client_stats)(messages), w),
                _client_metric_sums(client_metrics, mask),
                _local_metric_sums(algorithm, config, arrays, messages, w, mask))
        return sums, new_persistent

    shapes = jax.eval_shape(lambda: chunk_sums(*(c[0] for c in chunks))[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(carry, xs):
        sums, persistent = carry
        ids, mask, w, keys = xs
        new_sums, new_persistent = chunk_sums(ids, mask, w, keys)
        return (jax.tree.map(jnp.add, sums, new_sums), _scatter(persistent, ids, mask, new_persistent)), None

    ((stats, client_sums, local_sums), persistent), _ = jax.lax.scan(body, (zeros, state.persistent), chunks)
    server, server_metrics = algorithm.server_from_stats(state.server, stats, cohort.mask, hparams, server_key)
    server = _kept_if_nobody_counts(server, state.server, cohort.weights, cohort.mask)
    metrics = _round_metrics(algorithm, arrays, server, server_metrics, client_sums, cohort.mask, local_sums)
    return EngineState(server, persistent), metrics


def make_round_step(algorithm: Algorithm, config: RoundConfig, backend: str = "vmap"):
    """Builds ``round_step(state, arrays, key, hparams) -> (state, metrics)``.

    ``backend="vmap"`` compiles the whole round once; ``"sequential"`` is the
    reference (a Python loop over clients, one jitted call each); ``"stepwise"``
    loops over clients and batches in Python (one jitted step per batch);
    ``"debug"`` is the stepwise loop with jit off and errors tagged with client and stage.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if backend == "vmap":
        return jax.jit(lambda state, arrays, key, hparams: _vmapped_round(algorithm, config, state, arrays, key, hparams))
    if backend == "sequential":
        return _sequential_round_fn(algorithm, config)
    if backend == "stepwise":
        return _looped_round(algorithm, config, _looped_client(algorithm, jax.jit, _call), jax.jit)
    return _debug_round_fn(algorithm, config)


def _vmapped_round(algorithm, config, state, arrays, key, hparams):
    cohort = sample_cohort(config, arrays, key)
    server_key = server_key_of(key)
    one = lambda cid, k: _run_one_client(algorithm, state, arrays, hparams, cid, k)
    chunk = config.clients_per_chunk
    if chunk == 1:  # one client at a time without a vmap: convolutions stay ungrouped (fast on CPU)
        train = lambda ids, keys: jax.tree.map(lambda x: jnp.asarray(x)[None], one(ids[0], keys[0]))
    else:
        train = jax.vmap(one)
    everyone = config.clients_per_round == config.num_clients == config.padded_cohort
    if everyone and chunk is None:
        # Full participation: vmap straight over the stored client axis (no gather copy).
        def train_in_place(data, persistent, k):
            return local_training(algorithm, ClientContext(state.server, persistent, data, hparams), k)
        data = ClientData(arrays.x, arrays.y, arrays.counts)
        outputs = jax.vmap(train_in_place)(data, state.persistent, cohort.keys)
    elif chunk is None or chunk >= config.padded_cohort:
        outputs = train(cohort.ids, cohort.keys)
    elif algorithm.streams:
        return _streamed_round(algorithm, config, state, arrays, cohort, train, hparams, server_key)
    else:
        n_chunks = config.padded_cohort // chunk
        ids = cohort.ids.reshape(n_chunks, chunk)
        keys = cohort.keys.reshape((n_chunks, chunk) + cohort.keys.shape[1:])
        out = jax.lax.map(lambda args: train(*args), (ids, keys))
        outputs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
    return _finish(algorithm, config, state, arrays, cohort, outputs, hparams, server_key)


def _looped_round(algorithm, config, one_client, wrap):
    """A round whose clients run one after another through ``one_client`` (the reference backends).

    ``wrap`` is ``jax.jit`` for the sampling and the aggregation, or the identity (debug).
    """
    sample = wrap(lambda arrays, key: sample_cohort(config, arrays, key))
    finish = wrap(lambda *args: _finish(algorithm, config, *args))

    def round_step(state, arrays, key, hparams):
        cohort = sample(arrays, key)
        outputs = [one_client(state, arrays, hparams, int(cohort.ids[i]), cohort.keys[i])
                   for i in range(config.padded_cohort)]
        return finish(state, arrays, cohort, tree_stack(outputs), hparams, server_key_of(key))

    return round_step


def _sequential_round_fn(algorithm, config):
    """One jitted call per client (the whole local training)."""
    run = jax.jit(lambda state, arrays, hparams, cid, k: _run_one_client(algorithm, state, arrays, hparams, cid, k))
    return _looped_round(algorithm, config, run, jax.jit)


def _call(stage, client, fn, *args):
    del stage, client
    return fn(*args)


def _looped_client(algorithm, wrap, call):
    """``one_client`` of the stepwise and debug backends: Python loops over epochs and real batches.

    ``wrap`` compiles each stage (``jax.jit``, or the identity for debug); ``call(stage, client, fn, *args)``
    runs one stage (debug adds the client and stage to errors).
    """
    batch_size = algorithm.batch_size
    inputs = wrap(_client_inputs)
    init = wrap(algorithm.client_init)
    order_of = wrap(epoch_permutation, static_argnums=2) if wrap is jax.jit else epoch_permutation
    step = wrap(lambda local, ctx, order, j, key: algorithm.client_step(
        local, take_batch(ctx.data, order, j, batch_size), ctx, key))
    final = wrap(algorithm.client_final)

    def one_client(state, arrays, hparams, client_id, key):
        data, persistent = inputs(state, arrays, client_id)
        ctx = ClientContext(state.server, persistent, data, hparams)
        init_key, perm_key, step_key = jax.random.split(key, 3)  # as local_training
        local = call("init", client_id, init, ctx, init_key)
        real_batches = math.ceil(int(data.count) / batch_size)
        for e in range(algorithm.local_epochs):
            order = order_of(perm_key, data.count, data.y.shape[0], e)
            epoch_key = jax.random.fold_in(step_key, e)
            for j in range(real_batches):
                local = call(f"step (epoch {e}, batch {j})", client_id, step, local, ctx, order, j,
                             jax.random.fold_in(epoch_key, j))
        return call("final", client_id, final, local, ctx)

    return one_client


class StageError(RuntimeError):
    """Raised by the debug backend: ``stage`` (init / step / final / server / evaluate) of ``client`` failed."""

    def __init__(self, stage: str, client, message: str):
        where = f"client {client}, stage {stage}" if client is not None else f"stage {stage}"
        super().__init__(f"{where}: {message}")
        self.stage, self.client = stage, client


def _non_finite_leaf(tree) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) and not bool(jnp.all(jnp.isfinite(leaf))):
            return jax.tree_util.keystr(path) or "(the value)"
    return None


def _debug_call(stage, client, fn, *args):
    """Runs one stage eagerly; exceptions and non-finite outputs become a ``StageError`` naming it."""
    try:
        out = fn(*args)
    except StageError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with the client and stage attached
        raise StageError(stage, client, f"{type(err).__name__}: {err}") from err
    bad = _non_finite_leaf(out)
    if bad is not None:
        raise StageError(stage, client, f"non-finite values in {bad}")
    return out


def _debug_round_fn(algorithm, config):
    """The stepwise loop with jit off; the server and evaluation stages are checked too."""
    identity = lambda fn, **_: fn
    checked = dataclasses.replace(
        algorithm,
        server_update=(lambda *args: _debug_call("server", None, algorithm.aggregate, *args)),
        client_stats=None, server_from_stats=None,
        evaluate=None if algorithm.evaluate is None else
        (lambda *args: _debug_call("evaluate", None, algorithm.evaluate, *args)))
    round_step = _looped_round(checked, config, _looped_client(algorithm, identity, _debug_call), identity)

    def debug_round(state, arrays, key, hparams):
        with jax.disable_jit():
            return round_step(state, arrays, key, hparams)

    return debug_round


__all__ = ["BACKENDS", "Cohort", "EngineState", "RoundArrays", "RoundConfig", "StageError", "init_state",
           "local_training", "make_round_step", "sample_cohort", "server_key_of"]
