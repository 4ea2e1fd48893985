"""The round engine: one federated round as one jitted function.

``make_round_step(algorithm, config)`` returns

    round_step(state, arrays, key, hparams) -> (state, metrics)

which samples a cohort, runs every cohort client's local training under
``jax.vmap`` (local steps under ``lax.scan``; cohorts split into chunks of
``clients_per_chunk`` clients run one chunk after another under ``lax.map``),
aggregates, and evaluates, all inside one ``jax.jit``. ``hparams`` (round
index, learning rate, lambda, ...) are traced, so changing them never
recompiles.

The ``sequential`` backend runs the same per-client function in a Python loop
(one jitted call per client) and the same aggregation; tests use it to prove
the vmapped round computes the same maths. With ``clients_per_chunk`` and an
algorithm whose aggregation is a weighted sum of per-client statistics, the
chunks stream into a running sum under ``lax.scan`` (memory independent of
the cohort size); otherwise chunk messages are stacked for ``server_update``. The ``stepwise`` backend is the
design most simulators use (FedJAX's default): a Python loop over clients and
over their batches, one jitted ``client_step`` per batch; it is the baseline
of ``experiments/bench.py`` and is parity-tested too.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.core.batching import batch_is_real, epoch_permutation, take_batch
from bfedjax.core.tree import tree_stack, weighted_sum
from bfedjax.core.types import Algorithm, ClientContext, ClientData
from bfedjax.metrics.classification import evaluate, evaluate_many
from bfedjax.models.apply import apply_fn_of

BACKENDS = ("vmap", "sequential", "stepwise")


class EngineState(NamedTuple):
    """server: the algorithm's server state; persistent: per-client state, leaves ``[N, ...]`` (or ``()``)."""

    server: Any
    persistent: Any


