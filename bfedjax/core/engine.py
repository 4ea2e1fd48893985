"""The round engine: one federated round as one jitted function.

``make_round_step(algorithm, config)`` returns

    round_step(state, arrays, key, hparams) -> (state, metrics)

which samples a cohort, runs every cohort client's local training under
``jax.vmap`` (local steps under ``lax.scan``; cohorts split into chunks of
``clients_per_chunk`` clients run one chunk after another under ``lax.map``),
aggregates, and calls the algorithm's evaluate hook, all inside one
``jax.jit``. ``hparams`` (round index, learning rate, ...) are traced, so
changing them never recompiles. The engine knows no method and no task.

The cohort is ``ids [Kp]`` (client indices; ``N`` marks a padding slot),
``mask [Kp]`` (1 for a real client), ``weights [Kp]`` (the real clients'
share of the aggregate, renormalised to sum to 1) and ``total []`` (the
cohort's share of the federation's base weight, sum_{n in A} pi_n; 1 when
every client takes part at its base weight and none is dropped), which the aggregation reads as
``hparams["cohort_weight"]`` (FOLA's ``fixed_pi``). A padding slot never
trains on data, never counts in an aggregate or a metric, and never writes persistent state. Sampling draws
among the federation's real clients whatever their weights; a round whose
real clients all weigh zero keeps the server state (their persistent state
still moves).

Parallel devices: ``RoundConfig.client_devices = D > 1`` runs the round under ``shard_map`` on
the first ``D`` local devices (``client_device_mesh``), the data and the server state replicated
on each: every device samples the same cohort, trains every ``D``-th of the cohort's size-sorted
chunks, and the per-device results meet in one all-reduce (the streamed sums, each client's new
persistent rows) or all-gather (the messages of a non-streaming aggregation); the aggregation
then runs on every device alike. On a CPU each device is a core (``core.layout.use_cpu_cores``),
so clients train on every core, where XLA:CPU runs one client's small kernels mostly on one.

Architecture groups: ``RoundConfig.client_groups`` maps every client to a
group (an architecture: HBFL's local models, a personalised head). A group's
persistent state is its own pytree ``[N_group, ...]``; the cohort's clients of
one group are gathered into that group's slots and trained under one vmap, and
every group of the round runs inside the same jitted step. Messages must have
one structure across groups (the shared part); they are merged back into the
cohort's ``[Kp]`` order for the aggregation. With one group (the default) this
is the plain round.

Stragglers: ``RoundConfig.straggler_fraction`` makes that fraction of the
federation's clients, drawn afresh each round from the round key (so every
algorithm sees the same draw at a given seed), train ``x ~ U{1..E}`` epochs
instead of E; the engine runs each client under a step budget
(``Cohort.budgets``).

Nested round subsets (FedRef's MNIST/DRIVE protocol): with
``RoundConfig.round_fractions`` every client draws a fraction ``f`` from that
tuple each round (from the round key, so every algorithm sees the same draw at
a given seed) and trains on the first ``round(f * n_k)`` rows of its data; its
weight is scaled by ``f``, so by-size weights become the subset sizes. With the
``nested`` partition (every client holds the same seeded permutation of the
training set) the subsets are nested, overlapping prefixes redrawn every round.

Backends: ``vmap`` (the library), ``sequential`` (one jitted call per client,
the reference the tests compare with), ``stepwise`` (a Python loop over
clients and batches with one jitted step per batch, FedJAX's design and the
baseline of ``experiments/bench.py``) and ``debug`` (the stepwise loop with jit
off: an exception or a non-finite output is reported with the client and the
stage, init / step / final / server / evaluate, where it happened).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from bfedjax.core import layout
from bfedjax.core.attacks import Attack, attacked_messages
from bfedjax.core.batching import batch_is_real, epoch_permutation, steps_per_epoch, take_batch
from bfedjax.core.types import COHORT_WEIGHT, Algorithm, ClientContext, ClientData
from bfedjax.tree import tree_stack, weighted_sum, zero_products_per_row

BACKENDS = ("vmap", "sequential", "stepwise", "debug")
SERVER_KEY_STREAM = 0x5E5E  # the server's key is fold_in(round key, this): sampling and client keys stay as they were
STRAGGLER_KEY_STREAM = 0x57A6  # the straggler draw's key: fold_in(round key, this)
SUBSET_KEY_STREAM = 0x5B5E  # the round-subset draw's key: fold_in(round key, this)
STRAGGLER_WEIGHTINGS = ("unchanged", "by_epochs")
NONFINITE_POLICIES = ("drop", "stop")
PARALLEL_AXIS = "client_devices"  # the mesh axis of RoundConfig.client_devices
NO_BUDGET = jnp.iinfo(jnp.int32).max  # a step budget that never binds


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
      client_devices: train the cohort's chunks on this many local devices at once (``D``; the module
        docstring's "Parallel devices"); needs ``clients_per_chunk``, and the cohort is padded to a
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


def local_training(algorithm: Algorithm, ctx: ClientContext, key: jax.Array, step_budget=NO_BUDGET,
                   fixed_steps: bool = False, unroll: int | None = None):
    """Runs one client's local epochs; returns ``client_final``'s ``(message, persistent, metrics)``.

    Epochs run under ``lax.scan``; within an epoch a ``lax.while_loop`` takes
    the client's ``ceil(count / B)`` batches, and stops early once the client
    has taken ``step_budget`` steps in the round (a straggler). Under ``vmap`` the loop runs
    until the largest client of the vmapped group is done and leaves finished
    clients' states unchanged, so a group of similar-sized clients (the engine
    sorts the cohort by size before chunking) does little padded work.

    ``fixed_steps=True`` (``RoundConfig.fixed_local_steps``: the client holds ``max_n`` samples or
    none, and ``step_budget`` never binds) takes all ``ceil(max_n / B)`` batch slots under a
    ``lax.scan`` instead, with no per-step test; an empty client (a padding slot) skips its
    epochs under a ``lax.cond`` and keeps its initial local state, as in the loop. Same steps,
    same keys, same result. ``unroll`` is that scan's ``unroll`` (``RoundConfig.unroll_local_steps``;
    ``None``: ``layout.auto_unroll_local_steps`` for this platform, epoch and step). A CPU keeps the
    loop unless the steps are unrolled (``layout.fixed_steps_scan``).
    """
    init_key, perm_key, step_key = jax.random.split(key, 3)  # same derivation in _looped_client
    local = algorithm.client_init(ctx, init_key)
    max_n = ctx.data.y.shape[0]
    batch_size = algorithm.batch_size
    platform = jax.default_backend()
    scan_steps = fixed_steps and layout.fixed_steps_scan(platform=platform, unroll=unroll)

    def epoch(carry, e):
        taken, local = carry
        order = epoch_permutation(perm_key, ctx.data.count, max_n, e)
        epoch_key = jax.random.fold_in(step_key, e)

        def step(j, local):
            batch = take_batch(ctx.data, order, j, batch_size)
            return algorithm.client_step(local, batch, ctx, jax.random.fold_in(epoch_key, j))

        if scan_steps:
            local = scanned_steps(step, local, steps_per_epoch(max_n, batch_size), platform, unroll)
            return (taken, local), None

        def more(carry):
            j, taken, _ = carry
            return batch_is_real(ctx.data, j, batch_size) & (taken < step_budget)

        # both this and train's per_client are needed: per-client zeros for the counters and the epoch carry's
        # per_client alone left tracing at 3.9 s instead of 2.4 s (ResNet-20 BFL round, 2-core CPU)
        carry = per_client((jnp.int32(0), taken, local), ctx.data.count >= 0)
        _, taken, local = jax.lax.while_loop(lambda c: more(c), lambda c: (c[0] + 1, c[1] + 1, step(c[0], c[2])), carry)
        return (taken, local), None

    def train(local):
        carry = (jnp.int32(0), local)
        if not scan_steps:  # the step loop's carry ends up per-client: so does the epochs' (per_client)
            carry = per_client(carry, ctx.data.count >= 0)
        (_, trained), _ = jax.lax.scan(epoch, carry, jnp.arange(algorithm.local_epochs))
        return trained

    # the scan's fixed steps: an empty padding slot trains nothing (skipped outside a vmap, a select under one)
    trained = jax.lax.cond(ctx.data.count > 0, train, lambda local: local, local) if scan_steps else train(local)
    return algorithm.client_final(trained, ctx)


def scanned_steps(step, local, steps: int, platform: str, unroll: int | None):
    """``local`` after ``local = step(j, local)`` for ``j = 0 .. steps - 1`` (``int32 []``) under a ``lax.scan``:
    the fixed-step epoch of ``local_training``, ``unroll`` steps per iteration (``None``:
    ``layout.auto_unroll_local_steps`` for ``platform``).

    Where that decision needs the step's size, the step is traced once, to a jaxpr whose equations it
    counts, and the scan replays that jaxpr instead of tracing the Python step a second time (the
    variational ResNet-20 round, whose steps the decision keeps rolled: first trace 4.93 -> 4.32 s on the
    2-core CPU, medians of three processes, ``results/bench/session15_cpu_trace``). The scan's carry has
    ``local``'s structure, the one the jaxpr was traced with.
    """
    traced = []

    def step_operations():
        if not traced:
            traced.append(jax.make_jaxpr(step, return_shape=True)(jnp.int32(0), local))
        return layout.jaxpr_operations(traced[0][0])

    per_iteration = unroll or layout.auto_unroll_local_steps(platform=platform, steps_per_epoch=steps,
                                                             step_operations=step_operations)
    if traced:
        jaxpr, shape = traced[0]
        replay, structure = jax.extend.core.jaxpr_as_fun(jaxpr), jax.tree.structure(shape)

        def replayed(j, local):
            return jax.tree.unflatten(structure, replay(j, *jax.tree.leaves(local)))

        step = replayed

    local, _ = jax.lax.scan(lambda local, j: (step(j, local), None), local, jnp.arange(steps, dtype=jnp.int32),
                            unroll=per_iteration)
    return local


def per_client(tree, true):
    """``tree`` unchanged, each leaf through ``where(true, leaf, leaf)``, ``true`` a ``[]`` per-client True.

    Under the client vmap the result is batched (per client) in every leaf. A ``while_loop`` whose test is
    per-client (``local_training``'s step loop) ends up with a per-client carry anyway, and so does a scan
    around it; JAX's batching rules get there by re-batching the loop body once for each carry leaf that
    turns per-client (constants such as a step counter), which for a large step (a variational ResNet-20)
    costs seconds of tracing. Started per-client, the body is batched once. The selects cost one pass over
    the carry before the loop (not measurable in a CPU round; ``results/bench/gpu_h100_session14``). The
    fixed-step scan of accelerators settles in one pass and keeps its carry as it is."""
    return jax.tree.map(lambda leaf: jnp.where(true, leaf, leaf), tree)


def with_fixed_local_steps(config: RoundConfig, arrays: RoundArrays) -> RoundConfig:
    """``config`` with ``fixed_local_steps`` set when it holds: every real client of ``arrays`` has exactly
    ``max_n`` samples (concrete counts), no stragglers, no ``round_fractions``."""
    counts, mask = np.asarray(arrays.counts), np.asarray(arrays.client_mask) > 0
    full = bool(mask.any()) and bool(np.all(counts[mask] == arrays.y.shape[1])) and not np.any(counts[~mask])
    fixed = full and config.straggler_fraction == 0 and config.round_fractions is None
    return dataclasses.replace(config, fixed_local_steps=fixed)


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


def _group_rows(config: RoundConfig, client_ids, group: int):
    """Rows of ``client_ids`` in ``group``'s persistent state (0 for padding ids and other groups' clients)."""
    n = config.num_clients
    safe = jnp.minimum(client_ids, n - 1)
    own = (client_ids < n) & (jnp.asarray(config.group_of)[safe] == group)
    return jnp.where(own, jnp.asarray(config.index_in_group)[safe], 0)


def client_inputs(state: EngineState, arrays: RoundArrays, config: RoundConfig, client_id, group: int):
    """Data and persistent state of one client of ``group`` (padding id N gives an empty client)."""
    n = arrays.counts.shape[0]
    safe = jnp.minimum(client_id, n - 1)
    count = jnp.where(client_id < n, arrays.counts[safe], 0)
    data = ClientData(arrays.x[safe], arrays.y[safe], count)
    row = _group_rows(config, client_id, group)
    persistent = jax.tree.map(lambda p: p[row], state.persistent[group])
    return data, persistent


def client_test_data(arrays: RoundArrays, client_id) -> ClientData | None:
    """The client's own test split (padding id N: an empty one), or ``None`` without per-client splits."""
    if arrays.test_counts is None:
        return None
    n = arrays.test_counts.shape[0]
    safe = jnp.minimum(client_id, n - 1)
    count = jnp.where(client_id < n, arrays.test_counts[safe], 0)
    return ClientData(arrays.x_test_clients[safe], arrays.y_test_clients[safe], count)


