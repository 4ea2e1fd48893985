"""``simulate``: run R rounds of an algorithm on federated data.

The host loop only feeds round keys and traced hyper-parameters to the
compiled ``round_step``, records metrics, and checkpoints.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax.core.attacks import Attack, flip_labels
from bfedjax.core import layout
from bfedjax.core.client_half import client_inputs, client_test_data
from bfedjax.core.engine import make_round_step, replicated_on, with_own_buffers
from bfedjax.core.round_config import EngineState, RoundArrays, RoundConfig, init_state, with_fixed_local_steps
from bfedjax.core.types import Algorithm, ClientContext


class NonFiniteClientError(ValueError):
    """A client sent NaN or Inf and the run was asked to stop (``simulate(on_nonfinite="stop")``)."""


@dataclasses.dataclass
class SimulationResult:
    """metrics: per-round lists: ``round``, ``seconds``, the algorithm's client and server metrics, and
    the evaluate hook's ``global_<name>`` / ``local_<name>`` (for classification ``global_accuracy``,
    ``global_loss``, ``local_accuracy``, ``local_loss``, and ``best_global_accuracy``, the best so far);
    state: the final ``EngineState``; clients_per_chunk: the layout the rounds ran with (``None``: the
    whole cohort in one vmap; with ``"auto"``, what ``core.layout`` chose); client_devices: the devices
    the cohort's chunks were split over (``RoundConfig.client_devices``)."""

    algorithm: str
    metrics: dict
    state: EngineState
    clients_per_chunk: int | None = None
    client_devices: int = 1

    @property
    def best_global_accuracy(self) -> float:
        return float(np.nanmax(self.metrics["global_accuracy"]))


CLIENT_WEIGHTINGS = ("by_size", "uniform")


def client_base_weights(counts, client_weights=None) -> np.ndarray:
    """``[N]`` float32 weights summing to 1 from the clients' sample ``counts [N]`` (``round_arrays``'s).

    ``client_weights``: ``None`` or ``"by_size"`` (pi_n = m_n/m), ``"uniform"``, or ``[N]`` weights.
    """
    counts = np.asarray(counts)
    if isinstance(client_weights, str):
        if client_weights not in CLIENT_WEIGHTINGS:
            raise ValueError(f"client_weights={client_weights!r}; choose one of {CLIENT_WEIGHTINGS} or give N numbers")
        client_weights = None if client_weights == "by_size" else np.ones(len(counts), np.float32)
    weights = (counts / counts.sum()).astype(np.float32) if client_weights is None else np.asarray(client_weights,
                                                                                                   np.float32)
    if weights.shape != (len(counts),) or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(f"client_weights must be {len(counts)} non-negative numbers with a positive sum")
    return weights / weights.sum()


def round_key(key: jax.Array, r: int) -> jax.Array:
    """The key of round ``r`` of a run with key ``key`` (round 0's initialises the model and persistent state)."""
    return jax.random.fold_in(key, r)


def round_arrays(fed, client_weights=None) -> RoundArrays:
    """Device copies of a ``FederatedData``.

    ``client_weights``: ``None`` or ``"by_size"`` (pi_n = m_n/m), ``"uniform"``
    (the unweighted mean of the cohort, as FedReg's experiments), or ``[N]`` weights.
    """
    weights = client_base_weights(fed.counts, client_weights)
    own_tests = {}
    if fed.test_counts is not None:
        own_tests = dict(x_test_clients=jnp.asarray(fed.x_test_clients), y_test_clients=jnp.asarray(fed.y_test_clients),
                         test_counts=jnp.asarray(fed.test_counts))
    return RoundArrays(jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.asarray(fed.counts),
                       jnp.asarray(weights), jnp.ones(fed.num_clients, jnp.float32),
                       jnp.asarray(fed.x_test), jnp.asarray(fed.y_test), **own_tests)


def with_attackers(arrays: RoundArrays, attack: Attack, num_classes: int) -> RoundArrays:
    """``arrays`` with ``attack``'s malicious clients marked (``[N]``) and, for ``label_flip``, their labels flipped."""
    malicious = attack.malicious(arrays.counts.shape[0])
    arrays = arrays._replace(malicious=jnp.asarray(malicious, jnp.float32))
    if attack.kind == "label_flip":
        arrays = arrays._replace(y=flip_labels(arrays.y, jnp.asarray(malicious), num_classes))
    return arrays


