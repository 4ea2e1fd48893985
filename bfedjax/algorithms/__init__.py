"""Federated algorithms, each a bundle of pure functions (``core.types.Algorithm``)."""
from bfedjax.algorithms.bfl import bfl
from bfedjax.algorithms.fedavg import fedavg
from bfedjax.algorithms.fedcurv import fedcurv
from bfedjax.algorithms.fedprox import fedprox
from bfedjax.algorithms.fola import FolaConfig, fola
from bfedjax.algorithms.predictive import predict_proba

ALGORITHMS = {"fedavg": fedavg, "fedprox": fedprox, "fedcurv": fedcurv, "fola": fola}

__all__ = ["ALGORITHMS", "FolaConfig", "bfl", "fedavg", "fedcurv", "fedprox", "fola", "predict_proba"]
