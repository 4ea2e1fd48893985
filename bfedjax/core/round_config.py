"""What a round is given: its static configuration (``RoundConfig``; ``with_fixed_local_steps`` sets its
fixed-step promise where the data allow), the device arrays it reads (``RoundArrays``) and the state it
carries from round to round (``EngineState``, ``init_state``; each client's ``persistent_init`` key from
``persistent_init_key``)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.core.attacks import Attack
from bfedjax.core.types import Algorithm


STRAGGLER_WEIGHTINGS = ("unchanged", "by_epochs")
NONFINITE_POLICIES = ("drop", "stop")


class EngineState(NamedTuple):
    """server: the algorithm's server state; persistent: a tuple with one entry per architecture
    group, each the group's per-client state with leaves ``[N_group, ...]`` (or ``()``)."""

    server: Any
    persistent: Any


class RoundArrays(NamedTuple):
    """Device arrays a round reads (all clients, padded).

    x: ``[N, max_n, ...]``; y: ``[N, max_n, ...]``; counts: ``[N]`` int32;
    base_weights: ``[N]`` client weights before renormalisation over the cohort
    (pi_n = m_n / m by default); client_mask: ``[N]`` float32, 1 for a client of
    the federation and 0 for an empty client added to fill a device mesh;
    x_test: ``[T, ...]``; y_test: ``[T, ...]``: the global test set.
    Optional per-client test splits (``None`` when the federation has none):
    x_test_clients ``[N, max_t, ...]``, y_test_clients ``[N, max_t, ...]``, test_counts ``[N]`` int32.
    malicious: ``[N]`` float32, 1 for a client that attacks (``RoundConfig.attack``), or ``None``.
    """

    x: jax.Array
    y: jax.Array
    counts: jax.Array
    base_weights: jax.Array
    client_mask: jax.Array
    x_test: jax.Array
    y_test: jax.Array
    x_test_clients: jax.Array | None = None
    y_test_clients: jax.Array | None = None
    test_counts: jax.Array | None = None
    malicious: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """Static shape of a round (changing any field recompiles).

    Attributes:
      num_clients: N, clients in the federation.
      clients_per_round: K, cohort size (K = N: everybody, in order, every round).
      clients_per_chunk: clients trained at once; ``None`` trains the whole cohort in one vmap,
        1 runs them one after another without a vmap.
      evaluate_local: also score every local model with the evaluate hook (LA).
      evaluate_every: run the evaluate hook (GA, and LA with ``evaluate_local``) only in the rounds
        ``r`` with ``r % evaluate_every == 0``; the other rounds report NaN for those metrics and skip
        their cost (FedReg spec decision 17's option; 1: every round).
      pad_cohort_to: round the cohort up to a multiple of this (the device count when the
        client axis is sharded); the extra slots are padding.
      client_groups: ``N`` ints, each client's architecture group (``None``: every client in group 0).
      straggler_fraction: the fraction of clients that train fewer epochs each round (0: none).
      straggler_weighting: ``"unchanged"`` (a straggler keeps its weight, HBFL spec Decision 14) or
        ``"by_epochs"`` (its weight is scaled by ``x / E``, i.e. ``q_k`` proportional to ``n_k x / E``).
      round_fractions: fractions in (0, 1]; each round every client trains on the first
        ``round(f * n_k)`` rows of its data, ``f`` drawn uniformly from them (``None``: all rows).
      attack: what the malicious clients (``RoundArrays.malicious``) send (``attacks.Attack``;
        ``None``: nobody attacks).
      on_nonfinite: a client whose message or new persistent state holds NaN or Inf is always left
        out of the round (mask and weight 0, the others renormalised; ``nonfinite_clients`` counts
        them); ``"stop"`` also reports ``first_nonfinite_client`` so ``simulate`` can stop the run.
      client_devices: train the cohort's chunks on this many local devices at once (``D``; "Parallel devices" in
        ``core.engine``'s docstring); needs ``clients_per_chunk``, and the cohort is padded to a
        multiple of ``D * clients_per_chunk``. 1: one device.
      fixed_local_steps: a promise that every real client holds exactly ``max_n`` samples (the
        arrays' padded length) and trains every batch: each epoch then runs ``ceil(max_n / B)``
        steps under ``lax.scan`` instead of a ``lax.while_loop`` that tests every step (on a GPU a
        host round trip, and under ``vmap`` a select over the local state, per step). Empty
        padding slots still train nothing. ``with_fixed_local_steps`` sets it when the data allow.
        A CPU keeps the loop when a step runs per iteration (``layout.fixed_steps_scan``).
      unroll_local_steps: with ``fixed_local_steps``, the epoch scan's ``unroll`` (``lax.scan``): how many
        local steps one loop iteration runs. ``None``: ``layout.auto_unroll_local_steps`` decides when the
        round is traced (a whole short epoch of small steps on an accelerator, else 1).
    """

    num_clients: int
    clients_per_round: int
    clients_per_chunk: int | None = None
    evaluate_local: bool = True
    evaluate_every: int = 1
    pad_cohort_to: int = 1
    client_groups: tuple[int, ...] | None = None
    straggler_fraction: float = 0.0
    straggler_weighting: str = "unchanged"
    round_fractions: tuple[float, ...] | None = None
    attack: Attack | None = None
    on_nonfinite: str = "drop"
    fixed_local_steps: bool = False
    client_devices: int = 1
    unroll_local_steps: int | None = None

    def __post_init__(self):
        if not 1 <= self.clients_per_round <= self.num_clients:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} must be in [1, num_clients={self.num_clients}]")
        if int(self.evaluate_every) < 1:
            raise ValueError(f"evaluate_every={self.evaluate_every} must be >= 1 (1: evaluate every round)")
        if self.clients_per_chunk is not None and self.clients_per_chunk < 1:
            raise ValueError(f"clients_per_chunk={self.clients_per_chunk} must be >= 1 (or None for no chunking)")
        if int(self.client_devices) < 1:
            raise ValueError(f"client_devices={self.client_devices} must be >= 1 (1: one device)")
        if self.client_devices > 1 and (self.clients_per_chunk is None or self.pad_cohort_to > 1):
            raise ValueError(f"client_devices={self.client_devices} splits the cohort's chunks over devices; fix: set "
                             "clients_per_chunk, and do not also shard the client axis over a mesh")
        if self.client_groups is not None:
            groups = tuple(int(g) for g in self.client_groups)
            if len(groups) != self.num_clients or min(groups) < 0:
                raise ValueError(f"client_groups must give each of the {self.num_clients} clients a group >= 0, "
                                 f"got {len(groups)} entries")
            object.__setattr__(self, "client_groups", groups)
        if not 0.0 <= self.straggler_fraction <= 1.0:
            raise ValueError(f"straggler_fraction={self.straggler_fraction} must be in [0, 1], e.g. 0.5")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; choose one of {NONFINITE_POLICIES}")
        if self.straggler_weighting not in STRAGGLER_WEIGHTINGS:
            raise ValueError(f"straggler_weighting={self.straggler_weighting!r}; choose one of {STRAGGLER_WEIGHTINGS}")
        if self.round_fractions is not None:
            fractions = tuple(float(f) for f in self.round_fractions)
            if not fractions or not all(0.0 < f <= 1.0 for f in fractions):
                raise ValueError(f"round_fractions={self.round_fractions} must be fractions in (0, 1], "
                                 "e.g. (0.5, 0.6, 0.7, 0.8, 0.9)")
            object.__setattr__(self, "round_fractions", fractions)
        if self.unroll_local_steps is not None and (isinstance(self.unroll_local_steps, bool) or not (
                isinstance(self.unroll_local_steps, numbers.Integral) and self.unroll_local_steps >= 1)):
            raise ValueError(f"unroll_local_steps={self.unroll_local_steps!r}; fix: a number of steps >= 1, or None "
                             "(automatic)")
        if self.fixed_local_steps and (self.straggler_fraction > 0 or self.round_fractions is not None):
            raise ValueError("fixed_local_steps trains every client on all its batches; fix: drop it with "
                             "straggler_fraction or round_fractions (with_fixed_local_steps decides)")

    @property
    def padded_cohort(self) -> int:
        """Cohort size rounded up to a whole number of chunks (extra slots are padding)."""
        return self._rounded_up(self.clients_per_round)

    def _rounded_up(self, slots: int) -> int:
        multiple = math.lcm((self.clients_per_chunk or 1) * self.client_devices, self.pad_cohort_to)
        return math.ceil(slots / multiple) * multiple

    @property
    def group_of(self) -> np.ndarray:
        """``[N]`` int32 group of every client."""
        if self.client_groups is None:
            return np.zeros(self.num_clients, np.int32)
        return np.asarray(self.client_groups, np.int32)

    @property
    def num_groups(self) -> int:
        return int(self.group_of.max()) + 1

    def members(self, group: int) -> np.ndarray:
        """Client ids of ``group`` in increasing order, ``[N_group]``."""
        return np.flatnonzero(self.group_of == group).astype(np.int32)

    @property
    def index_in_group(self) -> np.ndarray:
        """``[N]`` row of each client in its group's persistent state."""
        index = np.zeros(self.num_clients, np.int32)
        for g in range(self.num_groups):
            index[self.members(g)] = np.arange(len(self.members(g)))
        return index

    def group_slots(self, group: int) -> int:
        """Cohort slots of ``group``: ``min(K, N_group)`` rounded up like the cohort (one group: ``Kp``)."""
        return self._rounded_up(min(self.clients_per_round, len(self.members(group))))