class RoundArrays(NamedTuple):
    """Device arrays a round reads (all clients, padded).

    x: ``[N, max_n, ...]``; y: ``[N, max_n]``; counts: ``[N]`` int32;
    base_weights: ``[N]`` client weights before renormalisation over the cohort
    (pi_n = m_n / m by default); x_test: ``[T, ...]``; y_test: ``[T]``.
    """

    x: jax.Array
    y: jax.Array
    counts: jax.Array
    base_weights: jax.Array
    x_test: jax.Array
    y_test: jax.Array


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static shape of a round (changing any field recompiles).

    num_clients: N, clients in the federation.
    clients_per_round: K, cohort size (K = N: everybody, in order, every round).
    clients_per_chunk: clients trained at once; ``None`` trains the whole cohort in one vmap.
    evaluate_local: also score every local model on the test set (LA).
    eval_batch_size: test-set evaluation batch.
    pad_cohort_to: round the cohort up to a multiple of this (the device count when the
      client axis is sharded); the extra slots are empty, zero-weight clients.
    """

    num_clients: int
    clients_per_round: int
    clients_per_chunk: int | None = None
    evaluate_local: bool = True
    eval_batch_size: int = 1000
    pad_cohort_to: int = 1

    def __post_init__(self):
        if not 1 <= self.clients_per_round <= self.num_clients:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} must be in [1, num_clients={self.num_clients}]")
        if self.clients_per_chunk is not None and self.clients_per_chunk < 1:
            raise ValueError(f"clients_per_chunk={self.clients_per_chunk} must be >= 1 (or None for no chunking)")

    @property
    def padded_cohort(self) -> int:
        """Cohort size rounded up to a whole number of chunks (extra slots are zero-weight)."""
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
    """Runs one client's local epochs and returns ``algorithm.client_final``'s output.

    Epochs run under ``lax.scan``; within an epoch a ``lax.while_loop`` takes
    the client's ``ceil(count / B)`` batches. Under ``vmap`` the loop runs
    until the largest client of the vmapped group is done and leaves finished
    clients' states unchanged, so a group of similar-sized clients (the engine
    sorts the cohort by size before chunking) does little padded work.
    """
    init_key, perm_key, step_key = jax.random.split(key, 3)  # same derivation in _stepwise_round_fn
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


class _Cohort(NamedTuple):
    ids: jax.Array        # [Kp] client index, N for padding slots
    weights: jax.Array    # [Kp] sums to 1 over real slots, 0 on padding
    keys: jax.Array       # [Kp] per-client keys (depend on the client id only)


def _sample_cohort(config: RoundConfig, arrays: RoundArrays, key) -> _Cohort:
    n, k, kp = config.num_clients, config.clients_per_round, config.padded_cohort
    sample_key, client_key = jax.random.split(key)
    if k == n:
        ids = jnp.arange(n, dtype=jnp.int32)
    else:  # k clients without replacement, never a zero-weight (padding) client; a client's
        # score depends only on (key, id), so padding the federation does not change the draw
        scores = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(sample_key, i)))(jnp.arange(n))
        scores = jnp.where(arrays.base_weights > 0, scores, -1.0)
        ids = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    if config.clients_per_chunk is not None:  # largest first, so each chunk holds similar sizes
        ids = ids[jnp.argsort(-arrays.counts[ids], stable=True)]
    ids = jnp.concatenate([ids, jnp.full((kp - k,), n, jnp.int32)])
    real = ids < n
    raw = jnp.where(real, arrays.base_weights[jnp.minimum(ids, n - 1)], 0.0)
    weights = raw / jnp.maximum(jnp.sum(raw), 1e-30)
    keys = jax.vmap(lambda i: jax.random.fold_in(client_key, i))(ids)
    return _Cohort(ids, weights, keys)


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


def _evaluate_global(algorithm, config, arrays, server):
    ga, loss = evaluate(apply_fn_of(algorithm.model), algorithm.global_params(server), arrays.x_test,
                        arrays.y_test, config.eval_batch_size)
    return {"global_accuracy": ga, "global_loss": loss}


def _local_accuracy_sum(algorithm, config, arrays, stacked_params, weights):
    """sum_c w_c * acc(local model c) on the test set (the LA of the paper)."""
    accs, _ = evaluate_many(apply_fn_of(algorithm.model), stacked_params, arrays.x_test, arrays.y_test,
                            config.eval_batch_size)
    return jnp.sum(weights * accs)


def _scatter(persistent, ids, new):
    return jax.tree.map(lambda all_, n: all_.at[ids].set(n, mode="drop"), persistent, new)


def _finish(algorithm, config, state, arrays, cohort, messages, new_persistent, hparams):
    """Aggregation of stacked messages, persistent-state scatter and evaluation (all backends)."""
    server = algorithm.server_update(state.server, messages, cohort.weights, hparams)
    metrics = _evaluate_global(algorithm, config, arrays, server)
    if config.evaluate_local:
        metrics["local_accuracy"] = _local_accuracy_sum(algorithm, config, arrays, messages["params"],
                                                        cohort.weights)
    return EngineState(server, _scatter(state.persistent, cohort.ids, new_persistent)), metrics


def _streamed_round(algorithm, config, state, arrays, cohort, train, hparams):
    """Chunks run under ``lax.scan`` into a running weighted sum of ``client_stats``.

    Memory holds one chunk's clients and one copy of the statistics, whatever
    the cohort size; LA is accumulated chunk by chunk too.
    """
    chunk = config.clients_per_chunk
    n_chunks = config.padded_cohort // chunk
    split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
    ids, keys, weights = split(cohort.ids), split(cohort.keys), split(cohort.weights)

    def chunk_stats(messages, w):
        return weighted_sum(jax.vmap(algorithm.client_stats)(messages), w)

    shapes = jax.eval_shape(lambda: chunk_stats(train(ids[0], keys[0])[0], weights[0]))
    init = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state.persistent, jnp.zeros(()))

    def body(carry, xs):
        stats, persistent, local_acc = carry
        chunk_ids, chunk_keys, w = xs
        messages, new_persistent = train(chunk_ids, chunk_keys)
        stats = jax.tree.map(jnp.add, stats, chunk_stats(messages, w))
        if config.evaluate_local:
            local_acc = local_acc + _local_accuracy_sum(algorithm, config, arrays, messages["params"], w)
        return (stats, _scatter(persistent, chunk_ids, new_persistent), local_acc), None

    (stats, persistent, local_acc), _ = jax.lax.scan(body, init, (ids, keys, weights))
    server = algorithm.server_from_stats(state.server, stats, hparams)
    metrics = _evaluate_global(algorithm, config, arrays, server)
    if config.evaluate_local:
        metrics["local_accuracy"] = local_acc
    return EngineState(server, persistent), metrics


def make_round_step(algorithm: Algorithm, config: RoundConfig, backend: str = "vmap"):
    """Builds ``round_step(state, arrays, key, hparams) -> (state, metrics)``.

    ``backend="vmap"`` compiles the whole round once; ``"sequential"`` is the
    reference (a Python loop over clients, one jitted call each); ``"stepwise"``
    loops over clients and batches in Python (one jitted step per batch).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if backend == "vmap":
        return jax.jit(lambda state, arrays, key, hparams: _vmapped_round(algorithm, config, state, arrays, key, hparams))
    if backend == "sequential":
        return _sequential_round_fn(algorithm, config)
    return _stepwise_round_fn(algorithm, config)


