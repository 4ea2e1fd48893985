"""The pytree structures both ends derive from the algorithm (never from what they receive).

Every function returns ``jax.ShapeDtypeStruct`` pytrees from ``jax.eval_shape``
(nothing is computed): the server checks replies against them, a client reads
the server state with them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bfedjax.core.client_half import local_training
from bfedjax.core.sampling import NO_BUDGET
from bfedjax.core.simulate import traced_hparams
from bfedjax.core.types import Algorithm, ClientContext, ClientData


def params_spec(algorithm: Algorithm, input_shape: tuple[int, ...]):
    """The global model's parameters for inputs of one example's shape ``input_shape``."""
    if algorithm.init_params is None:
        raise ValueError(f"{algorithm.name} has no init_params hook; fix: give the Algorithm init_params=... "
                         "(e.g. **bf.tasks.classification(model).hooks()) or pass the parameters' shapes")
    return jax.eval_shape(lambda key: algorithm.init_params(key, tuple(input_shape)), jax.random.PRNGKey(0))


def server_spec(algorithm: Algorithm, params):
    """The server state ``server_init(params)`` (``params``: arrays or their specs)."""
    return jax.eval_shape(algorithm.server_init, params)


def persistent_spec(algorithm: Algorithm, params, group: int):
    """One client's persistent state in architecture ``group`` (``()`` without ``persistent_init``)."""
    if algorithm.persistent_init is None:
        return ()
    return jax.eval_shape(lambda p, k: algorithm.persistent_init(p, k, group), params, jax.random.PRNGKey(0))


def reply_spec(algorithm: Algorithm, server, params, x_example, y_example, group: int = 0):
    """``(message, metrics)``: what ``client_final`` returns for one client of ``group``.

    ``x_example [n, ...]`` / ``y_example [n, ...]``: rows shaped like a client's data (only
    shapes and dtypes are read); ``metrics`` is ``{name: scalar spec}``.
    """
    data = ClientData(jax.ShapeDtypeStruct(x_example.shape, x_example.dtype),
                      jax.ShapeDtypeStruct(y_example.shape, y_example.dtype), jax.ShapeDtypeStruct((), jnp.int32))
    hparams = traced_hparams(algorithm, 1)
    persistent = persistent_spec(algorithm, params, group)
    train = functools.partial(_outputs, algorithm, group)
    message, _, metrics = jax.eval_shape(train, server, persistent, data, hparams, jax.random.PRNGKey(0))
    return message, metrics


def _outputs(algorithm, group, server, persistent, data, hparams, key):
    ctx = ClientContext(server, persistent, data, hparams, group, None)
    return local_training(algorithm, ctx, key, NO_BUDGET)


__all__ = ["params_spec", "persistent_spec", "reply_spec", "server_spec"]