def _with_client_test_metrics(algorithm: Algorithm, arrays: RoundArrays, client_id, outputs, group: int):
    """Adds ``client_test_<name>``: the client's own models scored on its own test split (if the federation has one)."""
    message, persistent, metrics = outputs
    test = client_test_data(arrays, client_id)
    if test is None:
        return outputs
    x, y = test.x, test.y
    mask = (jnp.arange(y.shape[0]) < test.count).astype(jnp.float32)
    if algorithm.evaluate_client is not None:
        scores = algorithm.evaluate_client(message, persistent, x, y, mask, group)
    elif algorithm.evaluate is not None and isinstance(message, dict) and "params" in message:
        scores = algorithm.evaluate(message["params"], x, y, mask)
    else:
        return outputs
    scores = {f"client_test_{name}": value for name, value in scores.items()}
    clash = sorted(set(scores) & set(metrics))
    if clash:
        raise ValueError(f"{algorithm.name}: client metrics {clash} clash with the per-client test metrics; fix: rename")
    return message, persistent, {**metrics, **scores}


def _run_one_client(algorithm, config, state, arrays, hparams, client_id, key, budget, group):
    data, persistent = client_inputs(state, arrays, config, client_id, group)
    ctx = ClientContext(state.server, persistent, data, hparams, group, client_test_data(arrays, client_id))
    outputs = local_training(algorithm, ctx, key, budget, config.fixed_local_steps, config.unroll_local_steps)
    return _with_client_test_metrics(algorithm, arrays, client_id, outputs, group)