def traced_hparams(algorithm: Algorithm, round_index: int, overrides: dict | None = None) -> dict:
    """Per-round scalars with fixed dtypes (``round`` int32, the rest float32): no recompiles.

    ``overrides`` may only change the algorithm's own hyper-parameters (``algorithm.hparams``).
    """
    unknown = sorted(set(overrides or {}) - set(algorithm.hparams))
    if unknown:
        raise ValueError(f"hyper-parameters {unknown} are not {algorithm.name}'s; it has {sorted(algorithm.hparams)}")
    values = {**algorithm.hparams, **(overrides or {})}
    out = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
    out["round"] = jnp.asarray(round_index, jnp.int32)
    return out


def cohort_size(num_clients: int, clients_per_round: int | None = None, participation: float | None = None) -> int:
    """K from an explicit count or a participation rate in (0, 1] (at least one client)."""
    if clients_per_round is not None and participation is not None:
        raise ValueError("give clients_per_round or participation, not both")
    if participation is not None:
        if not 0 < participation <= 1:
            raise ValueError(f"participation={participation} must be in (0, 1], e.g. 0.1 for 10% of clients")
        return max(1, int(round(participation * num_clients)))
    return clients_per_round or num_clients


def run_identity(algorithm: Algorithm, key: jax.Array, arrays: RoundArrays, initial_state, config: RoundConfig,
                 participation: float | None = None, extra: dict | None = None) -> dict:
    """What a checkpoint must have been saved by to be resumed (``checkpoint.RoundCheckpointer``): the algorithm's
    name, hyper-parameters, epochs and batch size, the run key, a fingerprint of the round arrays (data, weights,
    attackers; ``checkpoint.tree_digest`` of about 2^16 values a leaf), the initial state's checksum (model,
    init; ``None`` for a given ``init_server``, which a resume recomputes, e.g. by pre-training, and which need not
    be bitwise repeatable on an accelerator), the cohort and the round options that change training, and
    ``extra`` (e.g. a binary's flags)."""
    from bfedjax.checkpoint import tree_digest
    return {"algorithm": algorithm.name, "local_epochs": algorithm.local_epochs, "batch_size": algorithm.batch_size,
            "hparams": {name: np.asarray(value).tolist() for name, value in (algorithm.hparams or {}).items()},
            "key": tree_digest(key), "data": tree_digest(arrays, max_values=1 << 16),
            "initial_state": None if initial_state is None else tree_digest(initial_state),
            "clients_per_round": config.clients_per_round,
            "participation": participation, "stragglers": [config.straggler_fraction, config.straggler_weighting],
            "round_fractions": config.round_fractions, "attack": repr(config.attack),
            "client_groups": None if config.client_groups is None else list(config.client_groups),
            **({"settings": extra} if extra else {})}


