"""What the bfedjax strategy and ClientApp say to each other: record names and config fields.

Registration (``query`` message, once per run):
  server -> node: ``CONFIG`` {``init-key``: the run's round-0 key} and, for an algorithm with
    persistent client state, ``INIT``: the initial global parameters (named arrays).
  node -> server: ``NODE`` {``client-id``: the node's client (partition) id n in ``[0, N)``,
    ``num-examples``: its sample count m_n, ``group``: its architecture group}.
Training (``train`` message, every round, to the cohort's nodes):
  server -> node: ``SERVER``: the server state (named arrays); ``CONFIG`` {``round``,
    ``hparam.<name>`` for each traced hyper-parameter, ``client-id``, ``client-key``: the
    client's round key (the engine's ``Cohort.keys`` row), ``step-budget``}.
  node -> server: ``MESSAGE``: the algorithm's client message (named arrays); ``METRICS``
    {the algorithm's client metrics, ``client-id``, ``num-examples``}.
A node keeps an algorithm's persistent client state in its ``Context.state[PERSISTENT]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SERVER = "bfedjax.server"
CONFIG = "bfedjax.config"
INIT = "bfedjax.init"
NODE = "bfedjax.node"
MESSAGE = "bfedjax.message"
METRICS = "bfedjax.metrics"
PERSISTENT = "bfedjax.persistent"

CLIENT_ID = "client-id"
NUM_EXAMPLES = "num-examples"
GROUP = "group"
ROUND = "round"
CLIENT_KEY = "client-key"
INIT_KEY = "init-key"
STEP_BUDGET = "step-budget"
HPARAM_PREFIX = "hparam."
NODE_FIELDS = (CLIENT_ID, NUM_EXAMPLES, GROUP)
REPLY_FIELDS = (CLIENT_ID, NUM_EXAMPLES)


def key_to_config(key: jax.Array) -> list[int]:
    """A raw PRNG key (``uint32 [2]`` for threefry) as a list of ints for a ``ConfigRecord``."""
    return [int(v) for v in np.asarray(key, np.uint32).ravel()]


def key_from_config(values) -> jax.Array:
    """The raw PRNG key from ``key_to_config``'s list; raises ``ValueError`` if it does not fit this JAX's keys."""
    shape = jax.random.PRNGKey(0).shape
    if not isinstance(values, list) or len(values) != int(np.prod(shape)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 32 for v in values):
        raise ValueError(f"a PRNG key must be {int(np.prod(shape))} uint32 values, got {values!r}")
    return jnp.asarray(np.asarray(values, np.uint32).reshape(shape))


def hparams_to_config(hparams: dict) -> dict:
    """``traced_hparams``'s dict as ``ConfigRecord`` fields: ``round`` (int), ``hparam.<name>`` (float)."""
    out = {ROUND: int(hparams["round"])}
    out.update({HPARAM_PREFIX + name: float(value) for name, value in hparams.items() if name != "round"})
    return out


def hparams_from_config(config) -> tuple[int, dict]:
    """``(round, {name: value})`` read back from ``hparams_to_config``'s fields."""
    overrides = {name[len(HPARAM_PREFIX):]: float(value) for name, value in config.items()
                 if name.startswith(HPARAM_PREFIX)}
    return int(config[ROUND]), overrides


def is_int(value) -> bool:
    """A plain integer (``bool`` is not one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


__all__ = ["CLIENT_ID", "CLIENT_KEY", "CONFIG", "GROUP", "HPARAM_PREFIX", "INIT", "INIT_KEY", "MESSAGE", "METRICS",
           "NODE", "NODE_FIELDS", "NUM_EXAMPLES", "PERSISTENT", "REPLY_FIELDS", "ROUND", "SERVER", "STEP_BUDGET",
           "hparams_from_config", "hparams_to_config", "is_int", "key_from_config", "key_to_config"]
