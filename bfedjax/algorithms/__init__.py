"""Federated algorithms, each a bundle of pure functions (``core.types.Algorithm``), and their registry."""
from bfedjax.algorithms.bfl import bfl
from bfedjax.algorithms.fedavg import fedavg, fedsgd
from bfedjax.algorithms.fedcurv import fedcurv
from bfedjax.algorithms.fednova import fednova
from bfedjax.algorithms.fedprox import fedprox
from bfedjax.algorithms.fedreg import fedreg
from bfedjax.algorithms.fola import FolaConfig, fola
from bfedjax.algorithms.registry import ALGORITHMS, build, options_of
from bfedjax.algorithms.scaffold import scaffold

__all__ = ["ALGORITHMS", "FolaConfig", "bfl", "build", "fedavg", "fedcurv", "fednova", "fedprox", "fedreg",
           "fedsgd", "fola", "options_of", "scaffold"]
