"""Core: types, batching, the round engine and the simulation loop."""
from bfedjax.core.engine import (BACKENDS, EngineState, RoundArrays, RoundConfig, apply_fn_of, init_state,
                                 local_training, make_round_step)
from bfedjax.core.schedules import SCHEDULES, lr_schedule
from bfedjax.core.simulate import (SimulationResult, cohort_size, patience_reached, pretrain, round_arrays,
                                   simulate, traced_hparams)
from bfedjax.core.types import Algorithm, Batch, ClientContext, ClientData

__all__ = ["BACKENDS", "Algorithm", "Batch", "ClientContext", "ClientData", "EngineState", "RoundArrays",
           "RoundConfig", "SCHEDULES", "SimulationResult", "lr_schedule", "apply_fn_of", "cohort_size", "patience_reached", "pretrain", "init_state", "local_training", "make_round_step",
           "round_arrays", "simulate", "traced_hparams"]
