"""The types shared by the engine and every algorithm.

An algorithm is a bundle of pure functions over pytrees (see ``Algorithm``);
the engine owns vmap, scan, masking, client sampling and chunking.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

PyTree = Any
HParams = dict  # traced per-round scalars: {"round", "lr", "lam", ...}


class ClientData(NamedTuple):
    """One client's padded data (inside the round every leaf gains ``[C]``).

    x: ``[max_n, ...]`` inputs; rows ``>= count`` are padding.
    y: ``[max_n]`` int32 labels.
    count: ``[]`` int32 number of real samples.
    """

    x: jax.Array
    y: jax.Array
    count: jax.Array


class Batch(NamedTuple):
    """A masked mini-batch. x: ``[B, ...]``, y: ``[B]``, mask: ``[B]`` float32 (1 real, 0 pad)."""

    x: jax.Array
    y: jax.Array
    mask: jax.Array


class ClientContext(NamedTuple):
    """Everything a client may read during a round (read-only).

    server: the broadcast server state.
    persistent: this client's persistent state (``()`` when the algorithm has none).
    data: this client's ``ClientData``.
    hparams: traced per-round scalars (``round`` counts from 1, ``lr``, ``lam``, ...).
    """

    server: PyTree
    persistent: PyTree
    data: ClientData
    hparams: HParams


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (cf. optax's GradientTransformation).

    server_init(params) -> server_state
    client_init(ctx, key) -> local_state
    client_step(local_state, batch, ctx, key) -> local_state
        A step whose batch is entirely padding is discarded by the engine, so a
        client takes exactly ceil(count / batch_size) steps per epoch.
    client_final(local_state, ctx) -> (message, new_persistent)
        ``message`` is a dict holding at least ``"params"`` (the local model).
    server_update(server_state, messages, weights, hparams) -> server_state
        ``messages`` leaves are ``[C, ...]``; ``weights`` ``[C]`` sums to 1
        over the cohort (zero for padding clients of a chunked cohort).
    global_params(server_state) -> params used for evaluation (GA).
    persistent_init(params) -> one client's persistent state, or None.
    diagnostics(server_state) -> dict of scalars ``simulate`` adds to each round's record, or None.
    client_stats(message) -> stats, and server_from_stats(server_state, stats, hparams) -> server_state:
        optional; when the rule is a weighted sum of per-client statistics
        (``server_update == server_from_stats(sum_c w_c client_stats(m_c))``) the
        engine streams chunked cohorts through a running sum instead of stacking
        every message, so memory does not grow with the cohort.

    model: the Flax module whose ``apply({"params": p}, x)`` gives logits.
    local_epochs, batch_size: static local-training shape.
    hparams: default values of the traced per-round scalars.
    """

    name: str
    model: Any
    server_init: Callable
    client_init: Callable
    client_step: Callable
    client_final: Callable
    server_update: Callable
    global_params: Callable
    local_epochs: int
    batch_size: int
    hparams: dict
    persistent_init: Callable | None = None
    diagnostics: Callable | None = None
    client_stats: Callable | None = None
    server_from_stats: Callable | None = None


def server_update_from_stats(client_stats: Callable, server_from_stats: Callable) -> Callable:
    """The stacked ``server_update`` of a rule given as summed per-client statistics.

    The sum runs as a ``lax.scan`` over clients, so per-client statistics
    (e.g. precision * mean) are fused into the accumulation and never
    materialised as ``[C, ...]`` arrays.
    """

    def server_update(server, messages, weights, hparams):
        first = jax.tree.map(lambda m: m[0], messages)
        zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), jax.eval_shape(client_stats, first))

        def add(total, message_and_weight):
            message, weight = message_and_weight
            return jax.tree.map(lambda t, s: t + weight * s, total, client_stats(message)), None

        total, _ = jax.lax.scan(add, zeros, (messages, weights))
        return server_from_stats(server, total, hparams)

    return server_update
