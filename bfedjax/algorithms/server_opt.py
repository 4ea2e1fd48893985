"""Server optimisers (FedOpt, Reddi et al.; FedRef Eqs. 4-6): optax on the server's pseudo-gradient.

Any algorithm whose server state holds ``"params"`` can take a server
optimiser. The algorithm aggregates as usual into ``A_r``; the server then
treats ``g_r = theta_r - A_r`` (the negative mean client update, Algorithm 4's
``-Delta_r``) as a gradient and steps with an optax transformation:

    theta_{r+1} = theta_r + tx.update(g_r)          (optax updates already carry -eta)

* FedAdam (Eq. 5): ``optax.adam(eta, b1, b2, eps=tau)``: ``m_hat / (sqrt(v_hat) + tau)``.
* FedYogi (Eq. 6): ``optax.yogi(eta, b1, b2, eps=tau)`` (optax starts both moments at 1e-6).
* FedAdagrad (Eq. 4): ``optax.adagrad(eta, initial_accumulator_value=0, eps=tau**2)``:
  ``g / sqrt(G + tau^2)``; Eq. 4 puts ``tau`` outside the root, ``g / (sqrt(G) + tau)``
  (the two agree once ``sqrt(G) >> tau``).
* ``sgd``: ``optax.sgd(eta)``; at ``eta = 1`` it is the plain aggregate (FedAvg).

The optimiser's state lives in the server state under ``"server_opt"``, so it
is checkpointed, sharded and traced like the rest. With the streamed
aggregation (``client_stats``) the wrapper keeps streaming.
"""
from __future__ import annotations

import jax
import optax

from bfedjax.core.types import Algorithm

SERVER_OPTIMIZERS = ("adam", "yogi", "adagrad", "sgd")
STATE_KEY = "server_opt"


def server_optimizer(name: str, lr: float, *, b1: float = 0.9, b2: float = 0.99,
                     tau: float = 1e-3) -> optax.GradientTransformation:
    """The optax transformation of FedAdam / FedYogi / FedAdagrad / server SGD (defaults: FedRef spec 7a)."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"server optimizer {name!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}")
    if lr <= 0 or tau < 0:
        raise ValueError(f"server optimizer needs lr > 0 and tau >= 0, got lr={lr}, tau={tau}")
    if name == "adam":
        return optax.adam(lr, b1=b1, b2=b2, eps=tau)
    if name == "yogi":
        return optax.yogi(lr, b1=b1, b2=b2, eps=tau)
    if name == "adagrad":
        return optax.adagrad(lr, initial_accumulator_value=0.0, eps=tau ** 2)
    return optax.sgd(lr)


def with_server_optimizer(algorithm: Algorithm, tx: optax.GradientTransformation, name: str | None = None,
                          ) -> Algorithm:
    """``algorithm`` whose aggregate ``A_r`` becomes the pseudo-gradient ``theta_r - A_r`` of ``tx``.

    Args:
      algorithm: any ``Algorithm`` whose server state is a dict with ``"params"``.
      tx: an optax transformation (``server_optimizer(...)`` or any other).
      name: the new algorithm's name (default ``"<name>+server_opt"``).
    Returns:
      The same algorithm with ``server["server_opt"]`` (``tx``'s state) and the server step;
      it reports ``server_update_norm``, the global norm of ``theta_{r+1} - theta_r``.
    """

    def server_init(params):
        server = algorithm.server_init(params)
        if not isinstance(server, dict) or "params" not in server:
            raise ValueError(f"a server optimizer needs a server state with 'params'; {algorithm.name}'s has none")
        return {**server, STATE_KEY: tx.init(server["params"])}

    def step(server, new, metrics, hparams):
        del hparams
        pseudo_grad = jax.tree.map(lambda old, agg: old - agg, server["params"], new["params"])
        updates, opt_state = tx.update(pseudo_grad, server[STATE_KEY], server["params"])
        params = optax.apply_updates(server["params"], updates)
        metrics = {**metrics, "server_update_norm": optax.tree.norm(updates)}
        return {**new, "params": params, STATE_KEY: opt_state}, metrics

    return wrap_server(algorithm, server_init, step, name or f"{algorithm.name}+server_opt")


def wrap_server(algorithm: Algorithm, server_init, step, name: str) -> Algorithm:
    """``algorithm`` with a new ``server_init`` and, after its aggregation,
    ``step(old_server, aggregated_server, metrics, hparams) -> (server, metrics)``.

    The shared plumbing of the server-side layers (server optimisers, FedRef's
    reference model): streamed aggregations (``client_stats`` / ``server_from_stats``)
    stay streamed. The inner aggregation sees the whole server state and
    ``step`` restores the layer's own entries.
    """
    if algorithm.streams:
        def server_from_stats(server, summed, mask, hparams, key):
            new, metrics = algorithm.server_from_stats(server, summed, mask, hparams, key)
            return step(server, new, metrics, hparams)
        return algorithm.replace(name=name, server_init=server_init, server_from_stats=server_from_stats)

    def server_update(server, messages, weights, mask, hparams, key):
        new, metrics = algorithm.server_update(server, messages, weights, mask, hparams, key)
        return step(server, new, metrics, hparams)
    return algorithm.replace(name=name, server_init=server_init, server_update=server_update)
