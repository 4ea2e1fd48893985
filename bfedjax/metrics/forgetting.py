"""Forgetting across rounds: FedReg's diagnostic (Xu et al. 2022, App. B.1, Fig. 2).

For a client ``i`` of the previous round's cohort ``C^(t-1)``, with the global model ``theta^(t-1)`` that
round produced and the local models ``theta^(t,j)`` that round ``t``'s clients ``j in C^(t)`` trained from it::

    loss^(t-1)(i) = (1/|D_i|) sum_{d in D_i} L_{theta^(t-1)}(d)
    loss^(t)(i)   = (1/|D_i|) sum_{d in D_i} (1/|C^(t)|) sum_{j in C^(t)} L_{theta^(t,j)}(d)

and the gap ``loss^(t)(i) - loss^(t-1)(i)``: how much round ``t``'s local training raises the loss on the data
that shaped the model it started from. ``L`` is the softmax cross-entropy. ``forgetting_rounds`` runs the
paper's protocol: several algorithms' clients train the global models one of them makes.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from bfedjax.core.types import ClientData
from bfedjax.metrics.classification import evaluate


def client_losses(apply_fn: Callable, params, clients: ClientData) -> jax.Array:
    """``[P]``: the mean cross-entropy of ``params`` on each client's real rows (``metrics.evaluate``'s loss).

    Args:
      apply_fn: ``(params, x [n, ...]) -> logits [n, K]``.
      params: one model's parameters.
      clients: ``ClientData`` with leaves ``[P, n, ...]`` (``count [P]`` real rows each; a client with none
        gets 0).
    """
    def one(x, y, count):
        mask = (jnp.arange(y.shape[0]) < count).astype(jnp.float32)
        return evaluate(apply_fn, params, x, y, mask=mask)["loss"]

    return jax.vmap(one)(clients.x, clients.y, clients.count)


def forgetting_gap(apply_fn: Callable, global_params, local_params, local_mask: jax.Array,
                   previous: ClientData) -> jax.Array:
    """``[P]``: ``loss^(t)(i) - loss^(t-1)(i)`` for the previous round's clients ``i`` (module docstring).

    Args:
      apply_fn: ``(params, x [n, ...]) -> logits [n, K]``.
      global_params: ``theta^(t-1)``, the model round ``t`` started from.
      local_params: ``theta^(t,j)``, leaves ``[C, ...]``: round ``t``'s local models.
      local_mask: ``[C]``, 1 for a real local model, 0 for a padding slot (left out of the mean).
      previous: the previous cohort's training data, ``ClientData`` with leaves ``[P, n, ...]``; pass only its
        real clients (a client with no rows gets a gap of 0).
    """
    per_model = jax.vmap(lambda p: client_losses(apply_fn, p, previous))(local_params)  # [C, P]
    real = local_mask > 0
    after = (jnp.sum(jnp.where(real[:, None], per_model, 0.0), axis=0)
             / jnp.maximum(jnp.sum(real.astype(per_model.dtype)), 1.0))
    return after - client_losses(apply_fn, global_params, previous)


def forgetting_rounds(algorithms: dict, trajectory: str, apply_fn: Callable, fed, key: jax.Array, rounds: int,
                      clients_per_round: int) -> dict:
    """Rounds of the paper's Fig. 2 protocol: every algorithm's clients train the same global models.

    ``algorithms[trajectory]`` makes the global models as ``simulate`` runs it with one vmap over the cohort
    (its cohorts, keys, aggregation and evaluation; clients unweighted; the initial model from
    ``round_key(key, 0)``). Every round, each algorithm in ``algorithms`` trains that round's clients from the
    round's global model, with the same data and keys, and its local models give its gap: ``forgetting_gap``
    over the previous round's clients, non-finite local models left out as the engine leaves them out.
    (FedReg's Fig. 2: ``{"fedavg": ..., "fedreg": ...}`` with ``trajectory="fedreg"``.) The algorithms send
    their local model as ``message["params"]`` and keep no persistent client state.

    Args:
      algorithms: ``{name: Algorithm}``.
      trajectory: the name of the algorithm whose aggregated models the rounds follow.
      apply_fn: ``(params, x [n, ...]) -> logits``, the algorithms' model.
      fed: the ``FederatedData``.
      key: the run's key (as ``simulate``'s).
      rounds: ``T``.
      clients_per_round: ``K``.
    Returns:
      A dict: ``"gap"`` maps each name to ``T - 1`` floats, the mean gap over the previous round's clients in
      rounds ``2 .. T``; ``"accuracy"`` holds ``T`` floats, the trajectory's global accuracy after each round.
    """
    from bfedjax.core import ClientContext, RoundConfig, init_state, local_training, round_arrays, sample_cohort
    from bfedjax.core.client_half import client_inputs
    from bfedjax.core.finite import finite_rows
    from bfedjax.core.sampling import server_key_of
    from bfedjax.core.server_half import finish_round
    from bfedjax.core.simulate import round_key, traced_hparams

    main = algorithms[trajectory]
    config = RoundConfig(num_clients=fed.num_clients, clients_per_round=clients_per_round, evaluate_local=False)
    arrays = round_arrays(fed, "uniform")
    state = init_state(main, main.init_params(round_key(key, 0), fed.input_shape), config)
    # the federation's arrays are arguments, not constants baked into the compiled functions
    sample = jax.jit(lambda arrays, rk: sample_cohort(config, arrays, rk, main.batch_size, main.local_epochs))
    cohort_data = jax.jit(lambda state, arrays, ids: jax.vmap(
        lambda cid: client_inputs(state, arrays, config, cid, 0)[0])(ids))
    finish = jax.jit(lambda *args: finish_round(main, config, *args))

    def local_models(algorithm):
        """``(server, ClientData [K, ...], keys [K], budgets [K], hparams) -> (messages, metrics, finite [K])``."""
        def one(server, data, client_key, budget, hparams):
            message, _, metrics = local_training(algorithm, ClientContext(server, (), data, hparams), client_key,
                                                 budget)
            return message, metrics

        def cohort(server, data, keys, budgets, hparams):
            messages, metrics = jax.vmap(one, in_axes=(None, 0, 0, 0, None))(server, data, keys, budgets, hparams)
            return messages, metrics, finite_rows(messages, keys.shape[0])
        return jax.jit(cohort)

    train = {name: local_models(algorithm) for name, algorithm in algorithms.items()}
    mean_gap = jax.jit(lambda theta, local, mask, previous: jnp.mean(forgetting_gap(apply_fn, theta, local, mask,
                                                                                    previous)))
    gaps, accuracy, previous = {name: [] for name in algorithms}, [], None
    for t in range(1, rounds + 1):
        rk = round_key(key, t)
        cohort = sample(arrays, rk)
        data = cohort_data(state, arrays, cohort.ids)
        theta = main.global_params(state.server)
        outputs = {}
        for name, algorithm in algorithms.items():
            server = state.server if name == trajectory else algorithm.server_init(theta)
            outputs[name] = train[name](server, data, cohort.keys, cohort.budgets, traced_hparams(algorithm, t))
            if previous is not None:
                messages, _, finite = outputs[name]
                gaps[name].append(float(mean_gap(theta, messages["params"], cohort.mask * finite, previous)))
        messages, metrics, finite = outputs[trajectory]
        state, round_metrics = finish(state, arrays, cohort, messages, metrics, finite, state.persistent,
                                      traced_hparams(main, t), server_key_of(rk))
        accuracy.append(float(round_metrics["global_accuracy"]))
        previous = data
    return {"gap": gaps, "accuracy": accuracy}
