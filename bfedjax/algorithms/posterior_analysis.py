"""Layers that measure a round's aggregation against FOLA's Sec. IV-E analysis, on any algorithm.

``with_posterior_distance``  reports the aggregation error and the local forgetting of every round: the
                             distance (``posteriors.distance``) of the aggregate and of the clients' trained
                             models to a known global posterior (Fig. 12).
``with_aggregation_sweep``   reports, on chosen rounds, the test accuracy of the two clients' aggregate with
                             client 1's weight pi_1 swept over a grid, the algorithm's own aggregation rule
                             applied with weights ``(pi_1, 1 - pi_1)`` (Fig. 10b-c; FedAvg's rule gives the line
                             between the two models, FOLA's product the ridge of the posterior mixture).

Both keep every cohort message for the measurement (no streamed aggregation); the aggregation passed on to the
next round is the algorithm's own, unchanged.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from bfedjax.core.types import Algorithm, engine_hparam, require_message_keys
from bfedjax.posteriors.distance import ReferencePosterior, posterior_distance


def _needs_params(algorithm: Algorithm, messages, layer: str) -> None:
    require_message_keys(messages, ("params",), layer, "the clients' trained models (message 'params')",
                         algorithm.name, "use it with an algorithm whose message holds the local model (fedavg, "
                         "fola, fedprox, ...)")


def with_posterior_distance(algorithm: Algorithm, reference: ReferencePosterior) -> Algorithm:
    """``algorithm`` that also reports, every round (FOLA Sec. IV-E, Fig. 12):

    ``aggregation_error``  AE = D(theta_S, theta*): the aggregate's distance (``algorithm.global_params`` of the new
                           server state) to the reference posterior;
    ``local_forgetting``   LF = sum_n w_n D(theta_n, theta*) over the cohort's trained models ``messages["params"]``
                           ``[C, ...]``, with the round's aggregation weights ``w [C]`` (pi_n renormalised over the
                           cohort; padding and dropped clients weigh 0).
    """
    def server_update(server, messages, weights, mask, hparams, key):
        _needs_params(algorithm, messages, "with_posterior_distance")
        new_server, metrics = algorithm.aggregate(server, messages, weights, mask, hparams, key)
        local = jax.lax.map(lambda params: posterior_distance(params, reference), messages["params"])
        counted = jnp.where(mask > 0, weights, 0.0)
        forgetting = jnp.sum(counted * local) / jnp.maximum(jnp.sum(counted), 1e-30)
        error = posterior_distance(algorithm.global_params(new_server), reference)
        return new_server, {**metrics, "aggregation_error": error, "local_forgetting": forgetting}

    return algorithm.replace(server_update=server_update, client_stats=None, server_from_stats=None)


def sweep_metric(pi: float) -> str:
    """The metric name of the swept aggregate's test accuracy at client 1's weight ``pi``
    (``sweep_accuracy_pi0.51``)."""
    return f"sweep_accuracy_pi{pi:g}"


def swept_aggregate(algorithm: Algorithm, server, messages, pi, mask, hparams, key):
    """The server state ``algorithm.aggregate`` makes of a two-client cohort's ``messages`` (``[2, ...]``) from
    ``server`` when the first slot weighs ``pi`` (``[]``) and the second ``1 - pi`` (a slot with ``mask [2]`` 0
    weighs 0)."""
    weights = jnp.stack([pi, 1.0 - pi]).astype(jnp.float32) * mask
    return algorithm.aggregate(server, messages, weights, mask, hparams, key)[0]


def with_aggregation_sweep(algorithm: Algorithm, pis: Sequence[float], x_test, y_test,
                           rounds: Sequence[int]) -> Algorithm:
    """``algorithm`` that also reports, on the rounds ``rounds`` (1-based; NaN on the others), the global test
    accuracy of the cohort's aggregate with weights ``(pi, 1 - pi)`` for every ``pi`` in ``pis``
    (``sweep_metric(pi)``; FOLA Sec. IV-E, Fig. 10b-c).

    The cohort must be two clients (the figure's setting); ``pi`` weighs the cohort's first slot, client 0 when
    both take part every round in one vmap (``simulate(clients_per_chunk=None)``; chunked layouts order the slots
    by size). Each aggregate is ``swept_aggregate`` of the round's two messages from the round's incoming server
    state, so each point is what the algorithm would have passed on had client 1 weighed ``pi``; at the run's own
    ``pi_1`` it is the round's GA. The accuracy is the evaluate hook's on ``x_test [M, ...]``, ``y_test [M]``
    (held as constants of the round).
    """
    if algorithm.evaluate is None:
        raise ValueError(f"with_aggregation_sweep scores aggregates with the evaluate hook; {algorithm.name} has "
                         "none; fix: an algorithm built with an evaluate hook (classification models have one)")
    grid = jnp.asarray(pis, jnp.float32)
    on_rounds = jnp.asarray(sorted(set(int(r) for r in rounds)), jnp.int32)
    names = [sweep_metric(pi) for pi in pis]
    if len(set(names)) != len(names):
        raise ValueError(f"pis {list(pis)} repeat a value; fix: give each weight once")

    def server_update(server, messages, weights, mask, hparams, key):
        _needs_params(algorithm, messages, "with_aggregation_sweep")
        if mask.shape[0] != 2:
            raise ValueError(f"with_aggregation_sweep sweeps two clients' weights; the cohort has {mask.shape[0]}; "
                             "fix: two clients, both in every round")
        round_index = engine_hparam(hparams, "round", "with_aggregation_sweep", "which rounds to sweep")
        new_server, metrics = algorithm.aggregate(server, messages, weights, mask, hparams, key)

        def accuracies():
            def at(pi):
                swept = swept_aggregate(algorithm, server, messages, pi, mask, hparams, key)
                return algorithm.evaluate(algorithm.scored_global(swept), x_test, y_test)["accuracy"]
            return jax.lax.map(at, grid)

        sweep = jax.lax.cond(jnp.any(round_index == on_rounds), accuracies,
                             lambda: jnp.full(grid.shape, jnp.nan, jnp.float32))
        return new_server, {**metrics, **{name: sweep[i] for i, name in enumerate(names)}}

    return algorithm.replace(server_update=server_update, client_stats=None, server_from_stats=None)


__all__ = ["sweep_metric", "swept_aggregate", "with_aggregation_sweep", "with_posterior_distance"]
