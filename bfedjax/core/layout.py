"""The round's layout when the user does not name one: how many clients train at once.

``simulate(..., clients_per_chunk="auto")`` (the default) asks ``auto_clients_per_chunk``,
which decides from the platform, the model's parameters and the cohort, before anything
is traced:

* **CPU, a model with convolutions**: 1, the cohort's clients one after another
  inside the jitted round. Under a client vmap every convolution becomes a grouped
  convolution, which XLA:CPU runs 3-6x slower than its plain NHWC kernels
  (``python -m experiments.bench``: FedReg's CNN, ``vmap`` against ``vmap/c1``).
* **CPU, dense models**: chunks whose training state (per client about
  ``STATE_COPIES`` copies of the server state: weights, gradient, optimiser or Fisher
  state and message, plus the client's persistent state) fits in ``CHUNK_STATE_BYTES``
  or the last-level cache if smaller, with the chunk size that pads the cohort least.
  One vmap over 100 MLP clients streams 80 MB of weights per step from memory. On a
  2-core VM that reports its host's 480 MiB L3 (most of it other tenants'), chunks of
  about 32 MiB of state (784-200-200-10 MLP: 10 FedAvg or 5 FOLA clients) were within
  8% of the fastest chunk size at K = 100, B = 10 and 50, and 1.3-1.6x faster than one
  vmap (``python -m experiments.bench --only="mlp K=100" --cpu_chunks=4,5,7,8,10``); a
  quarter of the reported cache (chunks of 39 and 19) was 1.1-1.6x slower than the fastest.
* **GPU/TPU**: one vmap over the whole cohort (the padded work runs in
  parallel), or chunks when ``STATE_COPIES`` copies of every client's state would
  not fit in ``MEMORY_SHARE`` of the device's memory.

Only the float rounding of the result depends on the layout (the engine sorts the
cohort by size and masks the padding either way), so a run can be resumed under
another layout. ``experiments.bench`` times the choice as its ``default`` rows
against every variant.
"""
from __future__ import annotations

import functools
import os

import jax
import numpy as np

AUTO = "auto"
# Per-client working set: about this many copies of the server state (weights, gradient,
# optimiser or Fisher state, message) plus the client's persistent state.
STATE_COPIES = 4
# CPU: a chunk's working set within this many bytes, or the last-level cache if smaller. Not a share of
# the cache alone: a VM reports its host socket's whole cache, which its few cores share with others.
CHUNK_STATE_BYTES = 32 * 2**20
MEMORY_SHARE = 0.25     # accelerators: chunk only when the cohort's state exceeds this share of memory
DEFAULT_CACHE_BYTES = 8 * 2**20


def auto_clients_per_chunk(*, convolutional: bool, server_bytes: int, persistent_bytes_per_client: float,
                           cohort: int, platform: str, device_memory_bytes: int | None = None,
                           cache_bytes: int | None = None) -> int | None:
    """Clients per chunk for a round (``None``: the whole cohort in one vmap).

    Args:
      convolutional: whether a client trains a convolutional model (``has_conv_kernels``).
      server_bytes: bytes of the server state every client reads (the global model, and e.g. FOLA's
        precision or a variational model's scales).
      persistent_bytes_per_client: bytes of one client's persistent state (0 for most algorithms).
      cohort: K, clients per round.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      device_memory_bytes: the accelerator's memory (``None``: unknown, never chunk).
      cache_bytes: the CPU's last-level cache (``None``: read from the OS, else 8 MiB).
    """
    client_bytes = STATE_COPIES * server_bytes + persistent_bytes_per_client
    if platform == "cpu":
        if convolutional:
            return 1
        budget = min(CHUNK_STATE_BYTES, cache_bytes or last_level_cache_bytes())
        chunk = least_padding_chunk(cohort, int(min(cohort, max(1, budget // client_bytes))))
        return None if chunk >= cohort else chunk  # the whole cohort fits: one vmap
    if device_memory_bytes is None or cohort * client_bytes <= MEMORY_SHARE * device_memory_bytes:
        return None
    return least_padding_chunk(cohort, int(max(1, MEMORY_SHARE * device_memory_bytes // client_bytes)))


def least_padding_chunk(cohort: int, largest: int) -> int:
    """The chunk size in ``[ceil(largest / 2), largest]`` whose chunks pad the cohort least (the larger on
    a tie): 100 clients and room for 7 give chunks of 5 (100 slots), not of 7 (105 slots, the last chunk
    mostly padding that still computes)."""
    candidates = range(max(1, -(-largest // 2)), largest + 1)
    return min(candidates, key=lambda c: (-(-cohort // c) * c, -c))


def has_conv_kernels(params, persistent=()) -> bool:
    """Whether the model is convolutional: a ``*kernel*`` leaf of 4 dimensions (``[H, W, I, O]``) in the
    global parameters, or of 5 (``[N_group, H, W, I, O]``) in the clients' persistent state (the
    local models of architecture groups)."""
    def found(tree, ndim):
        return any(leaf.ndim >= ndim and "kernel" in str(getattr(path[-1], "key", path[-1]))
                   for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if path)
    return found(params, 4) or found(persistent, 5)


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (``/sys/devices/system/cpu/cpu0/cache``), else 8 MiB."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    for entry in os.listdir(root) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip().upper()
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
        except (OSError, ValueError):  # not a cache entry (e.g. uevent)
            continue
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def device_memory_bytes(device) -> int | None:
    """The device's memory limit from ``memory_stats()`` (``None`` on a CPU or when unreported)."""
    try:
        stats = device.memory_stats() or {}
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return stats.get("bytes_limit")


def tree_bytes(tree) -> int:
    return int(sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))