def _scatter(persistent, rows, mask, new):
    """Writes the real clients' new persistent rows (padding slots are dropped)."""
    if not jax.tree.leaves(persistent):  # no persistent state (the client returns an empty pytree)
        return persistent
    n = jax.tree.leaves(persistent)[0].shape[0]
    rows = jnp.where(mask > 0, rows, n)
    return jax.tree.map(lambda all_, new_: all_.at[rows].set(new_, mode="drop"), persistent, new)


def _group_cohorts(config: RoundConfig, cohort: Cohort):
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


def _merge_groups(parts, kp: int):
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


def _client_metric_sums(metrics, mask):
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


def _local_metric_sums(algorithm, config, arrays, messages, weights, mask, hparams):
    """``{local_<name>: sum_c w_c * metric(local model c)}`` through the evaluate hook (the LA of the paper)."""
    if not (config.evaluate_local and algorithm.evaluate is not None and "params" in messages):
        return {}

    def sums():
        scores = jax.lax.map(lambda p: algorithm.evaluate(p, arrays.x_test, arrays.y_test), messages["params"])
        return {f"local_{name}": jnp.sum(jnp.where(mask > 0, weights * value, 0.0)) for name, value in scores.items()}

    return _on_evaluation_rounds(config, hparams, sums)


def _global_metrics(algorithm, config, arrays, server, hparams):
    if algorithm.evaluate is None:
        return {}

    def scores():
        return {f"global_{name}": value for name, value in
                algorithm.evaluate(algorithm.global_params(server), arrays.x_test, arrays.y_test).items()}

    return _on_evaluation_rounds(config, hparams, scores)


