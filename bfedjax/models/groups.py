"""Client architectures: which model each client trains (HBFL's model heterogeneity).

``client_architectures("mlp:2,lenet:2,cnn1:3,cnn2:3", 10, num_classes=10)``
gives the distinct models in order of first mention and each client's group
index, the ``client_groups`` the engine takes: clients 0-1 MLP, 2-3 LeNet-5,
4-6 CNN1, 7-9 CNN2 (HBFL spec Decision 12), or a seeded random permutation.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from bfedjax.models.zoo import MODELS, get_model


def parse_architectures(spec: str) -> list[tuple[str, int]]:
    """``"mlp:2,cnn2:3"`` -> ``[("mlp", 2), ("cnn2", 3)]`` (a name without a count means 1)."""
    out = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        name = name.strip().lower()
        if name not in MODELS:
            raise ValueError(f"unknown architecture {name!r} in {spec!r}; choose from {sorted(MODELS)}")
        if count and (not count.strip().isdigit() or int(count) < 1):
            raise ValueError(f"bad client count {count!r} for {name} in {spec!r}; write name:count, e.g. cnn2:3")
        out.append((name, int(count) if count else 1))
    if not out:
        raise ValueError(f"no architecture in {spec!r}; write e.g. mlp:2,lenet:2,cnn1:3,cnn2:3")
    return out


def client_architectures(spec: str, num_clients: int, *, num_classes: int, hidden: Sequence[int] | None = None,
                         shuffle_seed: int | None = None, compute_dtype="float32"):
    """``(models, client_groups)`` for the mapping ``spec``.

    Args:
      spec: ``"name:count,..."`` with counts summing to ``num_clients``; a name may appear once.
      num_clients: N.
      num_classes: the models' outputs.
      hidden: MLP widths (default (200, 200)).
      shuffle_seed: ``None`` assigns the clients in order; a seed permutes the assignment.
      compute_dtype: every model's compute dtype (``zoo.get_model``; parameters stay float32).
    Returns:
      ``(tuple of Flax modules, [N] int32 group of each client)``.
    """
    parsed = parse_architectures(spec)
    names = [name for name, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"{spec!r} names an architecture twice; give each once with its count")
    total = sum(count for _, count in parsed)
    if total != num_clients:
        raise ValueError(f"{spec!r} assigns {total} clients but there are {num_clients}; fix: make the counts "
                         f"sum to --num_clients")
    groups = np.concatenate([np.full(count, g, np.int32) for g, (_, count) in enumerate(parsed)])
    if shuffle_seed is not None:
        groups = np.random.default_rng(shuffle_seed).permutation(groups)
    models = tuple(get_model(name, num_classes, hidden=hidden, compute_dtype=compute_dtype) for name in names)
    return models, groups


__all__ = ["client_architectures", "parse_architectures"]
