"""A round's metrics: client metrics summed over the real clients, the evaluate hook on the global model
(``global_<name>``) and, weighted, on every local model (``local_<name>``, the papers' LA), on the rounds
``RoundConfig.evaluate_every`` evaluates; ``round_record`` gathers them and refuses clashing names."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def client_metric_sums(metrics, mask):
    """``{name: sum over real clients}`` of per-client scalar metrics ``[C]``."""
    for name, value in metrics.items():
        if jnp.shape(value) != mask.shape:
            raise ValueError(f"client metric {name!r} has shape {jnp.shape(value)[1:]} per client; client_final's "
                             "metrics must be scalars (fix: reduce it, e.g. jnp.mean)")
    return {name: jnp.sum(jnp.where(mask > 0, value, 0.0)) for name, value in metrics.items()}


def _on_evaluation_rounds(config, hparams, metrics_fn):
    """``metrics_fn()`` (a dict of scalars) in the rounds ``config.evaluate_every`` evaluates, NaN (and no
    work) in the others."""
    if config.evaluate_every == 1:
        return metrics_fn()
    shapes = jax.eval_shape(metrics_fn)
    skipped = lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)
    return jax.lax.cond(hparams["round"] % config.evaluate_every == 0, metrics_fn, skipped)


def local_metric_sums(algorithm, config, arrays, messages, weights, mask, hparams):
    """``{local_<name>: sum_c w_c * metric(local model c)}`` through the evaluate hook (the LA of the paper)."""
    if not (config.evaluate_local and algorithm.can_score_local(messages)):
        return {}

    def sums():
        models = jax.vmap(algorithm.scored_local)(messages)  # [C, ...]: a selection of the messages' leaves
        scores = jax.lax.map(lambda model: algorithm.evaluate(model, arrays.x_test, arrays.y_test), models)
        return {f"local_{name}": jnp.sum(jnp.where(mask > 0, weights * value, 0.0)) for name, value in scores.items()}

    return _on_evaluation_rounds(config, hparams, sums)


def _global_metrics(algorithm, config, arrays, server, hparams):
    if algorithm.evaluate is None:
        return {}

    def scores():
        return {f"global_{name}": value for name, value in
                algorithm.evaluate(algorithm.scored_global(server), arrays.x_test, arrays.y_test).items()}

    return _on_evaluation_rounds(config, hparams, scores)


RESERVED_METRICS = ("round", "seconds", "best_global_accuracy")


def round_record(algorithm, config, arrays, server, server_metrics, client_sums, mask, local_sums, hparams):
    """The round's record: client metrics averaged over real clients, server, global and local metrics."""
    real = jnp.maximum(jnp.sum(mask), 1.0)
    groups = [("client", {name: total / real for name, total in client_sums.items()}), ("server", server_metrics),
              ("evaluate", _global_metrics(algorithm, config, arrays, server, hparams)), ("evaluate", local_sums)]
    metrics = {}
    for source, group in groups:
        for name, value in group.items():
            if name in metrics or name in RESERVED_METRICS:
                raise ValueError(f"{algorithm.name}: the {source} metric {name!r} clashes with another metric of "
                                 "the round; fix: rename it")
            metrics[name] = value
    return metrics


__all__ = ["RESERVED_METRICS", "client_metric_sums", "local_metric_sums", "round_record"]