RESERVED_METRICS = ("round", "seconds", "best_global_accuracy")


def _round_metrics(algorithm, config, arrays, server, server_metrics, client_sums, mask, local_sums, hparams):
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


def _kept_if_nobody_counts(new_server, old_server, weights, mask):
    """A cohort whose real clients all weigh zero leaves the server state as it was."""
    counts = jnp.sum(jnp.where(mask > 0, weights, 0.0)) > 0
    return jax.tree.map(lambda new, old: jnp.where(counts, new, old), new_server, old_server)


def finite_rows(tree, slots: int) -> jax.Array:
    """``[C]`` bool: every floating leaf of ``tree`` (leaves ``[C, ...]``) is finite in row ``c``."""
    # x * 0 is 0 where x is finite and NaN where it is not (inf * 0 too), so a row's sum is 0 exactly when the
    # row is finite and cannot overflow; tree.zero_products_per_row reads x once (a matrix-vector product on a
    # CPU, where all(isfinite(x)) is a slow tree reduction of flags: results/bench/reductions.md)
    rows = [zero_products_per_row(x, slots) == 0 for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not rows:
        return jnp.ones((slots,), bool)
    # One count over the stacked [C, L] flags. Chained per-leaf ``&`` (or ``all`` over the stack, which XLA
    # turns back into the chain) was copied into every per-leaf select that reads the result: with a BFL
    # ResNet-20's 214 message leaves a quarter of the compiled round's HLO (``experiments.bench_round``).
    return jnp.sum(jnp.stack(rows, axis=1).astype(jnp.float32), axis=1) == len(rows)


def _zero_rows(tree, keep):
    """``tree`` (leaves ``[C, ...]``) with the rows where ``keep [C]`` is False set to 0."""
    return jax.tree.map(lambda m: jnp.where(jnp.reshape(keep, (-1,) + (1,) * (m.ndim - 1)), m, jnp.zeros_like(m)),
                        tree)


def _attacked(algorithm, config, state, arrays, ids, keys, messages):
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
    return cohort, _zero_rows(messages, finite), _fault_metrics(config, cohort.ids, bad)


def _aggregation_hparams(hparams, total):
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
        messages = _attacked(algorithm, config, state, arrays, cohort.ids, cohort.keys, messages)
        finite = finite & finite_rows(messages, cohort.ids.shape[0])
    cohort, messages, fault_metrics = _without_nonfinite(config, cohort, messages, finite)
    server, server_metrics = algorithm.aggregate(state.server, messages, cohort.weights, cohort.mask,
                                                 _aggregation_hparams(hparams, cohort.total), server_key)
    server = _kept_if_nobody_counts(server, state.server, cohort.weights, cohort.mask)
    local_sums = _local_metric_sums(algorithm, config, arrays, messages, cohort.weights, cohort.mask, hparams)
    metrics = _round_metrics(algorithm, config, arrays, server, {**server_metrics, **fault_metrics},
                             _client_metric_sums(client_metrics, cohort.mask), cohort.mask, local_sums, hparams)
    return EngineState(server, persistent), metrics


def _streamed_group(algorithm, config, state, arrays, sub, train, persistent, group, hparams):
    """One group's chunks under ``lax.scan`` into running sums of ``(client_stats, client metrics,
    local metrics, (kept weight, dropped clients, first dropped id))``; non-finite clients drop out."""
    chunk = config.clients_per_chunk
    n_chunks = sub.ids.shape[0] // chunk
    split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
    chunks = tuple(split(a) for a in (sub.ids, sub.mask, sub.weights, sub.keys, sub.budgets))

    def chunk_sums(ids, mask, w, keys, budgets):
        messages, new_persistent, client_metrics = train(ids, keys, budgets)
        messages = _attacked(algorithm, config, state, arrays, ids, keys, messages)
        finite = finite_rows((messages, new_persistent), chunk)
        bad = (mask > 0) & ~finite
        mask, w = jnp.where(bad, 0.0, mask), jnp.where(bad, 0.0, w)
        # the statistics' rows are zeroed rather than the messages', so the select fuses into the running sum
        stats = _zero_rows(jax.vmap(algorithm.client_stats)(messages), finite)
        messages = _zero_rows(messages, finite)  # for the local metrics only
        dropped = (jnp.sum(w), jnp.sum(bad).astype(jnp.float32),
                   jnp.min(jnp.where(bad, ids, jnp.iinfo(jnp.int32).max)))
        sums = (weighted_sum(stats, w),
                _client_metric_sums(client_metrics, mask),
                _local_metric_sums(algorithm, config, arrays, messages, w, mask, hparams), dropped)
        return sums, (new_persistent, mask)

    shapes = jax.eval_shape(lambda: chunk_sums(*(c[0] for c in chunks))[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = zeros[:3] + ((zeros[3][0], zeros[3][1], jnp.int32(jnp.iinfo(jnp.int32).max)),)

    def add(total, new):
        (kept, count, first), (new_kept, new_count, new_first) = total[3], new[3]
        return jax.tree.map(jnp.add, total[:3], new[:3]) + ((kept + new_kept, count + new_count,
                                                            jnp.minimum(first, new_first)),)

    def body(carry, xs):
        sums, persistent = carry
        new_sums, (new_persistent, kept) = chunk_sums(*xs)
        persistent = _scatter(persistent, _group_rows(config, xs[0], group), kept, new_persistent)
        return (add(sums, new_sums), persistent), None

    if config.client_devices == 1:
        (sums, persistent), _ = jax.lax.scan(body, (zeros, persistent), chunks)
        return sums, persistent, add
    mine = _device_share(chunks, config.client_devices)
    (sums, new_persistent), _ = jax.lax.scan(body, (zeros, persistent), mine)
    (kept, count, first) = sums[3]
    sums = jax.lax.psum((sums[:3], kept, count), PARALLEL_AXIS)
    sums = sums[0] + ((sums[1], sums[2], jax.lax.pmin(first, PARALLEL_AXIS)),)
    written = _written_rows(config, persistent, mine[0], mine[1], group)
    return sums, _merge_persistent(persistent, new_persistent, written), add


def _device_share(chunks, devices: int):
    """This device's chunks, ``[n_chunks, ...] -> [n_chunks / devices, ...]``: every ``devices``-th chunk from its
    index on (the cohort is sorted by size, so the devices' shares are alike)."""
    me = jax.lax.axis_index(PARALLEL_AXIS)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a.reshape((-1, devices) + a.shape[1:]), me, axis=1,
                                                               keepdims=False), chunks)


def _gathered_shares(per_device):
    """Every device's ``_device_share`` outputs ``[n_chunks / D, ...]`` on every device, in chunk order ``[n_chunks, ...]``."""
    everyone = jax.lax.all_gather(per_device, PARALLEL_AXIS)  # [D, n_chunks / D, ...]
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((-1,) + a.shape[2:]), everyone)