def _vmapped_round(algorithm, config, state, arrays, key, hparams):
    cohort = _sample_cohort(config, arrays, key)
    one = lambda cid, k: _run_one_client(algorithm, state, arrays, hparams, cid, k)
    chunk = config.clients_per_chunk
    if chunk == 1:  # one client at a time without a vmap: convolutions stay ungrouped (fast on CPU)
        train = lambda ids, keys: jax.tree.map(lambda x: x[None], one(ids[0], keys[0]))
    else:
        train = jax.vmap(one)
    everyone = config.clients_per_round == config.num_clients == config.padded_cohort
    if everyone and chunk is None:
        # Full participation: vmap straight over the stored client axis (no gather copy).
        def train_in_place(data, persistent, k):
            return local_training(algorithm, ClientContext(state.server, persistent, data, hparams), k)
        data = ClientData(arrays.x, arrays.y, arrays.counts)
        messages, new_persistent = jax.vmap(train_in_place)(data, state.persistent, cohort.keys)
    elif chunk is None or chunk >= config.padded_cohort:
        messages, new_persistent = train(cohort.ids, cohort.keys)
    elif algorithm.client_stats is not None:
        return _streamed_round(algorithm, config, state, arrays, cohort, train, hparams)
    else:
        n_chunks = config.padded_cohort // chunk
        ids = cohort.ids.reshape(n_chunks, chunk)
        keys = cohort.keys.reshape((n_chunks, chunk) + cohort.keys.shape[1:])
        out = jax.lax.map(lambda args: train(*args), (ids, keys))
        messages, new_persistent = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
    return _finish(algorithm, config, state, arrays, cohort, messages, new_persistent, hparams)


def _looped_round(algorithm, config, one_client):
    """A round whose clients run one after another through ``one_client`` (reference backends)."""
    sample = jax.jit(lambda arrays, key: _sample_cohort(config, arrays, key))
    finish = jax.jit(lambda *args: _finish(algorithm, config, *args))

    def round_step(state, arrays, key, hparams):
        cohort = sample(arrays, key)
        outputs = [one_client(state, arrays, hparams, cohort.ids[i], cohort.keys[i])
                   for i in range(config.padded_cohort)]
        messages, new_persistent = tree_stack(outputs)
        return finish(state, arrays, cohort, messages, new_persistent, hparams)

    return round_step


def _sequential_round_fn(algorithm, config):
    """One jitted call per client (the whole local training)."""
    return _looped_round(algorithm, config, jax.jit(
        lambda state, arrays, hparams, cid, k: _run_one_client(algorithm, state, arrays, hparams, cid, k)))


def _stepwise_round_fn(algorithm, config):
    """Python loops over clients, epochs and real batches; one jitted ``client_step`` per batch."""
    batch_size = algorithm.batch_size
    inputs = jax.jit(_client_inputs)
    init = jax.jit(algorithm.client_init)
    order_of = jax.jit(epoch_permutation, static_argnums=2)
    step = jax.jit(lambda local, ctx, order, j, key: algorithm.client_step(
        local, take_batch(ctx.data, order, j, batch_size), ctx, key))
    final = jax.jit(algorithm.client_final)

    def one_client(state, arrays, hparams, client_id, key):
        data, persistent = inputs(state, arrays, client_id)
        ctx = ClientContext(state.server, persistent, data, hparams)
        init_key, perm_key, step_key = jax.random.split(key, 3)
        local = init(ctx, init_key)
        real_batches = math.ceil(int(data.count) / batch_size)
        for e in range(algorithm.local_epochs):
            order = order_of(perm_key, data.count, data.y.shape[0], e)
            epoch_key = jax.random.fold_in(step_key, e)
            for j in range(real_batches):
                local = step(local, ctx, order, j, jax.random.fold_in(epoch_key, j))
        return final(local, ctx)

    return _looped_round(algorithm, config, one_client)


__all__ = ["BACKENDS", "EngineState", "RoundArrays", "RoundConfig", "apply_fn_of", "init_state",
           "local_training", "make_round_step"]
