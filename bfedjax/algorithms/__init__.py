"""Federated algorithms, each a bundle of pure functions (``core.types.Algorithm``), and their registry."""
from bfedjax.algorithms.abavg import abavg
from bfedjax.algorithms.bfl import bfl
from bfedjax.algorithms.fedavg import fedavg, fedsgd
from bfedjax.algorithms.fedcurv import fedcurv
from bfedjax.algorithms.fednova import fednova
from bfedjax.algorithms.fedprox import fedprox
from bfedjax.algorithms.fedref import fedref, with_reference_model
from bfedjax.algorithms.fedreg import fedreg
from bfedjax.algorithms.fml import fml
from bfedjax.algorithms.hbfl import hbfl
from bfedjax.algorithms.private_models import PrivateModels
from bfedjax.algorithms.fola import FolaConfig, fola, reference_posterior
from bfedjax.algorithms.posterior_analysis import with_aggregation_sweep, with_posterior_distance
from bfedjax.algorithms.precision_similarity import with_precision_similarity
from bfedjax.algorithms.registry import ALGORITHMS, build, options_of
from bfedjax.algorithms.robust import ROBUST_RULES, with_robust_aggregation
from bfedjax.algorithms.scaffold import scaffold
from bfedjax.algorithms.server_opt import SERVER_OPTIMIZERS, server_optimizer, with_server_optimizer

__all__ = ["ALGORITHMS", "FolaConfig", "PrivateModels", "ROBUST_RULES", "SERVER_OPTIMIZERS", "abavg", "bfl", "build",
           "fedavg", "fedcurv", "fednova", "fedprox", "fedref", "fedreg", "fedsgd", "fml", "fola", "hbfl", "options_of",
           "reference_posterior", "scaffold", "server_optimizer", "with_aggregation_sweep", "with_posterior_distance",
           "with_precision_similarity", "with_reference_model", "with_robust_aggregation", "with_server_optimizer"]