def _written_rows(config, persistent, ids, mask, group: int):
    """``[N_group]`` bool: the persistent rows this device's real clients (``ids``, ``mask``: any shape) own."""
    if not jax.tree.leaves(persistent):
        return None
    rows = jax.tree.leaves(persistent)[0].shape[0]
    owned = jnp.where(mask.reshape(-1) > 0, _group_rows(config, ids.reshape(-1), group), rows)
    return jnp.zeros((rows,), bool).at[owned].set(True, mode="drop")


def _merge_persistent(old, new, written):
    """Every device's copy of the persistent state with every device's written rows: each row comes from
    the one device that trained its client (an all-reduce of it and zeros, so exactly), else stays ``old``."""
    if written is None:
        return old
    anyone = jax.lax.psum(written.astype(jnp.int32), PARALLEL_AXIS) > 0

    def merge(o, n):
        shape = (-1,) + (1,) * (o.ndim - 1)
        exact = n.astype(jnp.int32) if n.dtype == jnp.bool_ else n
        ours = jax.lax.psum(jnp.where(written.reshape(shape), exact, jnp.zeros_like(exact)), PARALLEL_AXIS)
        return jnp.where(anyone.reshape(shape), ours.astype(o.dtype), o)

    return jax.tree.map(merge, old, new)