def simulate(algorithm: Algorithm, fed, *, rounds: int, key: jax.Array, clients_per_round: int | None = None,
             participation: float | None = None,
             clients_per_chunk: int | str | None = layout.AUTO, backend: str = "vmap", client_weights=None,
             hparams_fn: Callable[[int], dict] | None = None, evaluate_local: bool = True, evaluate_every: int = 1,
             init_params=None, init_server=None, checkpoint_dir: str | None = None,
             mesh=None, client_groups=None, straggler_fraction: float = 0.0,
             straggler_weighting: str = "unchanged", attack: Attack | None = None, on_nonfinite: str = "drop",
             round_fractions: Sequence[float] | None = None, on_round: Callable[[dict], None] | None = None,
             stop_when: Callable[[list[dict]], bool] | None = None,
             client_devices: int | str = layout.AUTO, checkpoint_identity: dict | None = None) -> SimulationResult:
    """Runs ``rounds`` federated rounds.

    Args:
      algorithm: an ``Algorithm`` (e.g. ``bfedjax.algorithms.fola(model)``).
      fed: ``data.FederatedData`` (``x [N, max_n, ...]``, ``y [N, max_n]``, ``counts [N]``, the test split).
      rounds: how many rounds R (a resumed run trains the ones its checkpoint lacks).
      key: run key; model init uses ``fold_in(key, 0)``, round r uses ``fold_in(key, r)``.
      clients_per_round: cohort size K (default: all clients).
      participation: alternatively, K = round(participation * N), sampled afresh every round.
      clients_per_chunk: train the cohort in chunks of this many clients (1: one after another, no vmap;
        bounded memory); ``None``: the whole cohort in one vmap; ``"auto"`` (default): chosen from the
        platform, the model and the cohort by ``core.layout.auto_clients_per_chunk`` (the vmap backend
        only; ``result.clients_per_chunk`` says which).
      client_devices: split the cohort's chunks over this many local devices (``RoundConfig.client_devices``;
        the vmap backend, no ``mesh``); ``"auto"`` (default): on a CPU every local device, so every
        core when ``core.layout.use_cpu_cores()`` ran first (``experiments.run`` does), else 1
        (``result.client_devices`` says which). With ``clients_per_chunk=None``, more than one device
        splits the cohort into one chunk per device.
      backend: "vmap" (one jitted round), "sequential" or "stepwise" (reference loops) or
        "debug" (jit off; errors name the client and the stage).
      client_weights: ``[N]`` overrides pi_n = m_n/m (renormalised over each cohort);
        ``"uniform"`` gives every client the same weight (the unweighted cohort mean).
      hparams_fn: ``round -> {"lr": ..., ...}`` overrides of the algorithm's hyper-parameters (traced).
      evaluate_every: evaluate (GA, and LA with ``evaluate_local``) only every this many rounds; the
        others record NaN for those metrics (``rounds`` must be a multiple, so the last round is
        evaluated; a coarser curve: rounds-to-target counts only evaluated rounds; FedReg spec
        decision 17).
      init_params: initial model parameters (default: ``algorithm.init_params``).
      init_server: a whole initial server state (e.g. from ``pretrain``), overriding ``init_params``.
      checkpoint_dir: save after every round and resume from the latest save. A save of another run is not
        resumed (``checkpoint.DifferentRunError``, naming what differs): each save records the run's identity,
        ``run_identity``'s algorithm, hyper-parameters, key, data fingerprint and initial state's checksum
        plus ``checkpoint_identity``.
      checkpoint_identity: JSON-able settings that also identify the run (``experiments.run`` passes its flags,
        which name options a closure holds, e.g. FOLA's Fisher estimator); ``rounds`` and the layout may change
        between a run and its resume.
      mesh: a ``jax.sharding.Mesh`` with axis ``'clients'`` (``core.sharding.client_mesh()``):
        clients are sharded over its devices, the server state is replicated.
      client_groups: ``[N]`` architecture group of each client (``0..algorithm.num_groups - 1``;
        default: all in group 0). Clients of a group train vmapped together and keep their
        persistent state (e.g. a local model of the group's architecture) in the group's arrays.
      straggler_fraction: this fraction of clients trains ``x ~ U{1..E}`` epochs each round
        (drawn from the round key: the same stragglers for every algorithm at a given seed).
      straggler_weighting: ``"unchanged"`` (stragglers keep their weight) or ``"by_epochs"``
        (weight scaled by ``x / E``).
      attack: an ``attacks.Attack``: ``round(fraction * N)`` seeded clients send sign-flipped, scaled
        or noise updates, or train on flipped labels (``None``: nobody attacks).
      on_nonfinite: a client whose message holds NaN or Inf is always left out of the aggregation
        (``nonfinite_clients`` counts them per round); ``"stop"`` raises ``NonFiniteClientError``
        after the round, naming the round and the client, before the round is checkpointed.
      round_fractions: e.g. ``(0.5, 0.6, 0.7, 0.8, 0.9)``: each round every client trains on the
        first ``round(f * n_k)`` rows of its data with ``f`` drawn from these (its weight scaled
        by ``f``); with ``data.partition(..., "nested")`` these are FedRef's nested subsets.
      on_round: called with each round's record (a dict of floats).
      stop_when: called with the records so far after each round; ``True`` ends the run
        early (e.g. ``patience_reached`` for early stopping).

    Returns:
      ``SimulationResult``: ``metrics`` (per-round lists: ``round``, ``seconds``, ``global_accuracy``, ...),
      the final ``state`` (``state.server``: the algorithm's server state, e.g. FOLA's
      ``{"params", "precision"}``), and the layout the rounds ran with.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if evaluate_every < 1 or rounds % evaluate_every:
        raise ValueError(f"evaluate_every={evaluate_every} must be >= 1 and divide rounds={rounds}, so the last round "
                         f"is evaluated; fix: e.g. rounds={rounds + (-rounds) % max(evaluate_every, 1)}")
    k = cohort_size(fed.num_clients, clients_per_round, participation)
    num_clients, arrays = fed.num_clients, round_arrays(fed, client_weights)
    if attack is not None:
        arrays = with_attackers(arrays, attack, fed.num_classes)
    host_arrays = arrays  # before sharding: the counts stay readable on every host
    groups = _checked_groups(algorithm, client_groups, fed.num_clients)
    if mesh is not None:
        from bfedjax.core import sharding
        num_clients = sharding.padded_client_count(fed.num_clients, mesh)
        k = num_clients if k == fed.num_clients else k  # everyone: the mesh's empty clients ride along, masked
        arrays = sharding.shard_arrays(sharding.pad_clients(arrays, num_clients), mesh)
        groups = None if groups is None else groups + (0,) * (num_clients - fed.num_clients)
    auto = isinstance(clients_per_chunk, str)
    if auto and clients_per_chunk != layout.AUTO:
        raise ValueError(f"clients_per_chunk={clients_per_chunk!r}; give a number of clients >= 1, None (one vmap) "
                         f"or {layout.AUTO!r}")
    config = RoundConfig(num_clients=num_clients, clients_per_round=k, clients_per_chunk=None if auto else clients_per_chunk,
                         evaluate_local=evaluate_local, evaluate_every=evaluate_every, pad_cohort_to=mesh.devices.size if mesh is not None else 1,
                         client_groups=groups, straggler_fraction=straggler_fraction,
                         straggler_weighting=straggler_weighting, attack=attack, on_nonfinite=on_nonfinite,
                         round_fractions=None if round_fractions is None else tuple(round_fractions))
    config = with_fixed_local_steps(config, host_arrays)
    callers_arrays = (init_params, init_server)  # the rounds must not donate these
    if init_params is None and init_server is None:
        if algorithm.init_params is None:
            raise ValueError(f"{algorithm.name} has no init_params hook; fix: pass simulate(..., init_params=...)")
        init_params = algorithm.init_params(round_key(key, 0), fed.input_shape)
    if init_params is None:  # the server state is given; persistent state starts from its global model
        init_params = algorithm.global_params(init_server)
    state = init_state(algorithm, init_params, config, round_key(key, 0))
    if init_server is not None:
        state = state._replace(server=init_server)
    if mesh is not None:
        state = sharding.shard_state(state, mesh)
    replicated_bytes = layout.tree_bytes(arrays) + layout.tree_bytes(state)
    if auto and backend == "vmap" and mesh is None:  # chunks for the most devices the split may take (one per client)
        most = with_client_devices(dataclasses.replace(config, clients_per_chunk=1), client_devices, backend, mesh,
                                   replicated_bytes).client_devices
        config = dataclasses.replace(config, clients_per_chunk=auto_layout(algorithm, config, state, arrays, most))
    config = with_client_devices(config, client_devices, backend, mesh, replicated_bytes)
    donate = backend == "vmap"
    round_step = make_round_step(algorithm, config, backend, donate_state=donate)

    history: list[dict] = []
    checkpointer = None
    if checkpoint_dir:
        from bfedjax.checkpoint import RoundCheckpointer
        checkpointer = RoundCheckpointer(checkpoint_dir, run_identity=run_identity(
            algorithm, key, host_arrays, None if init_server is not None else state, config, participation,
            checkpoint_identity))
        last = checkpointer.latest_round()
        if last is not None and last > rounds:
            raise ValueError(f"the checkpoint in {checkpoint_dir} is at round {last} > rounds={rounds}; "
                             "fix: ask for at least that many rounds, or start over (--noresume / a new directory)")
        restored = checkpointer.restore_latest(state, owner=algorithm.name)  # skips damaged ones, or raises
        if restored is not None:
            _, state, history = restored
            del restored  # the initial state is garbage now: no second copy for the whole run
    state, arrays = replicated_on(config, (state, arrays))  # one device: as they are
    if donate:  # the rounds update the state in place: copy only what the caller holds or what is held twice
        state = with_own_buffers(state, *callers_arrays)
    for r in range(len(history) + 1, rounds + 1):
        start = time.perf_counter()
        hparams = traced_hparams(algorithm, r, hparams_fn(r) if hparams_fn else None)
        with layout.random_bits_lowering(sharded=mesh is not None and mesh.devices.size > 1):  # compiles round 1
            state, metrics = round_step(state, arrays, round_key(key, r), hparams)
        record = {"round": r, **{k: float(v) for k, v in metrics.items()}}
        record["seconds"] = time.perf_counter() - start
        first_bad = record.pop("first_nonfinite_client", -1)
        if first_bad >= 0:
            raise NonFiniteClientError(
                f"round {r}: client {int(first_bad)} sent NaN or Inf ({int(record['nonfinite_clients'])} client(s) "
                "this round); fix: check that client's data (bfedjax.data validates loaded files), lower the "
                "learning rate, or let such clients drop out (on_nonfinite='drop')")
        if "global_accuracy" in record:
            record["best_global_accuracy"] = float(np.nanmax([record["global_accuracy"], history[-1][
                "best_global_accuracy"] if history else 0.0]))  # a round evaluate_every skips records NaN
        history.append(record)
        if checkpointer:
            checkpointer.save(r, state, history)
        if on_round:
            on_round(record)
        if stop_when is not None and stop_when(history):
            break
    if checkpointer:
        checkpointer.close()
    metrics = {k: [h[k] for h in history] for k in history[0]}
    return SimulationResult(algorithm.name, metrics, state, config.clients_per_chunk, config.client_devices)


def with_client_devices(config: RoundConfig, client_devices=layout.AUTO, backend: str = "vmap",
                        mesh=None, replicated_bytes: int = 0) -> RoundConfig:
    """``config`` with ``client_devices`` resolved (``"auto"``: ``core.layout.auto_client_devices``); more than
    one device with no chunks gives each device one chunk. ``replicated_bytes``: what every device holds a copy
    of (the round's data and state): ``"auto"`` takes no more devices than the RAM allows."""
    if isinstance(client_devices, str):
        if client_devices != layout.AUTO:
            raise ValueError(f"client_devices={client_devices!r}; give a device count >= 1 or {layout.AUTO!r}")
        if backend != "vmap" or mesh is not None:
            return config
        client_devices = layout.auto_client_devices(
            platform=jax.devices()[0].platform, local_devices=len(jax.local_devices()),
            clients_per_chunk=config.clients_per_chunk, cohort=config.clients_per_round,
            replicated_bytes=replicated_bytes)
    if int(client_devices) == 1:
        return config
    if backend != "vmap" or mesh is not None:
        raise ValueError(f"client_devices={client_devices} needs backend='vmap' and no mesh; fix: client_devices=1, or "
                         "shard the clients with mesh= instead")
    chunk = config.clients_per_chunk or -(-config.clients_per_round // int(client_devices))
    return dataclasses.replace(config, clients_per_chunk=chunk, client_devices=int(client_devices))


def auto_layout(algorithm: Algorithm, config: RoundConfig, state: EngineState, arrays: RoundArrays,
                client_devices: int | str = layout.AUTO) -> int | None:
    """``core.layout.auto_clients_per_chunk`` for this round, from the model's, the clients' and their local
    training state's sizes, and the devices ``client_devices`` may split the round over."""
    device = jax.devices()[0]
    devices = len(jax.local_devices()) if client_devices == layout.AUTO else int(client_devices)
    params = algorithm.global_params(state.server)
    return layout.auto_clients_per_chunk(
        convolutional=layout.has_conv_kernels(params, state.persistent),
        model_bytes=layout.tree_bytes(params),
        local_state_bytes=local_state_bytes(algorithm, config, state, arrays),
        persistent_bytes_per_client=layout.tree_bytes(state.persistent) / config.num_clients,
        cohort=config.clients_per_round, platform=device.platform,
        device_memory_bytes=layout.device_memory_bytes(device), devices=devices)


def local_state_bytes(algorithm: Algorithm, config: RoundConfig, state: EngineState, arrays: RoundArrays) -> int:
    """Bytes of ``client_init``'s local state for the first client of each architecture group, the largest
    (shapes only: ``jax.eval_shape``, nothing runs)."""
    hparams = traced_hparams(algorithm, 1)

    def local_state(client_id: int, group: int):
        data, persistent = client_inputs(state, arrays, config, client_id, group)
        ctx = ClientContext(state.server, persistent, data, hparams, group, client_test_data(arrays, client_id))
        return algorithm.client_init(ctx, jax.random.PRNGKey(0))

    firsts = {int(g): int(np.argmax(config.group_of == g)) for g in np.unique(config.group_of)}
    return max(layout.tree_bytes(jax.eval_shape(lambda: local_state(client, group)))
               for group, client in firsts.items())


def _checked_groups(algorithm: Algorithm, client_groups, num_clients: int) -> tuple[int, ...] | None:
    """``client_groups`` as a tuple, checked against the federation and the algorithm's groups."""
    if client_groups is None:
        if algorithm.num_groups > 1:
            raise ValueError(f"{algorithm.name} has {algorithm.num_groups} architecture groups; fix: pass "
                             "client_groups=[group of each client] (e.g. --client_architectures)")
        return None
    groups = tuple(int(g) for g in np.asarray(client_groups).ravel())
    if len(groups) != num_clients:
        raise ValueError(f"client_groups has {len(groups)} entries for {num_clients} clients; fix: one per client")
    if min(groups) < 0 or max(groups) >= algorithm.num_groups:
        raise ValueError(f"client_groups must be in 0..{algorithm.num_groups - 1} ({algorithm.name}'s groups), "
                         f"got {min(groups)}..{max(groups)}")
    return groups


def patience_reached(history: list[dict], patience: int, metric: str = "global_accuracy") -> bool:
    """True once ``metric`` has not improved on its best for ``patience`` rounds (Keras EarlyStopping);
    rounds that were not evaluated (NaN, ``evaluate_every``) are skipped."""
    values = np.asarray([h[metric] for h in history], np.float64)
    if np.all(np.isnan(values)):
        return False
    return len(values) - 1 - int(np.nanargmax(values)) >= patience


def pretrain(algorithm: Algorithm, x, y, *, epochs: int, key: jax.Array, num_classes: int, init_params=None,
             validation_fraction: float = 0.0, patience: int | None = None):
    """Server-side pre-training: the algorithm's own local training on server data, as one client.

    Without validation it runs one round with a single client holding
    ``x [n, ...]``, ``y [n]`` for ``epochs`` local epochs. With
    ``validation_fraction > 0`` it holds that random fraction of ``x`` out and
    trains one epoch per round (optimiser state fresh each epoch, as every
    round) for at most ``epochs`` epochs, stopping once the held-out accuracy
    has not improved for ``patience`` epochs and keeping the last weights, as
    Keras's ``EarlyStopping`` (Fischer et al.'s protocol: 100 epochs, 10% validation,
    patience 10). Returns the server state, to pass as
    ``simulate(..., init_server=...)`` (the DWC protocol starts from it).
    """
    from bfedjax.data.federated import stack_clients
    x, y = np.asarray(x), np.asarray(y)
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be in [0, 1), e.g. 0.1")
    if validation_fraction and algorithm.evaluate is None:
        raise ValueError(f"early-stopped pre-training scores {algorithm.name} on held-out data; it has no "
                         "evaluate hook (fix: give the Algorithm evaluate=..., or validation_fraction=0)")
    if validation_fraction == 0.0:
        server_data = stack_clients(x, y, [np.arange(len(y))], x_test=x[:1], y_test=y[:1], num_classes=num_classes)
        result = simulate(algorithm.replace(local_epochs=epochs), server_data, rounds=1, key=key,
                          init_params=init_params, evaluate_local=False)
        return result.state.server
    order = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()).permutation(len(y))
    n_val = max(1, int(round(validation_fraction * len(y))))
    val, train = order[:n_val], order[n_val:]
    server_data = stack_clients(x, y, [train], x_test=x[val], y_test=y[val], num_classes=num_classes)
    stop = (lambda history: patience_reached(history, patience)) if patience else None
    result = simulate(algorithm.replace(local_epochs=1), server_data, rounds=epochs, key=key,
                      init_params=init_params, evaluate_local=False, stop_when=stop)
    return result.state.server
