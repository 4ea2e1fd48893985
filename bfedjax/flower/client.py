"""A SuperNode's bfedjax client as a Flower ``ClientApp``: the engine's jitted local training.

``client_app(setup)`` answers the strategy's ``query`` (registration) and
``train`` messages (see ``protocol``). ``setup(context)`` says which client
the node is and what it holds (``ClientSetup``); the training itself is the
engine's ``local_training`` (the algorithm's ``client_init``, ``client_step``
under ``lax.scan`` / ``while_loop`` and ``client_final``) under ``jax.jit``,
with the server state, hyper-parameters, client key and step budget the
strategy sent, so the node computes what ``simulate`` computes for that
client. A persistent client state lives in the node's ``Context.state``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from bfedjax.core import layout
from bfedjax.core.client_half import local_training
from bfedjax.core.round_config import persistent_init_key
from bfedjax.core.finite import finite_rows
from bfedjax.core.simulate import traced_hparams
from bfedjax.core.types import Algorithm, ClientContext, ClientData
from bfedjax.flower import protocol as P
from bfedjax.flower import specs
from bfedjax.flower.records import from_record, to_record


@dataclasses.dataclass(frozen=True, eq=False)
class ClientSetup:
    """What one SuperNode trains.

    Attributes:
      algorithm: the same ``Algorithm`` the strategy runs.
      client_id: n, the node's client in the federation (its partition id), ``0 <= n < N``.
      data: the client's own ``ClientData``: x ``[m, ...]``, y ``[m, ...]``, count ``m`` real rows
        (padding rows after them change nothing: batches depend only on the real rows).
      group: the client's architecture group (``RoundConfig.client_groups``), 0 by default.
      init_params: the global model's parameters or their shapes (default: the algorithm's
        ``init_params`` hook at the data's input shape); only their structure is read.
    """

    algorithm: Algorithm
    client_id: int
    data: ClientData
    group: int = 0
    init_params: object = None

    def params_like(self):
        """The global model's parameters as ``ShapeDtypeStruct`` objects."""
        if self.init_params is not None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), self.init_params)
        return specs.params_spec(self.algorithm, tuple(self.data.x.shape[1:]))


@functools.lru_cache(maxsize=8)
def _trainer(algorithm: Algorithm, group: int):
    """``(server, persistent, data, hparams, key, budget) -> (message, persistent, metrics)``, jitted once."""
    def train(server, persistent, data, hparams, key, budget):
        return local_training(algorithm, ClientContext(server, persistent, data, hparams, group, None), key, budget)
    return jax.jit(train)


@functools.lru_cache(maxsize=8)
def _persistent_init(algorithm: Algorithm, group: int):
    return jax.jit(lambda params, key: algorithm.persistent_init(params, key, group))


def register(setup: ClientSetup, message: Message, context: Context) -> Message:
    """The ``query`` reply: client id, sample count, group; initialises the persistent state if any."""
    algorithm = setup.algorithm
    if algorithm.persistent_init is not None:
        params = from_record(message.content[P.INIT], setup.params_like())
        key = persistent_init_key(P.key_from_config(message.content[P.CONFIG][P.INIT_KEY]), setup.client_id)
        context.state[P.PERSISTENT] = to_record(_persistent_init(algorithm, setup.group)(params, key))
    node = {P.CLIENT_ID: int(setup.client_id), P.NUM_EXAMPLES: int(setup.data.count), P.GROUP: int(setup.group)}
    return Message(RecordDict({P.NODE: MetricRecord(node)}), reply_to=message)


def train(setup: ClientSetup, message: Message, context: Context) -> Message:
    """The ``train`` reply: the client's message and metrics after its local training.

    A client whose message or new persistent state holds NaN or Inf keeps its old state and
    answers with an error (the engine leaves such a client out of the round).
    """
    algorithm = setup.algorithm
    config = message.content[P.CONFIG]
    if config[P.CLIENT_ID] != setup.client_id:
        raise ValueError(f"this node holds client {setup.client_id}, the server asked for client {config[P.CLIENT_ID]}")
    params = setup.params_like()
    server = from_record(message.content[P.SERVER], specs.server_spec(algorithm, params), finite=False)
    round_index, overrides = P.hparams_from_config(config)
    if set(overrides) != set(algorithm.hparams):
        raise ValueError(f"the server sent hyper-parameters {sorted(overrides)}; {algorithm.name} has "
                         f"{sorted(algorithm.hparams)} (fix: run the same algorithm on the server and the nodes)")
    hparams = traced_hparams(algorithm, round_index, overrides)
    persistent = ()
    if algorithm.persistent_init is not None:
        if P.PERSISTENT not in context.state:
            raise ValueError("no persistent state: the node was not registered in this run (query message)")
        persistent = from_record(context.state[P.PERSISTENT], specs.persistent_spec(algorithm, params, setup.group))
    key = P.key_from_config(config[P.CLIENT_KEY])
    budget = jnp.asarray(config[P.STEP_BUDGET], jnp.int32)
    data = ClientData(jnp.asarray(setup.data.x), jnp.asarray(setup.data.y), jnp.asarray(setup.data.count, jnp.int32))
    with layout.random_bits_lowering():  # as simulate's rounds
        out, new_persistent, metrics = _trainer(algorithm, setup.group)(server, persistent, data, hparams, key, budget)
    if not bool(finite_rows(jax.tree.map(lambda x: jnp.asarray(x)[None], (out, new_persistent)), 1)[0]):
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"client {setup.client_id}: local training gave "
                             "NaN or Inf; the client keeps its state"), reply_to=message)
    if algorithm.persistent_init is not None:
        context.state[P.PERSISTENT] = to_record(new_persistent)
    fields = {name: float(value) for name, value in metrics.items()}
    fields.update({P.CLIENT_ID: int(setup.client_id), P.NUM_EXAMPLES: int(setup.data.count)})
    return Message(RecordDict({P.MESSAGE: to_record(out), P.METRICS: MetricRecord(fields)}), reply_to=message)


def client_app(setup: Callable[[Context], ClientSetup]) -> ClientApp:
    """A ``ClientApp`` whose node is ``setup(context)`` (called for every message; cache it if costly)."""
    app = ClientApp()

    @app.query()
    def _query(message: Message, context: Context) -> Message:
        return register(setup(context), message, context)

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        return train(setup(context), message, context)

    return app


__all__ = ["ClientSetup", "client_app", "register", "train"]