def _streamed_round(algorithm, config, state, arrays, cohort, groups, trainer, hparams, server_key):
    """Chunks run under ``lax.scan`` into a running weighted sum of ``client_stats``.

    Memory holds one chunk's clients and one copy of the statistics, whatever
    the cohort size; client and local metrics are summed chunk by chunk too.
    """
    persistent, totals = list(state.persistent), None
    for g, _, sub in groups:
        sums, persistent[g], add = _streamed_group(algorithm, config, state, arrays, sub, trainer(g), persistent[g], g,
                                                   hparams)
        totals = sums if totals is None else add(totals, sums)
    stats, client_sums, local_sums, (kept_weight, dropped, first) = totals
    # dropping clients leaves the weights summing to kept_weight: renormalise the (linear) sums
    scale = jnp.where(dropped > 0, 1.0 / jnp.maximum(kept_weight, 1e-30), 1.0)
    stats = jax.tree.map(lambda x: x * scale.astype(x.dtype), stats)
    local_sums = {name: value * scale for name, value in local_sums.items()}
    mask = cohort.mask  # the real count for the client-metric means: the kept clients
    real = jnp.sum(mask) - dropped
    total = jnp.where(dropped > 0, cohort.total * kept_weight, cohort.total)
    server, server_metrics = algorithm.server_from_stats(state.server, stats, mask,
                                                         _aggregation_hparams(hparams, total), server_key)
    server = jax.tree.map(lambda new, old: jnp.where(kept_weight > 0, new, old), server, state.server)
    fault_metrics = {"nonfinite_clients": dropped}
    if config.on_nonfinite == "stop":
        fault_metrics["first_nonfinite_client"] = jnp.where(dropped > 0, first, -1).astype(jnp.float32)
    kept_mask = jnp.where(jnp.arange(mask.shape[0]) < real, 1.0, 0.0)  # only its sum is read
    metrics = _round_metrics(algorithm, config, arrays, server, {**server_metrics, **fault_metrics}, client_sums,
                             kept_mask, local_sums, hparams)
    return EngineState(server, tuple(persistent)), metrics


def make_round_step(algorithm: Algorithm, config: RoundConfig, backend: str = "vmap", donate_state: bool = False):
    """Builds ``round_step(state, arrays, key, hparams) -> (state, metrics)``.

    ``backend="vmap"`` compiles the whole round once; ``"sequential"`` is the
    reference (a Python loop over clients, one jitted call each); ``"stepwise"``
    loops over clients and batches in Python (one jitted step per batch);
    ``"debug"`` is the stepwise loop with jit off and errors tagged with client and stage.

    ``donate_state=True`` (the vmap backend) donates the incoming ``state``'s buffers to the
    new state (``jax.jit(..., donate_argnums=0)``): the server and per-client state are
    updated in place instead of held twice, and the passed ``state`` is unusable afterwards
    (chain ``state, metrics = round_step(state, ...)``). ``simulate`` does this. The state must
    not share a buffer with arrays still needed (``init_state`` can keep ``params``' own
    arrays) nor hold one buffer twice (FedRef's server starts with three views of one model):
    pass ``with_own_buffers(state, params)`` to the first round.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if config.round_fractions is not None:
        full = make_round_step(algorithm, dataclasses.replace(config, round_fractions=None), backend, donate_state)
        subsets = jax.jit(lambda arrays, key: with_round_subsets(config, arrays, key)) if backend != "debug" else (
            lambda arrays, key: with_round_subsets(config, arrays, key))
        return lambda state, arrays, key, hparams: full(state, subsets(arrays, key), key, hparams)
    if backend == "vmap":
        def round_step(state, arrays, key, hparams):
            return _vmapped_round(algorithm, config, state, arrays, key, hparams)
        if config.client_devices > 1:  # every input and output replicated; _vmapped_round splits the chunks
            mesh = client_device_mesh(config.client_devices)
            replicated = jax.sharding.PartitionSpec()
            round_step = jax.shard_map(round_step, mesh=mesh, in_specs=replicated, out_specs=replicated,
                                       check_vma=False)
        return jax.jit(round_step, donate_argnums=0 if donate_state else ())
    if backend == "sequential":
        return _sequential_round_fn(algorithm, config)
    if backend == "stepwise":
        return _looped_round(algorithm, config, _looped_client(algorithm, config, jax.jit, _call), jax.jit)
    return _debug_round_fn(algorithm, config)


def client_device_mesh(devices: int) -> jax.sharding.Mesh:
    """The 1-D mesh (axis ``PARALLEL_AXIS``) of the first ``devices`` local devices, for ``client_devices``."""
    local = jax.local_devices()
    if devices > len(local):
        raise ValueError(f"client_devices={devices} but JAX sees {len(local)} local device(s); fix: fewer, or on a CPU "
                         "call bfedjax.core.layout.use_cpu_cores() before JAX's first computation")
    return jax.sharding.Mesh(np.asarray(local[:devices]), (PARALLEL_AXIS,))


def replicated_on(config: RoundConfig, tree):
    """``tree`` placed on every device of ``client_device_mesh`` (as is with one device): the round's inputs."""
    if config.client_devices == 1:
        return tree
    sharding = jax.sharding.NamedSharding(client_device_mesh(config.client_devices), jax.sharding.PartitionSpec())
    return jax.device_put(tree, sharding)


def with_own_buffers(state, *keep):
    """``state`` with a copy of each array leaf whose device buffer also backs a leaf of ``keep``
    (e.g. the caller's ``init_params``) or an earlier leaf of ``state``; the other leaves are
    returned as they are. Donating the result (``make_round_step(..., donate_state=True)``)
    then invalidates no array of ``keep`` and donates no buffer twice."""
    def buffers(x) -> set[tuple[str, int]]:
        if not x.is_fully_addressable:  # spans processes (its local shards cannot be listed here): the array itself
            return {("array", id(x))}
        return {("buffer", shard.data.unsafe_buffer_pointer()) for shard in x.addressable_shards}

    seen = set().union(*(buffers(x) for x in jax.tree.leaves(keep) if isinstance(x, jax.Array)))

    def own(x):
        if not isinstance(x, jax.Array):
            return x
        mine = buffers(x)
        if mine & seen:
            x = jnp.array(x, copy=True)
            mine = buffers(x)
        seen.update(mine)
        return x

    return jax.tree.map(own, state)


