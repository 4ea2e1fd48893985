"""The contract between the round engine and an algorithm.

An algorithm is a bundle of pure functions over pytrees (``Algorithm``), typed
with the Protocols below as optax types its transformations: a user's
function with the same call signature is one. The engine owns vmap, scan,
masking, cohort sampling, chunking, sharding and evaluation; an algorithm owns
only its maths.

Shapes: inside ``client_*`` everything is one client's (the engine vmaps);
``server_update`` sees the cohort's messages stacked as ``[C, ...]`` with
``weights [C]`` and ``mask [C]``. ``mask`` is 1 for a real client and 0 for a
padding slot (chunked, sharded or sampled cohorts are padded); ``weights`` is
how much each real client counts (sums to 1 over the cohort's real clients,
and is 0 on padding). They are different things: a real client may weigh
zero, and it still trains and keeps its persistent state; a padding slot
never counts. Never infer one from the other.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

PyTree = Any
HParams = dict  # traced per-round scalars: {"round": int32, "lr": float32, ...}
Metrics = dict  # name -> scalar array
# The aggregation's (server_update / server_from_stats) hparams also hold this float32 scalar: the cohort's
# share of the federation's base weight, sum_{n in A} pi_n / sum_n pi_n (1 when every client takes part at its base weight, none dropped), so
# ``hparams[COHORT_WEIGHT] * weights`` are the un-renormalised pi_n (FOLA's ``fixed_pi``).
COHORT_WEIGHT = "cohort_weight"
ENGINE_HPARAMS = ("round", COHORT_WEIGHT)


def engine_hparam(hparams, name: str, user: str, what: str, alternative: str = ""):
    """``hparams[name]``, one of ``ENGINE_HPARAMS``, which the engine adds to every aggregation; a one-line error
    naming the fix when an aggregation is called without it (``user`` needs it for ``what``)."""
    if name not in (hparams or {}):
        raise ValueError(f"{user} needs hparams[{name!r}] ({what}); fix: aggregate through the engine "
                         f"(finish_round / make_round_step), which adds it{alternative}")
    return hparams[name]


def require_message_keys(messages, keys, user: str, what: str, sender: str, fix: str) -> None:
    """A one-line error naming ``fix`` unless the cohort's ``messages`` are a dict holding every key in ``keys``
    (for layers that read the messages: ``user`` needs ``what``, which the algorithm ``sender`` does not send)."""
    if isinstance(messages, dict) and set(keys) <= set(messages):
        return
    got = sorted(messages) if isinstance(messages, dict) else type(messages).__name__
    raise ValueError(f"{user} needs {what}; {sender} sends {got}; fix: {fix}")


class ClientData(NamedTuple):
    """One client's padded data (inside the round every leaf gains ``[C]``).

    x: ``[max_n, ...]`` inputs; rows ``>= count`` are padding.
    y: ``[max_n, ...]`` targets (int32 labels for classification).
    count: ``[]`` int32 number of real samples.
    """

    x: jax.Array
    y: jax.Array
    count: jax.Array


class Batch(NamedTuple):
    """A masked mini-batch. x: ``[B, ...]``, y: ``[B, ...]``, mask: ``[B]`` float32 (1 real, 0 pad)."""

    x: jax.Array
    y: jax.Array
    mask: jax.Array


@dataclasses.dataclass(frozen=True)
class ClientContext:
    """Everything a client may read during a round (read-only).

    Attributes:
      server: the broadcast server state.
      persistent: this client's persistent state (``()`` when the algorithm has none).
      data: this client's ``ClientData``.
      hparams: traced per-round scalars (``round`` counts from 1, then the algorithm's own).
      group: the client's architecture group, a static Python int (0 unless the federation
        assigns groups; see ``RoundConfig.client_groups``): clients of one group share the
        shapes of their persistent state, e.g. a personalised local model of one architecture.
      test: this client's own test split as ``ClientData`` (``[max_t, ...]``, ``count`` real rows)
        when the federation has per-client test splits, else ``None`` (e.g. ABAVG's
        client-reported accuracy).
    """

    server: PyTree
    persistent: PyTree
    data: ClientData
    hparams: HParams
    group: int = 0
    test: ClientData | None = None


jax.tree_util.register_dataclass(ClientContext, data_fields=["server", "persistent", "data", "hparams", "test"],
                                 meta_fields=["group"])


# --- the functions an algorithm is made of -------------------------------------------------------


class ServerInitFn(Protocol):
    def __call__(self, params: PyTree) -> PyTree:
        """The server state of round 1 from the initial model ``params``."""


class ClientInitFn(Protocol):
    def __call__(self, ctx: ClientContext, key: jax.Array) -> PyTree:
        """A client's local state at the start of its round."""


