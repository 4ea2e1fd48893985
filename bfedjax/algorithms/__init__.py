"""Federated algorithms, each a bundle of pure functions (``core.types.Algorithm``)."""
from bfedjax.algorithms.bfl import bfl
from bfedjax.algorithms.fedavg import fedavg, sgd
from bfedjax.algorithms.fedcurv import fedcurv
from bfedjax.algorithms.fednova import fednova
from bfedjax.algorithms.fedprox import fedprox
from bfedjax.algorithms.fedreg import fedreg
from bfedjax.algorithms.fola import FolaConfig, fola
from bfedjax.algorithms.predictive import predict_proba
from bfedjax.algorithms.scaffold import scaffold

ALGORITHMS = {"fedavg": fedavg, "fedprox": fedprox, "fedcurv": fedcurv, "fola": fola}

__all__ = ["ALGORITHMS", "FolaConfig", "bfl", "fedavg", "fedcurv", "fednova", "fedprox", "fedreg", "fola",
           "predict_proba", "scaffold", "sgd"]
