"""Sharding the client axis over devices.

Everything with a leading client axis (client data, counts, weights,
per-client persistent state) is placed with ``NamedSharding(mesh,
P('clients'))``; the server state is replicated. The jitted round then runs
each device's clients locally and the aggregation's sums over clients become
all-reduces. The federation is padded with empty clients (weight 0, client_mask 0) to a
multiple of the device count (masked out of every cohort), which changes no
result.

Multi-host: call ``jax.distributed.initialize()`` on every host first (see
``experiments/multihost_example.py``); ``client_mesh()`` then spans the
devices of all hosts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bfedjax.core.round_config import EngineState, RoundArrays

AXIS = "clients"


def client_mesh(devices=None) -> Mesh:
    """A 1-D mesh named ``'clients'`` over ``devices`` (default: all devices of all hosts)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (AXIS,))


def padded_client_count(num_clients: int, mesh: Mesh) -> int:
    size = mesh.devices.size
    return -(-num_clients // size) * size


def pad_clients(arrays: RoundArrays, num_clients: int) -> RoundArrays:
    """Appends empty clients (count 0, weight 0, client_mask 0) up to ``num_clients`` rows."""
    extra = num_clients - arrays.counts.shape[0]
    if extra <= 0:
        return arrays
    pad = lambda a: None if a is None else jnp.concatenate([a, jnp.zeros((extra,) + a.shape[1:], a.dtype)])
    return arrays._replace(x=pad(arrays.x), y=pad(arrays.y), counts=pad(arrays.counts),
                           base_weights=pad(arrays.base_weights), client_mask=pad(arrays.client_mask),
                           x_test_clients=pad(arrays.x_test_clients), y_test_clients=pad(arrays.y_test_clients),
                           test_counts=pad(arrays.test_counts), malicious=pad(arrays.malicious))


def shard_arrays(arrays: RoundArrays, mesh: Mesh) -> RoundArrays:
    """Client-axis arrays sharded over ``'clients'``; the test set replicated."""
    by_client = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())
    global_test = ("x_test", "y_test")
    return RoundArrays(**{name: None if a is None else jax.device_put(a, replicated if name in global_test else by_client)
                          for name, a in arrays._asdict().items()})


def shard_state(state: EngineState, mesh: Mesh) -> EngineState:
    """Server state replicated; each architecture group's persistent state ``[N_group, ...]`` sharded over
    ``'clients'`` when ``N_group`` is a multiple of the device count, else replicated."""
    def place(group_state):
        leaves = jax.tree.leaves(group_state)
        divisible = leaves and leaves[0].shape[0] % mesh.devices.size == 0
        return jax.device_put(group_state, NamedSharding(mesh, P(AXIS) if divisible else P()))

    return EngineState(jax.device_put(state.server, NamedSharding(mesh, P())),
                       tuple(place(group_state) for group_state in state.persistent))
