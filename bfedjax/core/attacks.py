"""Simulated malicious clients: which clients attack, and what they send.

``Attack(kind, fraction, ...)`` makes ``round(fraction * N)`` clients malicious
for the whole run (a seeded choice, nested: the 10% are among the 20%). Each
round a malicious client trains as usual and then replaces its update
``u = theta_c - theta_g`` (its ``message["params"]`` minus the global model):

* ``"sign_flip"``: sends ``theta_g - scale * u`` (the update reversed, scale 1 by default);
* ``"scale"``: sends ``theta_g + scale * u`` (a boosted update, scale 10 by default);
* ``"noise"``: sends ``theta_g + noise_std * eps``, ``eps ~ N(0, I)`` (no training signal at all);
* ``"label_flip"``: trains on labels ``K - 1 - y`` and sends its model honestly;
* ``"nan"``: sends NaN (a client whose training diverged): a fault rather than an attack, which
  the engine leaves out of the aggregation (``nonfinite_clients``).

The engine applies it inside the jitted round, before the non-finite check and
the aggregation (``RoundConfig.attack``); posterior methods keep the honest
precision next to the attacked mean.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bfedjax import flat_random

ATTACKS = ("sign_flip", "scale", "noise", "label_flip", "nan")
ATTACK_KEY_STREAM = 0xA77A  # the noise attack's key: fold_in(client key, this)
DEFAULT_SCALE = {"sign_flip": 1.0, "scale": 10.0}


@dataclasses.dataclass(frozen=True)
class Attack:
    """A fraction of malicious clients and what they do (static: changing it recompiles).

    kind: one of ``ATTACKS``.
    fraction: share of the federation's clients that attack, in ``[0, 1]``.
    seed: which clients (``malicious_clients``).
    scale: the update's factor for ``sign_flip`` (default 1) and ``scale`` (default 10).
    noise_std: the standard deviation of the ``noise`` update (default 1).
    """

    kind: str
    fraction: float
    seed: int = 0
    scale: float | None = None
    noise_std: float = 1.0

    def __post_init__(self):
        if self.kind not in ATTACKS:
            raise ValueError(f"attack {self.kind!r}; choose one of {', '.join(ATTACKS)}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"attack fraction={self.fraction} must be in [0, 1], e.g. 0.2")
        if self.noise_std <= 0:
            raise ValueError(f"attack noise_std={self.noise_std} must be > 0")
        if self.scale is None:
            object.__setattr__(self, "scale", DEFAULT_SCALE.get(self.kind, 1.0))

    def malicious(self, num_clients: int) -> np.ndarray:
        """``[N]`` bool: the malicious clients (``malicious_clients``)."""
        return malicious_clients(num_clients, self.fraction, self.seed)


def malicious_clients(num_clients: int, fraction: float, seed: int = 0) -> np.ndarray:
    """``[N]`` bool: the first ``round(fraction * N)`` clients of a seeded permutation of ``0..N-1``
    (so a larger fraction at the same seed keeps the smaller one's attackers)."""
    order = np.random.default_rng(seed).permutation(num_clients)
    out = np.zeros(num_clients, bool)
    out[order[:int(round(fraction * num_clients))]] = True
    return out


def flip_labels(y: jax.Array, malicious: jax.Array, num_classes: int) -> jax.Array:
    """``y [N, max_n]`` with every malicious client's labels mapped to ``K - 1 - y``."""
    flipped = (num_classes - 1 - y).astype(y.dtype)
    return jnp.where(jnp.reshape(malicious, (-1,) + (1,) * (y.ndim - 1)), flipped, y)


def attacked_messages(attack: Attack, messages, global_params, malicious: jax.Array, keys: jax.Array):
    """``messages`` (leaves ``[C, ...]``) with the malicious slots' ``params`` replaced as ``attack`` says.

    ``global_params``: the round's global model (leaves ``[...]``); ``malicious``: ``[C]`` bool;
    ``keys``: ``[C]`` client keys (the noise draw). ``label_flip`` leaves the messages alone.
    """
    if attack.kind == "label_flip":
        return messages
    if not isinstance(messages, dict) or "params" not in messages:
        raise ValueError("attack simulation changes the clients' message['params']; this algorithm sends no "
                         "'params'; fix: attack='label_flip', or an algorithm that sends its model")
    shape = lambda x: jnp.reshape(malicious, (-1,) + (1,) * (x.ndim - 1))

    def leaf(m, g, k):
        u = m - g[None]
        if attack.kind == "sign_flip":
            bad = g[None] - attack.scale * u
        elif attack.kind == "scale":
            bad = g[None] + attack.scale * u
        elif attack.kind == "nan":
            bad = jnp.full_like(m, jnp.nan)
        else:
            noise = jax.vmap(lambda key: flat_random.normal(key, g.shape, m.dtype))(k)
            bad = g[None] + attack.noise_std * noise
        return jnp.where(shape(m), bad, m)

    leaves, treedef = jax.tree.flatten(messages["params"])
    g_leaves = treedef.flatten_up_to(global_params)
    streams = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, ATTACK_KEY_STREAM), len(leaves)))(keys)
    new = [leaf(m, g, streams[:, i]) for i, (m, g) in enumerate(zip(leaves, g_leaves))]
    return {**messages, "params": treedef.unflatten(new)}


__all__ = ["ATTACKS", "Attack", "attacked_messages", "flip_labels", "malicious_clients"]