def _vmapped_round(algorithm, config, state, arrays, key, hparams):
    cohort = sample_cohort(config, arrays, key, algorithm.batch_size, algorithm.local_epochs)
    server_key = server_key_of(key)
    chunk = config.clients_per_chunk
    groups = _group_cohorts(config, cohort)

    def trainer(g):
        one = lambda cid, k, b: _run_one_client(algorithm, config, state, arrays, hparams, cid, k, b, g)
        if chunk == 1:  # one client at a time without a vmap: convolutions stay ungrouped (fast on CPU)
            return lambda ids, keys, budgets: jax.tree.map(lambda x: jnp.asarray(x)[None],
                                                           one(ids[0], keys[0], budgets[0]))
        return jax.vmap(one)

    if chunk is not None and chunk < config.padded_cohort and algorithm.streams:
        return _streamed_round(algorithm, config, state, arrays, cohort, groups, trainer, hparams, server_key)
    everyone = config.clients_per_round == config.num_clients == config.padded_cohort and config.num_groups == 1
    persistent, parts = list(state.persistent), []
    for g, positions, sub in groups:
        slots = sub.ids.shape[0]
        if everyone and chunk is None:
            # Full participation: vmap straight over the stored client axis (no gather copy).
            def train_in_place(data, persistent, cid, k, b):
                ctx = ClientContext(state.server, persistent, data, hparams, 0, client_test_data(arrays, cid))
                return _with_client_test_metrics(algorithm, arrays, cid, local_training(algorithm, ctx, k, b, config.fixed_local_steps, config.unroll_local_steps), 0)
            data = ClientData(arrays.x, arrays.y, arrays.counts)
            outputs = jax.vmap(train_in_place)(data, state.persistent[0], sub.ids, sub.keys, sub.budgets)
        elif chunk is None or chunk >= slots:
            outputs = trainer(g)(sub.ids, sub.keys, sub.budgets)
        else:
            n_chunks = slots // chunk
            split = lambda a: a.reshape((n_chunks, chunk) + a.shape[1:])
            chunks = (split(sub.ids), split(sub.keys), split(sub.budgets))
            if config.client_devices > 1:
                chunks = _device_share(chunks, config.client_devices)
            out = jax.lax.map(lambda args: trainer(g)(*args), chunks)
            if config.client_devices > 1:  # every device gets every client's outputs, in cohort order
                out = _gathered_shares(out)
            outputs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
        messages, new_persistent, client_metrics = outputs
        finite = finite_rows((messages, new_persistent), slots)  # a non-finite client keeps its old state
        kept = jnp.where(finite, sub.mask, 0.0)
        persistent[g] = _scatter(persistent[g], _group_rows(config, sub.ids, g), kept, new_persistent)
        parts.append((positions, (messages, client_metrics, finite)))
    messages, client_metrics, finite = _merge_groups(parts, config.padded_cohort)
    return finish_round(algorithm, config, state, arrays, cohort, messages, client_metrics, finite, tuple(persistent),
                   hparams, server_key)


def _looped_round(algorithm, config, one_client, wrap):
    """A round whose clients run one after another through ``one_client`` (the reference backends).

    ``wrap`` is ``jax.jit`` for the sampling and the aggregation, or the identity (debug).
    """
    sample = wrap(lambda arrays, key: sample_cohort(config, arrays, key, algorithm.batch_size,
                                                    algorithm.local_epochs))
    finish = wrap(lambda *args: finish_round(algorithm, config, *args))
    scatter = wrap(_scatter)
    finite_one = wrap(lambda tree: finite_rows(jax.tree.map(lambda x: jnp.asarray(x)[None], tree), 1)[0])
    n, group_of = config.num_clients, config.group_of

    def round_step(state, arrays, key, hparams):
        cohort = sample(arrays, key)
        ids = np.asarray(cohort.ids)
        groups = [int(group_of[min(cid, n - 1)]) for cid in ids]
        outputs = [one_client(state, arrays, hparams, int(ids[i]), cohort.keys[i], cohort.budgets[i], groups[i])
                   for i in range(config.padded_cohort)]
        finite = jnp.asarray([bool(finite_one(o[:2])) for o in outputs])  # message and persistent state
        kept = jnp.where(finite, cohort.mask, 0.0)
        persistent = list(state.persistent)
        for g in range(config.num_groups):
            slots = [i for i in range(len(ids)) if ids[i] < n and groups[i] == g]
            if slots and jax.tree.leaves(persistent[g]):
                rows = jnp.asarray(config.index_in_group[ids[slots]])
                persistent[g] = scatter(persistent[g], rows, kept[np.asarray(slots)],
                                        tree_stack([outputs[i][1] for i in slots]))
        messages, metrics = tree_stack([o[0] for o in outputs]), tree_stack([o[2] for o in outputs])
        return finish(state, arrays, cohort, messages, metrics, finite, tuple(persistent), hparams,
                      server_key_of(key))

    return round_step


