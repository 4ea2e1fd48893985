"""The reference backends of ``make_round_step``, whose clients run one after another: ``sequential`` (one
jitted call per client, the reference the tests compare the vmapped round with), ``stepwise`` (a Python
loop over clients and batches, one jitted step per batch: FedJAX's design, the benchmark's baseline) and
``debug`` (the stepwise loop with jit off; an exception or a non-finite output becomes a ``StageError``
naming the client and the stage)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.core.batching import epoch_permutation, take_batch
from bfedjax.core.client_half import (client_inputs, client_test_data, run_one_client, scatter_persistent,
                                  with_client_test_metrics)
from bfedjax.core.sampling import sample_cohort, server_key_of
from bfedjax.core.finite import finite_rows
from bfedjax.core.server_half import finish_round
from bfedjax.core.types import ClientContext
from bfedjax.tree import tree_stack


def _looped_round(algorithm, config, one_client, wrap):
    """A round whose clients run one after another through ``one_client`` (the reference backends).

    ``wrap`` is ``jax.jit`` for the sampling and the aggregation, or the identity (debug).
    """
    sample = wrap(lambda arrays, key: sample_cohort(config, arrays, key, algorithm.batch_size,
                                                    algorithm.local_epochs))
    finish = wrap(lambda *args: finish_round(algorithm, config, *args))
    scatter = wrap(scatter_persistent)
    finite_one = wrap(lambda tree: finite_rows(jax.tree.map(lambda x: jnp.asarray(x)[None], tree), 1)[0])
    n, group_of = config.num_clients, config.group_of

    def round_step(state, arrays, key, hparams):
        cohort = sample(arrays, key)
        ids = np.asarray(cohort.ids)
        groups = [int(group_of[min(cid, n - 1)]) for cid in ids]
        outputs = [one_client(state, arrays, hparams, int(ids[i]), cohort.keys[i], cohort.budgets[i], groups[i])
                   for i in range(config.padded_cohort)]
        finite = jnp.asarray([bool(finite_one(o[:2])) for o in outputs])  # message and persistent state
        kept = jnp.where(finite, cohort.mask, 0.0)
        persistent = list(state.persistent)
        for g in range(config.num_groups):
            slots = [i for i in range(len(ids)) if ids[i] < n and groups[i] == g]
            if slots and jax.tree.leaves(persistent[g]):
                rows = jnp.asarray(config.index_in_group[ids[slots]])
                persistent[g] = scatter(persistent[g], rows, kept[np.asarray(slots)],
                                        tree_stack([outputs[i][1] for i in slots]))
        messages, metrics = tree_stack([o[0] for o in outputs]), tree_stack([o[2] for o in outputs])
        return finish(state, arrays, cohort, messages, metrics, finite, tuple(persistent), hparams,
                      server_key_of(key))

    return round_step


def sequential_round(algorithm, config):
    """The ``sequential`` backend's ``round_step``: one jitted call per client (the whole local training)."""
    run = jax.jit(lambda state, arrays, hparams, cid, k, b, g: run_one_client(algorithm, config, state, arrays,
                                                                               hparams, cid, k, b, g),
                  static_argnums=6)
    return _looped_round(algorithm, config, run, jax.jit)


def stepwise_round(algorithm, config):
    """The ``stepwise`` backend's ``round_step``: one jitted step per client and batch."""
    return _looped_round(algorithm, config, _looped_client(algorithm, config, jax.jit, _call), jax.jit)


def _call(stage, client, fn, *args):
    del stage, client
    return fn(*args)


def _looped_client(algorithm, config, wrap, call):
    """``one_client`` of the stepwise and debug backends: Python loops over epochs and real batches.

    ``wrap`` compiles each stage (``jax.jit``, or the identity for debug); ``call(stage, client, fn, *args)``
    runs one stage (debug adds the client and stage to errors).
    """
    batch_size = algorithm.batch_size
    inputs = {g: wrap(lambda state, arrays, cid, g=g: client_inputs(state, arrays, config, cid, g))
              for g in range(config.num_groups)}
    client_test = {g: wrap(lambda arrays, cid, out, g=g: with_client_test_metrics(algorithm, arrays, cid, out, g))
                   for g in range(config.num_groups)}
    test_of = wrap(client_test_data)
    init = wrap(algorithm.client_init)
    order_of = wrap(epoch_permutation, static_argnums=2) if wrap is jax.jit else epoch_permutation
    step = wrap(lambda local, ctx, order, j, key: algorithm.client_step(
        local, take_batch(ctx.data, order, j, batch_size), ctx, key))
    final = wrap(algorithm.client_final)

    def one_client(state, arrays, hparams, client_id, key, budget, group):
        data, persistent = inputs[group](state, arrays, client_id)
        ctx = ClientContext(state.server, persistent, data, hparams, group, test_of(arrays, client_id))
        init_key, perm_key, step_key = jax.random.split(key, 3)  # as local_training
        local = call("init", client_id, init, ctx, init_key)
        real_batches, taken = math.ceil(int(data.count) / batch_size), 0
        for e in range(algorithm.local_epochs):
            order = order_of(perm_key, data.count, data.y.shape[0], e)
            epoch_key = jax.random.fold_in(step_key, e)
            for j in range(min(real_batches, int(budget) - taken)):
                local = call(f"step (epoch {e}, batch {j})", client_id, step, local, ctx, order, j,
                             jax.random.fold_in(epoch_key, j))
                taken += 1
        out = call("final", client_id, final, local, ctx)
        return call("client test", client_id, client_test[group], arrays, client_id, out)

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


def debug_round(algorithm, config):
    """The ``debug`` backend's ``round_step``: the stepwise loop with jit off; the server and evaluation stages
    are checked too."""
    identity = lambda fn, **_: fn
    checked = dataclasses.replace(
        algorithm,
        server_update=(lambda *args: _debug_call("server", None, algorithm.aggregate, *args)),
        client_stats=None, server_from_stats=None,
        evaluate=None if algorithm.evaluate is None else
        (lambda *args: _debug_call("evaluate", None, algorithm.evaluate, *args)))
    round_step = _looped_round(checked, config, _looped_client(algorithm, config, identity, _debug_call), identity)

    def debug_round(state, arrays, key, hparams):
        with jax.disable_jit():
            return round_step(state, arrays, key, hparams)

    return debug_round


__all__ = ["debug_round", "sequential_round", "StageError", "stepwise_round"]