class ClientStepFn(Protocol):
    def __call__(self, local: PyTree, batch: Batch, ctx: ClientContext, key: jax.Array) -> PyTree:
        """One local step on a masked batch; a step on a batch with no real sample is discarded
        (under vmap the loop runs until the group's largest client is done)."""


class ClientFinalFn(Protocol):
    def __call__(self, local: PyTree, ctx: ClientContext) -> tuple[PyTree, PyTree, Metrics]:
        """``(message, new_persistent, metrics)`` after local training.

        ``message``: what the client sends (a ``"params"`` entry, the local model, is
        scored as the round's local metrics when the engine evaluates locals);
        ``new_persistent``: the client's next persistent state (``()`` if none);
        ``metrics``: scalars the engine averages over the cohort's real clients.
        """


class ServerUpdateFn(Protocol):
    def __call__(self, server: PyTree, messages: PyTree, weights: jax.Array, mask: jax.Array, hparams: HParams,
                 key: jax.Array) -> tuple[PyTree, Metrics]:
        """``(new server state, server metrics)`` from messages ``[C, ...]``, weights ``[C]``, mask ``[C]``;
        ``hparams`` adds ``cohort_weight`` (``[]``, ``COHORT_WEIGHT``) to the round's."""


class ClientStatsFn(Protocol):
    def __call__(self, message: PyTree) -> PyTree:
        """One client's sufficient statistics; the engine forms ``sum_c weights[c] * stats_c``."""


class ServerFromStatsFn(Protocol):
    def __call__(self, server: PyTree, summed_stats: PyTree, mask: jax.Array, hparams: HParams,
                 key: jax.Array) -> tuple[PyTree, Metrics]:
        """``(new server state, server metrics)`` from the weighted sum of the cohort's statistics
        (``hparams`` as ``ServerUpdateFn``'s)."""


class GlobalParamsFn(Protocol):
    def __call__(self, server: PyTree) -> PyTree:
        """The global model's parameters (what the evaluate hook scores unless ``evaluated_model`` is given)."""


class EvaluatedModelFn(Protocol):
    def __call__(self, state: PyTree) -> PyTree:
        """What ``evaluate`` scores, from the server state (the global model) or from one client's message
        (its local model): for a Bayesian algorithm its posterior, so that GA and LA score a predictive."""


class PersistentInitFn(Protocol):
    def __call__(self, params: PyTree, key: jax.Array, group: int) -> PyTree:
        """One client's initial persistent state (the engine stacks a group's to ``[N_group, ...]``).

        ``params``: the initial global model; ``key``: this client's own init key;
        ``group``: its architecture group (a static int).
        """


