"""Any bfedjax ``Algorithm`` as a Flower strategy (``flwr.serverapp.strategy.Strategy``).

The strategy is the server half of the engine's round: it registers the
SuperNodes (each holds one client, its partition id n), samples the cohort
with the engine's ``sample_cohort`` from the round key ``round_key(key, r)``
(so cohorts, client keys and step budgets are ``simulate``'s), sends the
server state to the cohort's nodes, checks every reply against the
structures it derives from the algorithm, and aggregates with the engine's
``finish_round`` (the non-finite drop, the algorithm's own ``server_update``
or ``client_stats``/``server_from_stats``, and the evaluate hook on the
server's test set). A reply that is missing, an error, or malformed (a
missing or extra array, another shape or dtype, NaN/Inf, a wrong client id or
sample count) is logged with the node id and the reason, counted in the
round's ``rejected_clients`` and left out of the aggregation like the
engine's dropped clients (``nonfinite_clients`` counts every slot left out).

Run it with Flower's loop: ``strategy.start(grid, num_rounds=R)`` (``Strategy.start`` on a grid
that checks for replies every ``poll_interval`` seconds instead of Flower's 3).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from bfedjax.core import layout
from bfedjax.core.sampling import sample_cohort, server_key_of
from bfedjax.core.round_config import EngineState, RoundArrays, RoundConfig
from bfedjax.core.server_half import finish_round
from bfedjax.core.simulate import client_base_weights, cohort_size, round_key, traced_hparams
from bfedjax.core.types import Algorithm
from bfedjax.flower import protocol as P
from bfedjax.flower import specs
from bfedjax.flower.records import from_record, record_problem, to_record


class AlgorithmStrategy(Strategy):
    """A bfedjax algorithm's rounds over a Flower ``Grid``, client for client ``simulate``'s.

    Args:
      algorithm: the ``Algorithm`` (e.g. ``bf.algorithms.fola(model)``), the same object the
        ClientApp trains.
      num_clients: N, the federation's clients; node ``n`` registers as client ``n``.
      key: the run key (``simulate``'s ``key``): round r uses ``round_key(key, r)``.
      x_test: ``[T, ...]``, y_test: ``[T, ...]``: the server's test set, scored by the evaluate
        hook (``global_<name>``, ``local_<name>``); its rows' shapes and dtypes are a client's data's.
      clients_per_round / participation: the cohort size K (default: everybody), as ``simulate``.
      init_params: the initial global model (default ``algorithm.init_params(round_key(key, 0), ...)``).
      init_server: a whole initial server state instead (e.g. from ``bf.core.pretrain``).
      client_weights: ``None`` / ``"by_size"`` (m_n / m, from the registered counts), ``"uniform"``
        or ``[N]`` weights, as ``simulate``.
      hparams_fn: ``round -> {name: value}`` overrides of the algorithm's hyper-parameters.
      evaluate_local, straggler_fraction, straggler_weighting: as ``simulate``.
      max_examples: the largest sample count a node may register (larger is refused).
      wait_for_nodes: seconds to wait for N nodes to connect before registering those present.
      on_round: called after each round with ``(record, server)``: the round's metrics as floats
        (``round``, ``seconds``, ``rejected_clients``, the engine's) and the new server state.
      poll_interval: seconds between two checks for replies in ``start``.
    """

    def __init__(self, algorithm: Algorithm, *, num_clients: int, key: jax.Array, x_test, y_test,
                 clients_per_round: int | None = None, participation: float | None = None, init_params=None,
                 init_server=None, client_weights=None, hparams_fn: Callable[[int], dict] | None = None,
                 evaluate_local: bool = True, straggler_fraction: float = 0.0, straggler_weighting: str = "unchanged",
                 max_examples: int = 10 ** 9, wait_for_nodes: float = 120.0,
                 on_round: Callable[[dict, object], None] | None = None, poll_interval: float = 0.2):
        self.algorithm, self.key = algorithm, key
        self.config = RoundConfig(num_clients=num_clients,
                                  clients_per_round=cohort_size(num_clients, clients_per_round, participation),
                                  evaluate_local=evaluate_local, straggler_fraction=straggler_fraction,
                                  straggler_weighting=straggler_weighting)
        self.x_test, self.y_test = jnp.asarray(x_test), jnp.asarray(y_test)
        if self.x_test.ndim < 1 or self.x_test.shape[0] < 1 or self.y_test.shape[:1] != self.x_test.shape[:1]:
            raise ValueError(f"x_test {self.x_test.shape} / y_test {self.y_test.shape} must hold the same T >= 1 rows")
        input_shape = tuple(self.x_test.shape[1:])
        if init_params is None and init_server is None:
            if algorithm.init_params is None:
                raise ValueError(f"{algorithm.name} has no init_params hook; fix: pass init_params=...")
            init_params = algorithm.init_params(round_key(key, 0), input_shape)
        if init_params is None:
            init_params = algorithm.global_params(init_server)
        self.init_params = init_params
        self.server = algorithm.server_init(init_params) if init_server is None else init_server
        self.client_weights, self.hparams_fn, self.on_round = client_weights, hparams_fn, on_round
        self.max_examples, self.wait_for_nodes = int(max_examples), float(wait_for_nodes)
        self.poll_interval = float(poll_interval)
        self._timeout: float | None = None  # start's, for the registration too
        self._server_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), self.server)
        example = lambda a: a[:algorithm.batch_size]
        self._message_like, metrics_like = specs.reply_spec(algorithm, self._server_like, init_params,
                                                            example(self.x_test), example(self.y_test))
        self._metric_names = tuple(metrics_like)
        self._sample = jax.jit(lambda arrays, k: sample_cohort(self.config, arrays, k, algorithm.batch_size,
                                                               algorithm.local_epochs))
        self._finish = jax.jit(lambda *args: finish_round(algorithm, self.config, *args))
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.counts: np.ndarray | None = None
        self._arrays: RoundArrays | None = None
        self._round: tuple | None = None

    # --- registration ----------------------------------------------------------------------------

    def initial_arrays(self) -> ArrayRecord:
        """The initial server state as named arrays (``start``'s ``initial_arrays``)."""
        return to_record(self.server)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600, **kwargs):
        """Flower's ``Strategy.start`` from ``initial_arrays()`` (by default), polling ``grid`` every
        ``poll_interval`` seconds; returns Flower's ``Result`` (``train_metrics_clientapp``: the rounds' metrics)."""
        initial = self.initial_arrays() if initial_arrays is None else initial_arrays
        self._timeout = timeout
        return super().start(PromptGrid(grid, self.poll_interval), initial, num_rounds, timeout, **kwargs)

    def register(self, grid: Grid, timeout: float | None = None) -> None:
        """Asks every connected node for its client id, sample count and group (``query`` message).

        Waits up to ``wait_for_nodes`` seconds for N nodes and ``timeout`` seconds (default: ``start``'s)
        for their answers. A malformed or duplicate answer is logged and that node is left out; a
        client no node registered is masked out (never sampled).
        """
        deadline = time.time() + self.wait_for_nodes
        while len(list(grid.get_node_ids())) < self.config.num_clients and time.time() < deadline:
            time.sleep(0.2)
        nodes = sorted(grid.get_node_ids())
        content = {P.CONFIG: ConfigRecord({P.INIT_KEY: P.key_to_config(round_key(self.key, 0))})}
        if self.algorithm.persistent_init is not None:
            content[P.INIT] = to_record(self.init_params)
        messages = [Message(RecordDict(content), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
        counts = np.zeros(self.config.num_clients, np.int64)
        for reply in grid.send_and_receive(messages, timeout=self._timeout if timeout is None else timeout):
            node = reply.metadata.src_node_id
            problem, client, count = self._registration_problem(reply)
            if problem is None and client in self.node_of:
                problem = f"client id {client} is already node {self.node_of[client]}'s"
            if problem is not None:
                log(WARNING, "bfedjax: node %d not registered: %s", node, problem)
                continue
            self.node_of[client], counts[client] = node, count
        missing = sorted(set(range(self.config.num_clients)) - set(self.node_of))
        if len(missing) == self.config.num_clients:
            raise RuntimeError(f"no node registered among {len(nodes)} connected; fix: start N="
                               f"{self.config.num_clients} SuperNodes with --node-config 'partition-id=<n>'")
        if missing:
            log(WARNING, "bfedjax: no node holds clients %s; they are never sampled", missing)
        self.counts = counts
        mask = np.isin(np.arange(self.config.num_clients), list(self.node_of)).astype(np.float32)
        weights = client_base_weights(counts, self.client_weights)  # unregistered clients are masked out
        self._arrays = RoundArrays(x=None, y=None, counts=jnp.asarray(counts, jnp.int32),
                                   base_weights=jnp.asarray(weights), client_mask=jnp.asarray(mask),
                                   x_test=self.x_test, y_test=self.y_test)
        log(INFO, "bfedjax: %d of %d clients registered (%s examples)", len(self.node_of), self.config.num_clients,
            int(counts.sum()))

    def _registration_problem(self, reply: Message):
        if reply.has_error():
            return f"error reply: {reply.error.reason}", None, None
        if set(reply.content.keys()) != {P.NODE}:
            return f"expected the record {P.NODE!r}, got {sorted(reply.content.keys())}", None, None
        node = reply.content[P.NODE]
        if set(node.keys()) != set(P.NODE_FIELDS) or not all(P.is_int(node[k]) for k in P.NODE_FIELDS):
            return f"expected the integers {list(P.NODE_FIELDS)}, got {dict(node)}", None, None
        client, count, group = (int(node[k]) for k in P.NODE_FIELDS)
        if not 0 <= client < self.config.num_clients:
            return f"client id {client} is not in [0, {self.config.num_clients})", None, None
        if not 1 <= count <= self.max_examples:
            return f"num-examples {count} is not in [1, {self.max_examples}]", None, None
        if not 0 <= group < self.algorithm.num_groups:
            return f"group {group} is not in [0, {self.algorithm.num_groups})", None, None
        return None, client, count

    # --- the round -------------------------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The round's ``train`` messages: the server state and each cohort client's key and budget."""
        del config  # the round's settings come from the algorithm (hparams_fn for overrides)
        if self._arrays is None:
            self.register(grid)
        self.server = from_record(arrays, self._server_like, finite=False)  # our own state, NaN or not
        hparams = traced_hparams(self.algorithm, server_round,
                                 self.hparams_fn(server_round) if self.hparams_fn else None)
        key = round_key(self.key, server_round)
        with layout.random_bits_lowering():  # as simulate's rounds
            cohort = self._sample(self._arrays, key)
        self._round = (server_round, cohort, hparams, server_key_of(key), time.perf_counter())
        ids, mask = np.asarray(cohort.ids), np.asarray(cohort.mask)
        keys, budgets = np.asarray(cohort.keys), np.asarray(cohort.budgets)
        messages = []
        for slot in np.flatnonzero(mask > 0):
            client = int(ids[slot])
            fields = {**P.hparams_to_config(hparams), P.CLIENT_ID: client, P.CLIENT_KEY: P.key_to_config(keys[slot]),
                      P.STEP_BUDGET: int(budgets[slot])}
            content = RecordDict({P.SERVER: arrays, P.CONFIG: ConfigRecord(fields)})
            messages.append(Message(content, dst_node_id=self.node_of[client], message_type=MessageType.TRAIN,
                                    group_id=str(server_round)))
        log(INFO, "bfedjax: round %d: %d clients", server_round, len(messages))
        return messages

    def reply_problem(self, reply: Message, client: int) -> str | None:
        """Why ``reply`` from client ``client``'s node cannot be aggregated (``None``: it can)."""
        if reply.has_error():
            return f"error reply: {reply.error.reason}"
        if set(reply.content.keys()) != {P.MESSAGE, P.METRICS}:
            return f"expected the records {[P.MESSAGE, P.METRICS]}, got {sorted(reply.content.keys())}"
        metrics = reply.content[P.METRICS]
        if not isinstance(metrics, MetricRecord):
            return f"{P.METRICS} is a {type(metrics).__name__}, not a MetricRecord"
        wanted = set(self._metric_names) | set(P.REPLY_FIELDS)
        if set(metrics.keys()) != wanted:
            return f"metrics {sorted(metrics.keys())}, expected {sorted(wanted)}"
        if not all(P.is_int(metrics[k]) for k in P.REPLY_FIELDS):
            return f"{list(P.REPLY_FIELDS)} must be integers"
        if metrics[P.CLIENT_ID] != client:
            return f"client-id {metrics[P.CLIENT_ID]}, expected {client}"
        if metrics[P.NUM_EXAMPLES] != self.counts[client]:
            return f"num-examples {metrics[P.NUM_EXAMPLES]}, registered {int(self.counts[client])}"
        for name in self._metric_names:
            value = metrics[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                return f"metric {name!r} is {value!r}, not a finite number"
        problem = record_problem(reply.content[P.MESSAGE], self._message_like)
        return None if problem is None else f"message: {problem}"

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Checks the replies and aggregates the valid ones with the engine's ``finish_round``."""
        number, cohort, hparams, server_key, started = self._round
        if number != server_round:
            raise RuntimeError(f"aggregate_train for round {server_round} after configure_train for round {number}")
        ids, mask = np.asarray(cohort.ids), np.asarray(cohort.mask)
        slot_of = {self.node_of[int(c)]: s for s, c in enumerate(ids) if mask[s] > 0}
        accepted: dict[int, Message] = {}
        refused: set[int] = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            slot = slot_of.get(node)
            if slot is None or slot in accepted or slot in refused:
                log(WARNING, "bfedjax: round %d: ignored a reply from node %d (not asked, or a second reply)",
                    server_round, node)
                continue
            problem = self.reply_problem(reply, int(ids[slot]))
            if problem is not None:
                log(WARNING, "bfedjax: round %d: rejected node %d (client %d): %s", server_round, node,
                    int(ids[slot]), problem)
                refused.add(slot)
                continue
            accepted[slot] = reply
        silent = set(slot_of.values()) - set(accepted) - refused
        for slot in sorted(silent):
            log(WARNING, "bfedjax: round %d: rejected node %d (client %d): no reply", server_round,
                self.node_of[int(ids[slot])], int(ids[slot]))
        messages, client_metrics, finite = self._stacked(accepted, len(ids))
        with layout.random_bits_lowering():
            state, metrics = self._finish(EngineState(self.server, ()), self._arrays, cohort, messages,
                                          client_metrics, finite, (), hparams, server_key)
        self.server = state.server
        record = {"round": server_round, **{k: float(v) for k, v in metrics.items()},
                  "rejected_clients": float(len(refused) + len(silent)), "seconds": time.perf_counter() - started}
        if self.on_round is not None:
            self.on_round(record, self.server)
        return to_record(self.server), MetricRecord({k: v for k, v in record.items() if k != "round"})

    def _stacked(self, accepted: dict, slots: int):
        """Messages ``[Kp, ...]`` (zeros where no valid reply), client metrics ``{name: [Kp]}``, finite ``[Kp]``."""
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._message_like)
        rows = [from_record(accepted[s].content[P.MESSAGE], self._message_like) if s in accepted else zeros
                for s in range(slots)]
        messages = jax.tree.map(lambda *leaves: jnp.asarray(np.stack(leaves)), *rows)
        client_metrics = {name: jnp.asarray([float(accepted[s].content[P.METRICS][name]) if s in accepted else 0.0
                                             for s in range(slots)], jnp.float32) for name in self._metric_names}
        finite = jnp.asarray([s in accepted for s in range(slots)])
        return messages, client_metrics, finite

    # --- no federated evaluation: the evaluate hook scores the global model on the server ----------

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """None: the server's test set scores the global model inside ``aggregate_train``."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see ``configure_evaluate``)."""
        return None

    def summary(self) -> None:
        """Logs the algorithm and the round's shape."""
        log(INFO, "\t├──> bfedjax algorithm: %s, hparams %s", self.algorithm.name, self.algorithm.hparams)
        log(INFO, "\t└──> clients: N=%d, K=%d per round, E=%d, B=%d", self.config.num_clients,
            self.config.clients_per_round, self.algorithm.local_epochs, self.algorithm.batch_size)


class PromptGrid(Grid):
    """``grid`` whose ``send_and_receive`` checks for replies every ``interval`` seconds (Flower's waits 3)."""

    def __init__(self, grid: Grid, interval: float = 0.2):
        self.grid, self.interval = grid, float(interval)

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Pushes ``messages`` and returns the replies that arrive within ``timeout`` seconds (``None``: all)."""
        waiting = set(self.push_messages(messages))
        end = None if timeout is None else time.time() + timeout
        replies: list[Message] = []
        while waiting:
            arrived = list(self.pull_messages(waiting))
            replies.extend(arrived)
            waiting -= {reply.metadata.reply_to_message_id for reply in arrived}
            if not waiting or (end is not None and time.time() >= end):
                break
            time.sleep(self.interval)
        return replies


__all__ = ["AlgorithmStrategy", "PromptGrid"]
