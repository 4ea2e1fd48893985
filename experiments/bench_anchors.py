"""Anchors for experiments/bench.py (issue 18): what a federated round could cost at best.

* ``centralised_round_seconds``: the ceiling a federated round can approach, ONE model
  trained centrally on the same samples with the same number of sequential steps
  (``n / B`` SGD steps of ``K * B`` samples, one jitted ``lax.scan``);
* ``matmul_peak_flops``, ``memory_bandwidth_bytes_per_s``: the machine's measured dense-matmul
  peak and streaming bandwidth;
* ``round_traffic_bytes``: the parameter traffic of a round's local steps;
* ``roofline_seconds``: the roofline bound ``max(FLOPs / peak, bytes / bandwidth)``.

No absl flags: bench.py calls these and adds their rows.
"""
from __future__ import annotations

import time

import numpy as np

BYTES_PER_FLOAT32 = 4
# Parameter-sized float32 arrays streamed per local step (see round_traffic_bytes).
PARAM_PASSES_PER_STEP = {"fedavg": 4, "fola": 8}


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def centralised_batches(fed, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The federation's samples as a central run's batches: ``(x [S, K * B, ...], y [S, K * B])``.

    Step ``s`` takes every client's ``s``-th batch of ``B`` samples (clients in order, no shuffling), so
    ``S = n / B`` steps see all ``K * n`` samples once, like one epoch of a federated round.

    Raises:
      ValueError: clients of unequal size, or ``n`` not a multiple of ``batch_size``.
    """
    counts = np.asarray(fed.counts)
    if counts.min() != counts.max():
        raise ValueError(f"the centralised ceiling needs clients of equal size; these hold {counts.min()} to "
                         f"{counts.max()} samples; fix: use a uniform split (equal fed.counts)")
    n = int(counts[0])
    if batch_size < 1 or n % batch_size:
        raise ValueError(f"the centralised ceiling needs whole batches; {n} samples per client and batch_size "
                         f"{batch_size}; fix: pick a batch_size dividing {n}")
    k, steps = fed.num_clients, n // batch_size
    x = np.asarray(fed.x[:, :n]).reshape((k, steps, batch_size) + tuple(fed.input_shape))
    y = np.asarray(fed.y[:, :n]).reshape(k, steps, batch_size)
    x = np.swapaxes(x, 0, 1).reshape((steps, k * batch_size) + tuple(fed.input_shape))
    y = np.swapaxes(y, 0, 1).reshape(steps, k * batch_size)
    return x, y


def make_centralised_epoch(model, lr: float = 0.01):
    """A jitted ``epoch(params, x [S, M, ...], y [S, M]) -> (params, losses [S])``: ``S`` plain SGD steps
    (``optax.sgd(lr)``) on the mean cross-entropy of ``model``'s logits, one ``lax.scan`` over the batches;
    ``losses[s]`` is the loss of batch ``s`` before its step."""
    import jax
    import optax
    from bfedjax.losses import cross_entropy
    from bfedjax.models.apply import apply_fn_of
    apply_fn = apply_fn_of(model)
    optimiser = optax.sgd(lr)

    def loss(params, x, y):
        return cross_entropy(apply_fn(params, x), y).mean()

    def step(carry, batch):
        params, opt_state = carry
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    @jax.jit
    def epoch(params, x, y):
        (params, _), losses = jax.lax.scan(step, (params, optimiser.init(params)), (x, y))
        return params, losses

    return epoch


def centralised_round_seconds(model, fed, batch_size: int, rounds: int = 3, lr: float = 0.01,
                              seed: int = 0) -> tuple[float, float]:
    """Seconds of the centralised ceiling of a federated round of ``fed``'s ``K`` clients at batch size ``B``.

    One model (``model``, a bfedjax/Flax model, initialised from ``PRNGKey(seed)``) trains on all clients'
    samples (``fed.x [K, n, ...]``, ``fed.y [K, n]``) with ``n / B`` plain SGD steps of ``K * B`` samples
    (``make_centralised_epoch`` on ``centralised_batches``): the same samples and the same number of sequential
    steps as a round of ``K`` clients with batch ``B``, without the clients' copies of the model.

    Returns:
      ``(compile_plus_first_s, best_s)``: the first call (compilation included), and the fastest of ``rounds``
      further calls (each from the same initial parameters).
    """
    import jax
    x, y = centralised_batches(fed, batch_size)
    x, y = jax.device_put(x), jax.device_put(y)
    params = model.init(jax.random.PRNGKey(seed), x[0, :1])["params"]
    epoch = make_centralised_epoch(model, lr)
    first = _best_seconds(lambda: jax.block_until_ready(epoch(params, x, y)), 1)
    return first, _best_seconds(lambda: jax.block_until_ready(epoch(params, x, y)), rounds)


def matmul_peak_flops(n: int | None = None, repeats: int = 10, dtype: str = "float32") -> float:
    """FLOP/s of an n x n matrix product in ``dtype`` (n = 1024 on a CPU, 8192 on an accelerator)."""
    import jax
    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    return 2 * n ** 3 / _best_seconds(lambda: f(a, b).block_until_ready(), repeats)


def memory_bandwidth_bytes_per_s(n_bytes: int | None = None, repeats: int = 10) -> float:
    """Streaming memory bandwidth in bytes/s: a jitted ``x * 1.0001 + 1`` over a float32 array of ``n_bytes``
    (default 64 MiB on a CPU, 1 GiB on an accelerator), which reads and writes ``n_bytes`` each; the fastest
    of ``repeats`` calls after one warm-up call."""
    import jax
    import jax.numpy as jnp
    n_bytes = n_bytes or (64 if jax.default_backend() == "cpu" else 1024) * 2**20
    if n_bytes < BYTES_PER_FLOAT32 or repeats < 1:
        raise ValueError(f"n_bytes={n_bytes}, repeats={repeats}; fix: at least 4 bytes (one float32) and 1 repeat")
    x = jnp.ones(n_bytes // BYTES_PER_FLOAT32, jnp.float32)
    f = jax.jit(lambda x: x * 1.0001 + 1)
    jax.block_until_ready(f(x))
    moved = 2 * x.size * BYTES_PER_FLOAT32  # read + write
    return moved / _best_seconds(lambda: jax.block_until_ready(f(x)), repeats)


def round_traffic_bytes(param_count: int, clients: int, steps_per_client: int, algorithm: str) -> float:
    """Bytes of parameter traffic of a round's local steps (float32; activations and data not counted).

    Per client and local step, parameter-sized float32 arrays streamed through memory:

    * FedAvg, 4: read the parameters, write the updated parameters, write and read the gradient;
    * FOLA, 8: FedAvg's 4, plus reading the prior's center and precision (the prior term
      ``lam / r * prec * (theta - center)``) and reading and writing the Fisher accumulator.

    So ``passes * param_count * 4 bytes * clients * steps_per_client``.
    """
    if algorithm not in PARAM_PASSES_PER_STEP:
        raise ValueError(f"round_traffic_bytes counts {sorted(PARAM_PASSES_PER_STEP)}; got {algorithm!r}; "
                         "fix: pass one of them")
    per_step = PARAM_PASSES_PER_STEP[algorithm] * param_count * BYTES_PER_FLOAT32
    return float(per_step) * clients * steps_per_client


def roofline_seconds(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline bound in seconds: ``max(flops / peak_flops, bytes_moved / bandwidth)`` (FLOP, bytes, FLOP/s,
    bytes/s)."""
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"peak_flops={peak_flops}, bandwidth={bandwidth}; fix: pass positive measured rates")
    return max(flops / peak_flops, bytes_moved / bandwidth)