PERSISTENT_INIT_STREAM = 0x9E45  # client n's persistent_init key: fold_in(fold_in(key, this), n)


def persistent_init_key(key: jax.Array | None, client_id) -> jax.Array:
    """Client ``client_id``'s ``persistent_init`` key from the run's init ``key`` (``None``: ``PRNGKey(0)``)."""
    base = jax.random.fold_in(jax.random.PRNGKey(0) if key is None else key, PERSISTENT_INIT_STREAM)
    return jax.random.fold_in(base, client_id)


def init_state(algorithm: Algorithm, params, config: RoundConfig, key: jax.Array | None = None) -> EngineState:
    """Server state from initial ``params`` and each group's persistent state ``[N_group, ...]``.

    Client ``n`` of group ``g`` starts from ``persistent_init(params, key_n, g)``.
    """
    server = algorithm.server_init(params)
    if config.num_groups > algorithm.num_groups:
        raise ValueError(f"{algorithm.name} has {algorithm.num_groups} architecture group(s) but client_groups uses "
                         f"{config.num_groups}; fix: give it one local model per group or remap the clients")
    if algorithm.persistent_init is None:
        return EngineState(server, tuple(() for _ in range(config.num_groups)))
    persistent = []
    for g in range(config.num_groups):
        keys = jax.vmap(lambda n: persistent_init_key(key, n))(jnp.asarray(config.members(g)))
        persistent.append(jax.vmap(lambda k: algorithm.persistent_init(params, k, g))(keys))
    return EngineState(server, tuple(persistent))


def with_fixed_local_steps(config: RoundConfig, arrays: RoundArrays) -> RoundConfig:
    """``config`` with ``fixed_local_steps`` set when it holds: every real client of ``arrays`` has exactly
    ``max_n`` samples (concrete counts), no stragglers, no ``round_fractions``."""
    counts, mask = np.asarray(arrays.counts), np.asarray(arrays.client_mask) > 0
    full = bool(mask.any()) and bool(np.all(counts[mask] == arrays.y.shape[1])) and not np.any(counts[~mask])
    fixed = full and config.straggler_fraction == 0 and config.round_fractions is None
    return dataclasses.replace(config, fixed_local_steps=fixed)


__all__ = ["NONFINITE_POLICIES", "STRAGGLER_WEIGHTINGS", "EngineState", "init_state", "persistent_init_key",
           "RoundArrays", "RoundConfig", "with_fixed_local_steps"]
