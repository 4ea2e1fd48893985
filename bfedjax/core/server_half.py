"""The server half of a round (``finish_round``): the malicious clients' attack, the drop of clients whose
message or new state is not finite, the aggregation and the round's metrics, as every backend and the
Flower strategy run them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bfedjax.core.attacks import attacked_messages
from bfedjax.core.finite import finite_rows, zero_rows
from bfedjax.core.round_config import EngineState, RoundArrays, RoundConfig
from bfedjax.core.round_metrics import client_metric_sums, local_metric_sums, round_record
from bfedjax.core.sampling import Cohort
from bfedjax.core.types import COHORT_WEIGHT, Algorithm


def _kept_if_nobody_counts(new_server, old_server, weights, mask):
    """A cohort whose real clients all weigh zero leaves the server state as it was."""
    counts = jnp.sum(jnp.where(mask > 0, weights, 0.0)) > 0
    return jax.tree.map(lambda new, old: jnp.where(counts, new, old), new_server, old_server)


def attacked(algorithm, config, state, arrays, ids, keys, messages):
    """The slots' messages after the malicious clients' attack (unchanged without one)."""
    if config.attack is None or arrays.malicious is None:
        return messages
    n = arrays.malicious.shape[0]
    malicious = (ids < n) & (arrays.malicious[jnp.minimum(ids, n - 1)] > 0)
    return attacked_messages(config.attack, messages, algorithm.global_params(state.server), malicious, keys)


def _fault_metrics(config, ids, bad) -> dict:
    """``nonfinite_clients`` (and ``first_nonfinite_client``, -1 if none, with ``on_nonfinite="stop"``)."""
    metrics = {"nonfinite_clients": jnp.sum(bad).astype(jnp.float32)}
    if config.on_nonfinite == "stop":
        first = jnp.min(jnp.where(bad, ids, jnp.iinfo(jnp.int32).max))
        metrics["first_nonfinite_client"] = jnp.where(jnp.any(bad), first, -1).astype(jnp.float32)
    return metrics


def _without_nonfinite(config, cohort: Cohort, messages, finite):
    """``(cohort, messages, metrics)`` with the real slots whose values are not finite left out:
    mask and weight 0 (the others renormalised, only when someone was dropped, and ``total`` shrunk
    by the dropped share), message zeroed."""
    bad = (cohort.mask > 0) & ~finite
    weights = jnp.where(bad, 0.0, cohort.weights)
    kept = jnp.sum(weights)
    weights = jnp.where(jnp.any(bad), weights / jnp.maximum(kept, 1e-30), cohort.weights)
    total = jnp.where(jnp.any(bad), cohort.total * kept, cohort.total)
    cohort = cohort._replace(mask=jnp.where(bad, 0.0, cohort.mask), weights=weights, total=total)
    return cohort, zero_rows(messages, finite), _fault_metrics(config, cohort.ids, bad)


def aggregation_hparams(hparams, total):
    """The aggregation's hyper-parameters: the round's plus ``cohort_weight`` (``Cohort.total``, ``[]``)."""
    return {**hparams, COHORT_WEIGHT: total}


def finish_round(algorithm: Algorithm, config: RoundConfig, state: EngineState, arrays: RoundArrays, cohort: Cohort,
                 messages, client_metrics, finite, persistent, hparams, server_key):
    """``(EngineState, metrics)``: the server half of a round from the cohort's client outputs.

    The attack, the non-finite drop, the aggregation and the evaluation, as every backend (and the
    Flower strategy, with the replies) runs them. messages: ``[Kp, ...]``; client_metrics:
    ``{name: [Kp]}``; finite: ``[Kp]`` bool, False for a slot whose message or new persistent state
    is not finite (or that is left out like one); persistent: the new persistent state (returned as is).
    """
    if config.attack is not None:  # an attack may send NaN itself
        messages = attacked(algorithm, config, state, arrays, cohort.ids, cohort.keys, messages)
        finite = finite & finite_rows(messages, cohort.ids.shape[0])
    cohort, messages, fault_metrics = _without_nonfinite(config, cohort, messages, finite)
    server, server_metrics = algorithm.aggregate(state.server, messages, cohort.weights, cohort.mask,
                                                 aggregation_hparams(hparams, cohort.total), server_key)
    server = _kept_if_nobody_counts(server, state.server, cohort.weights, cohort.mask)
    local_sums = local_metric_sums(algorithm, config, arrays, messages, cohort.weights, cohort.mask, hparams)
    metrics = round_record(algorithm, config, arrays, server, {**server_metrics, **fault_metrics},
                           client_metric_sums(client_metrics, cohort.mask), cohort.mask, local_sums, hparams)
    return EngineState(server, persistent), metrics


__all__ = ["aggregation_hparams", "attacked", "finish_round"]
