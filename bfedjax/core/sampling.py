"""A round's cohort (``Cohort``): which clients train (``sample_cohort``), with what weight and step budget
(stragglers; ``NO_BUDGET`` never binds), on which rows of their data (``with_round_subsets``), and in which
architecture group's slots (``group_cohorts``, ``merge_groups``); and the server's key (``server_key_of``).
Every draw depends only on the round key (a stream of its own for each) and the client id, so every
algorithm sees the same cohort at a given seed."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.core.round_config import RoundArrays, RoundConfig


SERVER_KEY_STREAM = 0x5E5E  # the server's key is fold_in(round key, this): sampling and client keys stay as they were
STRAGGLER_KEY_STREAM = 0x57A6  # the straggler draw's key: fold_in(round key, this)
SUBSET_KEY_STREAM = 0x5B5E  # the round-subset draw's key: fold_in(round key, this)
NO_BUDGET = jnp.iinfo(jnp.int32).max  # a step budget that never binds


class Cohort(NamedTuple):
    """The clients of one round. ids: ``[Kp]`` client index (``N`` on padding slots);
    mask: ``[Kp]`` 1 for a real client; weights: ``[Kp]`` sum to 1 over the real clients;
    keys: ``[Kp]`` per-client keys (depend on the round key and the client id only);
    budgets: ``[Kp]`` int32 local steps each client may take this round (``NO_BUDGET``: all);
    total: ``[]`` float32 the real clients' weights before renormalisation over the federation's base
    weights, ``sum_{n in A} pi_n / sum_n pi_n`` (``pi_n x_n / E`` for ``by_epochs`` stragglers; exactly 1
    when everybody takes part at their base weight; a client left out for non-finite values counts
    as absent), so ``total * weights`` are the un-renormalised weights. The aggregation receives it
    as ``hparams["cohort_weight"]``."""

    ids: jax.Array
    mask: jax.Array
    weights: jax.Array
    keys: jax.Array
    budgets: jax.Array
    total: jax.Array


def straggler_epochs(config: RoundConfig, arrays: RoundArrays, key: jax.Array, local_epochs: int) -> jax.Array:
    """``[N]`` int32 epochs each client may train this round.

    The ``round(straggler_fraction * N_real)`` real clients with the smallest
    draw ``u_n`` are stragglers and train ``x_n ~ U{1..E}`` epochs; the others E.
    Both draws depend only on ``fold_in(round key, STRAGGLER_KEY_STREAM)`` and
    the client id, so every algorithm sees the same stragglers at a given seed.
    """
    n = config.num_clients
    stream = jax.random.fold_in(key, STRAGGLER_KEY_STREAM)
    draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(stream, i), (2,)))(jnp.arange(n))
    real = arrays.client_mask > 0
    score = jnp.where(real, draws[:, 0], 2.0)
    rank = jnp.argsort(jnp.argsort(score))
    stragglers = real & (rank < jnp.round(config.straggler_fraction * jnp.sum(real)))
    fewer = 1 + jnp.minimum(jnp.floor(draws[:, 1] * local_epochs), local_epochs - 1).astype(jnp.int32)
    return jnp.where(stragglers, fewer, local_epochs).astype(jnp.int32)


def with_round_subsets(config: RoundConfig, arrays: RoundArrays, key: jax.Array) -> RoundArrays:
    """``arrays`` with this round's counts ``round(f_n * n_n)`` (at least 1) and weights ``f_n * w_n``.

    ``f_n`` is drawn uniformly from ``config.round_fractions`` with
    ``fold_in(fold_in(round key, SUBSET_KEY_STREAM), n)``; unchanged without round fractions.
    """
    if config.round_fractions is None:
        return arrays
    fractions = jnp.asarray(config.round_fractions, jnp.float32)
    stream = jax.random.fold_in(key, SUBSET_KEY_STREAM)
    pick = jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(stream, i), (), 0, len(fractions)))
    f = fractions[pick(jnp.arange(arrays.counts.shape[0]))]
    counts = jnp.where(arrays.counts > 0, jnp.maximum(jnp.round(f * arrays.counts), 1), 0).astype(arrays.counts.dtype)
    return arrays._replace(counts=counts, base_weights=arrays.base_weights * f)


def sample_cohort(config: RoundConfig, arrays: RoundArrays, key, batch_size: int = 1, local_epochs: int = 1) -> Cohort:
    """K clients without replacement among the federation's, padded to ``config.padded_cohort`` slots.

    ``batch_size`` and ``local_epochs`` turn straggler epochs into step budgets.
    """
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
    keys = jax.vmap(lambda i: jax.random.fold_in(client_key, i))(ids)
    budgets = jnp.full((kp,), NO_BUDGET, jnp.int32)
    if config.straggler_fraction > 0:
        epochs = straggler_epochs(config, arrays, key, local_epochs)[safe]
        steps_per_epoch = (jnp.where(ids < n, arrays.counts[safe], 0) + batch_size - 1) // batch_size
        budgets = jnp.where(epochs < local_epochs, epochs * steps_per_epoch, NO_BUDGET).astype(jnp.int32)
        if config.straggler_weighting == "by_epochs":
            raw = raw * epochs / local_epochs
    weights = raw / jnp.maximum(jnp.sum(raw), 1e-30)
    if k == n and not (config.straggler_fraction > 0 and config.straggler_weighting == "by_epochs"):
        total = jnp.float32(1.0)  # everybody at their base weight: exactly 1
    else:
        federation = jnp.sum(jnp.where(arrays.client_mask > 0, arrays.base_weights, 0.0))
        total = jnp.sum(raw) / jnp.maximum(federation, 1e-30)
    return Cohort(ids, mask, weights, keys, budgets, total.astype(jnp.float32))


def server_key_of(round_key: jax.Array) -> jax.Array:
    """The key ``server_update`` receives (independent of the sampling and client keys)."""
    return jax.random.fold_in(round_key, SERVER_KEY_STREAM)


def group_cohorts(config: RoundConfig, cohort: Cohort):
    """``[(group, positions, sub_cohort)]``: each group's clients of the cohort in ``group_slots(g)`` slots.

    ``positions [S_g]`` are the slots' places in the cohort (``Kp`` on padding; ``None`` for the single
    group, whose sub-cohort is the cohort itself).
    """
    if config.num_groups == 1:
        return [(0, None, cohort)]
    n, kp = config.num_clients, cohort.ids.shape[0]
    safe = jnp.minimum(cohort.ids, n - 1)
    group = jnp.where(cohort.ids < n, jnp.asarray(config.group_of)[safe], -1)
    out = []
    for g in range(config.num_groups):
        positions = jnp.nonzero(group == g, size=config.group_slots(g), fill_value=kp)[0]
        real = positions < kp
        take = lambda a: a[jnp.minimum(positions, kp - 1)]
        sub = Cohort(jnp.where(real, take(cohort.ids), n), jnp.where(real, take(cohort.mask), 0.0),
                     jnp.where(real, take(cohort.weights), 0.0), take(cohort.keys), take(cohort.budgets),
                     cohort.total)
        out.append((g, positions, sub))
    return out


def merge_groups(parts, kp: int):
    """Per-group trees ``[S_g, ...]`` written back into the cohort's ``[Kp, ...]`` order."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    first = parts[0][1]
    signature = lambda tree: jax.tree.map(lambda x: (x.shape[1:], x.dtype), tree)
    for g, (_, tree) in enumerate(parts[1:], 1):
        if jax.tree.structure(tree) != jax.tree.structure(first) or signature(tree) != signature(first):
            raise ValueError(f"architecture group {g}'s client messages or metrics differ in structure or shape from "
                             "group 0's; fix: send only the part every group shares (e.g. the meme or the trunk) and "
                             "keep the rest in the persistent state")
    out = jax.tree.map(lambda x: jnp.zeros((kp,) + x.shape[1:], x.dtype), first)
    for positions, tree in parts:
        out = jax.tree.map(lambda o, t: o.at[positions].set(t, mode="drop"), out, tree)
    return out


__all__ = ["NO_BUDGET", "Cohort", "group_cohorts", "merge_groups", "sample_cohort", "server_key_of",
           "straggler_epochs", "with_round_subsets"]
