"""Core: the algorithm contract, batching, the round engine and the simulation loop (jax only)."""
from bfedjax.core import attacks, compile_cache, layout, sharding
from bfedjax.core.attacks import ATTACKS, Attack
from bfedjax.core.client_half import local_training
from bfedjax.core.sampling import Cohort, sample_cohort
from bfedjax.core.engine import BACKENDS, make_round_step, replicated_on, with_own_buffers
from bfedjax.core.reference_backends import StageError
from bfedjax.core.round_config import EngineState, RoundArrays, RoundConfig, init_state, with_fixed_local_steps
from bfedjax.core.schedules import SCHEDULES, lr_schedule
from bfedjax.core.simulate import (CLIENT_WEIGHTINGS, NonFiniteClientError, SimulationResult, cohort_size,
                                   patience_reached, pretrain, round_arrays, simulate, traced_hparams,
                                   with_client_devices)
from bfedjax.core.types import Algorithm, Batch, ClientContext, ClientData

__all__ = ["attacks", "compile_cache", "layout", "sharding", "ATTACKS", "BACKENDS", "CLIENT_WEIGHTINGS", "Algorithm",
           "Attack", "Batch", "ClientContext", "ClientData", "Cohort", "EngineState", "NonFiniteClientError", "RoundArrays", "RoundConfig",
           "SCHEDULES", "SimulationResult", "StageError", "cohort_size",
           "init_state", "local_training", "lr_schedule", "make_round_step", "patience_reached", "pretrain",
           "replicated_on", "round_arrays", "sample_cohort", "simulate", "traced_hparams", "with_client_devices",
           "with_fixed_local_steps", "with_own_buffers"]