class EvaluateFn(Protocol):
    def __call__(self, model: PyTree, x: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> Metrics:
        """Scalar metrics of a model (its parameters, or what ``evaluated_model`` gives) on a test set
        ``x [T, ...]``, ``y [T, ...]`` (e.g. accuracy, loss).

        ``mask [T]`` (1 real, 0 padding) is given for padded per-client test splits.
        """


class EvaluateClientFn(Protocol):
    def __call__(self, message: PyTree, persistent: PyTree, x: jax.Array, y: jax.Array, mask: jax.Array,
                 group: int) -> Metrics:
        """Scalar metrics of a client's own models on its own test split ``x [T, ...]``, ``y [T]``,
        ``mask [T]`` after its round (``persistent`` is its new persistent state; ``group`` static).
        The engine reports their mean over the cohort's real clients as ``client_test_<name>``."""


class PredictFn(Protocol):
    def __call__(self, server: PyTree, x: jax.Array, key: jax.Array, num_samples: int) -> jax.Array:
        """The final predictive of the global model: class probabilities ``[M, T, K]`` for ``x [T, ...]``."""


class InitParamsFn(Protocol):
    def __call__(self, key: jax.Array, input_shape: tuple[int, ...]) -> PyTree:
        """Initial model parameters for inputs of one example's shape."""


def _server_params(server):
    return server["params"]


@dataclasses.dataclass(frozen=True, eq=False)
class Algorithm:
    """A federated algorithm as pure functions (cf. optax's ``GradientTransformation``).

    Required: ``server_init``, ``client_init``, ``client_step``, ``client_final`` and
    either ``server_update`` or the pair ``client_stats`` / ``server_from_stats``.
    With the pair, the aggregation is a weighted sum of per-client statistics
    (``server_from_stats(sum_c w_c client_stats(m_c))``): the engine derives
    ``server_update`` from it and streams chunked cohorts into a running sum,
    so memory does not grow with the cohort.

    Optional hooks:
      global_params: ``server -> params``, the global model's parameters (default ``server["params"]``),
        which ``evaluate`` scores unless ``evaluated_model`` is given.
      evaluated_model: ``server state or one message -> what evaluate scores`` (the global model's
        and the local models'); default: ``global_params(server)`` and the message's ``"params"``.
        A Bayesian algorithm gives its posterior here, and an ``evaluate`` of the posterior's
        predictive; the two go together (replacing ``evaluate`` alone on such an algorithm hands it
        the posterior).
      persistent_init: ``(params, key, group) -> one client's persistent state`` (default: none).
      evaluate: ``(model, x_test, y_test, mask=None) -> metrics``; the engine reports the global
        model's (``scored_global``) as ``global_<name>`` and the local models' (``scored_local``,
        weighted) as ``local_<name>``. Default: no evaluation.
      evaluate_client: ``(message, persistent, x, y, mask, group) -> metrics`` on a client's own
        test split (when the federation has per-client test splits), reported as
        ``client_test_<name>``; default: ``evaluate`` of ``scored_local(message)``.
      predict: ``(server, x, key, num_samples) -> probs [M, T, K]``, the final predictive.
      init_params: ``(key, input_shape) -> params``, used when ``simulate`` gets no
        ``init_params``.
    Static fields: ``hparams`` (defaults of the traced per-round scalars; ``round`` is
    the engine's), ``local_epochs``, ``batch_size``, ``num_groups`` (architecture groups the
    client functions know; the federation maps each client to one of them).
    """

    name: str
    server_init: ServerInitFn
    client_init: ClientInitFn
    client_step: ClientStepFn
    client_final: ClientFinalFn
    server_update: ServerUpdateFn | None = None
    client_stats: ClientStatsFn | None = None
    server_from_stats: ServerFromStatsFn | None = None
    global_params: GlobalParamsFn = _server_params
    evaluated_model: EvaluatedModelFn | None = None
    persistent_init: PersistentInitFn | None = None
    evaluate: EvaluateFn | None = None
    evaluate_client: EvaluateClientFn | None = None
    predict: PredictFn | None = None
    init_params: InitParamsFn | None = None
    hparams: dict = dataclasses.field(default_factory=dict)
    local_epochs: int = 1
    batch_size: int = 32
    num_groups: int = 1

    def __post_init__(self):
        for field in ("server_init", "client_init", "client_step", "client_final"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Algorithm {self.name!r}: {field} must be a function, got {getattr(self, field)!r}")
        pair = (self.client_stats is not None, self.server_from_stats is not None)
        if pair[0] != pair[1]:
            raise TypeError(f"Algorithm {self.name!r}: client_stats and server_from_stats go together; give both")
        if (self.server_update is None) == (not pair[0]):
            raise TypeError(f"Algorithm {self.name!r}: give server_update or the pair client_stats / "
                            "server_from_stats (exactly one of the two)")
        if self.global_params is None:
            object.__setattr__(self, "global_params", _server_params)
        for name in ENGINE_HPARAMS:
            if name in self.hparams:
                raise ValueError(f"Algorithm {self.name!r}: {name!r} is the engine's hyper-parameter; fix: rename yours")
        for field in ("local_epochs", "batch_size", "num_groups"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"Algorithm {self.name!r}: {field}={getattr(self, field)} must be >= 1")

    @property
    def streams(self) -> bool:
        """Whether the aggregation is a weighted sum of ``client_stats`` (chunks can stream)."""
        return self.client_stats is not None

    def scored_global(self, server):
        """What ``evaluate`` scores as the global model: ``evaluated_model(server)``, else ``global_params(server)``."""
        return self.global_params(server) if self.evaluated_model is None else self.evaluated_model(server)

    def can_score_local(self, message) -> bool:
        """Whether one client's ``message`` holds a local model ``evaluate`` can score."""
        return self.evaluate is not None and (self.evaluated_model is not None
                                              or (isinstance(message, dict) and "params" in message))

    def scored_local(self, message):
        """What ``evaluate`` scores as a client's local model: ``evaluated_model(message)``, else its ``"params"``."""
        return message["params"] if self.evaluated_model is None else self.evaluated_model(message)

    def aggregate(self, server, messages, weights, mask, hparams, key):
        """``(server, server_metrics)``: ``server_update``, or the one derived from the statistics pair.

        The derived sum ``sum_c weights[c] * client_stats(messages[c])`` keeps each statistic's
        dtype. On a CPU it runs as a ``lax.scan`` over clients, each client's statistics (e.g.
        precision * mean) fused into the accumulation and never materialised as ``[C, ...]``
        arrays; on an accelerator as one reduction over the client axis, into which XLA fuses
        elementwise statistics (a
        scan there costs a launch per client: 0.7 ms of a 4.7 ms FedAvg round of 100 MLP clients on an
        H100).
        """
        if self.server_update is not None:
            return self.server_update(server, messages, weights, mask, hparams, key)
        if jax.default_backend() == "cpu":
            first = jax.tree.map(lambda m: m[0], messages)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(self.client_stats, first))

            def add(total, message_and_weight):
                message, weight = message_and_weight
                return jax.tree.map(lambda t, s: t + weight * s, total, self.client_stats(message)), None

            total, _ = jax.lax.scan(add, zeros, (messages, weights))
        else:
            def weighted_sum(s):
                return jnp.sum(weights.reshape((-1,) + (1,) * (s.ndim - 1)) * s, axis=0).astype(s.dtype)

            total = jax.tree.map(weighted_sum, jax.vmap(self.client_stats)(messages))
        return self.server_from_stats(server, total, mask, hparams, key)

    def replace(self, **changes) -> "Algorithm":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


__all__ = ["COHORT_WEIGHT", "ENGINE_HPARAMS", "Algorithm", "Batch", "ClientContext", "ClientData", "ClientFinalFn",
           "ClientInitFn", "ClientStatsFn", "ClientStepFn", "EvaluateClientFn", "EvaluateFn", "EvaluatedModelFn", "GlobalParamsFn", "HParams",
           "InitParamsFn", "Metrics", "PersistentInitFn", "PredictFn", "PyTree", "ServerFromStatsFn", "ServerInitFn",
           "ServerUpdateFn", "engine_hparam", "require_message_keys"]
