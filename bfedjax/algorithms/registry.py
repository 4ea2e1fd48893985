"""One registry of every algorithm, and ``build``: an algorithm from its name and options.

``ALGORITHMS`` maps a name to its factory ``factory(model, **options) -> Algorithm``.
``options_of(name)`` lists the options a factory takes; ``build`` checks them
and fills the ones that come from the federated data (``input_shape``,
``num_clients``, ``client_size``) from ``fed`` when they are not given.
"""
from __future__ import annotations

import dataclasses
import inspect

from bfedjax.algorithms.abavg import abavg
from bfedjax.algorithms.bfl import bfl
from bfedjax.algorithms.fedavg import fedavg, fedsgd
from bfedjax.algorithms.fedcurv import fedcurv
from bfedjax.algorithms.fednova import fednova
from bfedjax.algorithms.fedprox import fedprox
from bfedjax.algorithms.fedref import fedref
from bfedjax.algorithms.fedreg import fedreg
from bfedjax.algorithms.fml import fml
from bfedjax.algorithms.hbfl import hbfl
from bfedjax.algorithms.fola import FolaConfig, fola
from bfedjax.algorithms.scaffold import scaffold
from bfedjax.core.types import Algorithm

ALGORITHMS = {
    "fedavg": fedavg,
    "fedsgd": fedsgd,
    "fedprox": fedprox,
    "fedcurv": fedcurv,
    "fola": fola,
    "bfl": bfl,
    "scaffold": scaffold,
    "fednova": fednova,
    "fedreg": fedreg,
    "fedref": fedref,
    "hbfl": hbfl,
    "fml": fml,
    "abavg": abavg,
}

# Options that come from the federated data when not given: option -> FederatedData -> value.
FROM_DATA = {
    "input_shape": lambda fed: fed.input_shape,
    "num_clients": lambda fed: fed.num_clients,
    "client_size": lambda fed: fed.max_n,
    "total_size": lambda fed: int(fed.counts.sum()),
}

# Factories that take extra keyword options (``**options``) from a config dataclass.
_CONFIG_OPTIONS = {"fola": FolaConfig}


def options_of(name: str) -> tuple[str, ...]:
    """The options ``build(name, model, **options)`` accepts (everything but the model)."""
    factory = _factory(name)
    params = [p for p in inspect.signature(factory).parameters.values()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)][1:]
    extra = [f.name for f in dataclasses.fields(_CONFIG_OPTIONS[name])] if name in _CONFIG_OPTIONS else []
    return tuple(p.name for p in params) + tuple(extra)


def build(name: str, model, fed=None, **options) -> Algorithm:
    """The algorithm ``name`` for ``model`` with ``options`` (keyword arguments of its factory).

    Args:
      name: a key of ``ALGORITHMS``.
      model: the Flax module the clients train.
      fed: optional ``data.FederatedData``; fills ``input_shape`` (bfl, hbfl, fml), ``num_clients``
        (scaffold), ``client_size`` (fedsgd) and ``total_size`` (bfl, the federation's training
        samples) when they are not among ``options``.
      options: the factory's keyword arguments, e.g. ``lr=0.01, lam=1e3`` for FOLA.
    Raises:
      ValueError: for an unknown name or option, naming the valid ones.
    """
    factory = _factory(name)
    valid = options_of(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(unknown)}; its options are {', '.join(valid)}")
    parameters = [p for p in list(inspect.signature(factory).parameters.values())[1:]
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    for option in (p.name for p in parameters if p.default is inspect.Parameter.empty or p.default is None):
        if option not in options and option in FROM_DATA and fed is not None:
            options[option] = FROM_DATA[option](fed)
    missing = [option for option in required if option not in options]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)}; pass them, or the federated data as fed=...")
    return factory(model, **options)


def _factory(name: str):
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "FROM_DATA", "build", "options_of"]
