"""The client half of a round, one client's part: its inputs (data, its rows of the persistent state, test
split), its local training (``local_training``: epochs under ``lax.scan``, steps under a ``lax.while_loop``
or a fixed-step scan), the scores of its own models on its own test split, and the write-back of its new
persistent state. The same
functions run under the engine's client vmap, in its chunks and in the reference backends."""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp

from bfedjax.core import layout
from bfedjax.core.batching import batch_is_real, epoch_permutation, steps_per_epoch, take_batch
from bfedjax.core.sampling import NO_BUDGET
from bfedjax.core.round_config import EngineState, RoundArrays, RoundConfig
from bfedjax.core.types import Algorithm, ClientContext, ClientData


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
    init_key, perm_key, step_key = jax.random.split(key, 3)  # same derivation in reference_backends._looped_client
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


def group_rows(config: RoundConfig, client_ids, group: int):
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
    row = group_rows(config, client_id, group)
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


def with_client_test_metrics(algorithm: Algorithm, arrays: RoundArrays, client_id, outputs, group: int):
    """Adds ``client_test_<name>``: the client's own models scored on its own test split (if the federation has one)."""
    message, persistent, metrics = outputs
    test = client_test_data(arrays, client_id)
    if test is None:
        return outputs
    x, y = test.x, test.y
    mask = (jnp.arange(y.shape[0]) < test.count).astype(jnp.float32)
    if algorithm.evaluate_client is not None:
        scores = algorithm.evaluate_client(message, persistent, x, y, mask, group)
    elif algorithm.can_score_local(message):
        scores = algorithm.evaluate(algorithm.scored_local(message), x, y, mask)
    else:
        return outputs
    scores = {f"client_test_{name}": value for name, value in scores.items()}
    clash = sorted(set(scores) & set(metrics))
    if clash:
        raise ValueError(f"{algorithm.name}: client metrics {clash} clash with the per-client test metrics; "
                         "fix: rename")
    return message, persistent, {**metrics, **scores}


def run_one_client(algorithm, config, state, arrays, hparams, client_id, key, budget, group, inputs=None):
    """``(message, persistent, metrics)`` of client ``client_id`` of ``group`` (padding id ``N``: an empty
    client) after its local training under the step ``budget``, with its per-client test metrics.

    ``inputs``: the client's ``(ClientData, persistent state)`` where the caller already holds them (the
    full-participation vmap over the stored client axis); ``None`` gathers them (``client_inputs``).
    """
    data, persistent = client_inputs(state, arrays, config, client_id, group) if inputs is None else inputs
    ctx = ClientContext(state.server, persistent, data, hparams, group, client_test_data(arrays, client_id))
    outputs = local_training(algorithm, ctx, key, budget, config.fixed_local_steps, config.unroll_local_steps)
    return with_client_test_metrics(algorithm, arrays, client_id, outputs, group)


def scatter_persistent(persistent, rows, mask, new):
    """Writes the real clients' new persistent rows (padding slots are dropped)."""
    if not jax.tree.leaves(persistent):  # no persistent state (the client returns an empty pytree)
        return persistent
    n = jax.tree.leaves(persistent)[0].shape[0]
    rows = jnp.where(mask > 0, rows, n)
    return jax.tree.map(lambda all_, new_: all_.at[rows].set(new_, mode="drop"), persistent, new)


__all__ = ["client_inputs", "client_test_data", "local_training", "per_client", "run_one_client", "scanned_steps",
           "scatter_persistent", "with_client_test_metrics"]