def _sequential_round_fn(algorithm, config):
    """One jitted call per client (the whole local training)."""
    run = jax.jit(lambda state, arrays, hparams, cid, k, b, g: _run_one_client(algorithm, config, state, arrays,
                                                                                hparams, cid, k, b, g),
                  static_argnums=6)
    return _looped_round(algorithm, config, run, jax.jit)


def _call(stage, client, fn, *args):
    del stage, client
    return fn(*args)


def _looped_client(algorithm, config, wrap, call):
    """``one_client`` of the stepwise and debug backends: Python loops over epochs and real batches.

    ``wrap`` compiles each stage (``jax.jit``, or the identity for debug); ``call(stage, client, fn, *args)``
    runs one stage (debug adds the client and stage to errors).
    """
    batch_size = algorithm.batch_size
    inputs = {g: wrap(lambda state, arrays, cid, g=g: client_inputs(state, arrays, config, cid, g))
              for g in range(config.num_groups)}
    client_test = {g: wrap(lambda arrays, cid, out, g=g: _with_client_test_metrics(algorithm, arrays, cid, out, g))
                   for g in range(config.num_groups)}
    test_of = wrap(client_test_data)
    init = wrap(algorithm.client_init)
    order_of = wrap(epoch_permutation, static_argnums=2) if wrap is jax.jit else epoch_permutation
    step = wrap(lambda local, ctx, order, j, key: algorithm.client_step(
        local, take_batch(ctx.data, order, j, batch_size), ctx, key))
    final = wrap(algorithm.client_final)

    def one_client(state, arrays, hparams, client_id, key, budget, group):
        data, persistent = inputs[group](state, arrays, client_id)
        ctx = ClientContext(state.server, persistent, data, hparams, group, test_of(arrays, client_id))
        init_key, perm_key, step_key = jax.random.split(key, 3)  # as local_training
        local = call("init", client_id, init, ctx, init_key)
        real_batches, taken = math.ceil(int(data.count) / batch_size), 0
        for e in range(algorithm.local_epochs):
            order = order_of(perm_key, data.count, data.y.shape[0], e)
            epoch_key = jax.random.fold_in(step_key, e)
            for j in range(min(real_batches, int(budget) - taken)):
                local = call(f"step (epoch {e}, batch {j})", client_id, step, local, ctx, order, j,
                             jax.random.fold_in(epoch_key, j))
                taken += 1
        out = call("final", client_id, final, local, ctx)
        return call("client test", client_id, client_test[group], arrays, client_id, out)

    return one_client


class StageError(RuntimeError):
    """Raised by the debug backend: ``stage`` (init / step / final / server / evaluate) of ``client`` failed."""

    def __init__(self, stage: str, client, message: str):
        where = f"client {client}, stage {stage}" if client is not None else f"stage {stage}"
        super().__init__(f"{where}: {message}")
        self.stage, self.client = stage, client


def _non_finite_leaf(tree) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) and not bool(jnp.all(jnp.isfinite(leaf))):
            return jax.tree_util.keystr(path) or "(the value)"
    return None


def _debug_call(stage, client, fn, *args):
    """Runs one stage eagerly; exceptions and non-finite outputs become a ``StageError`` naming it."""
    try:
        out = fn(*args)
    except StageError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with the client and stage attached
        raise StageError(stage, client, f"{type(err).__name__}: {err}") from err
    bad = _non_finite_leaf(out)
    if bad is not None:
        raise StageError(stage, client, f"non-finite values in {bad}")
    return out


def _debug_round_fn(algorithm, config):
    """The stepwise loop with jit off; the server and evaluation stages are checked too."""
    identity = lambda fn, **_: fn
    checked = dataclasses.replace(
        algorithm,
        server_update=(lambda *args: _debug_call("server", None, algorithm.aggregate, *args)),
        client_stats=None, server_from_stats=None,
        evaluate=None if algorithm.evaluate is None else
        (lambda *args: _debug_call("evaluate", None, algorithm.evaluate, *args)))
    round_step = _looped_round(checked, config, _looped_client(algorithm, config, identity, _debug_call), identity)

    def debug_round(state, arrays, key, hparams):
        with jax.disable_jit():
            return round_step(state, arrays, key, hparams)

    return debug_round


__all__ = ["BACKENDS", "NONFINITE_POLICIES", "NO_BUDGET", "STRAGGLER_WEIGHTINGS", "Cohort", "EngineState",
           "RoundArrays", "RoundConfig", "StageError", "finish_round", "finite_rows", "init_state", "local_training",
           "make_round_step", "persistent_init_key", "sample_cohort", "server_key_of", "straggler_epochs",
           "with_fixed_local_steps", "with_own_buffers", "with_round_subsets"]
