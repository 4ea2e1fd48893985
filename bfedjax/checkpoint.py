"""Round checkpoints with orbax: the engine state and the metrics so far.

A run that crashes resumes from its last saved round with the same result it
would have had (round keys are derived from the run key and the round index).
"""
from __future__ import annotations

import os

import jax

from bfedjax.optional import require

ocp = require("orbax.checkpoint")


class RoundCheckpointer:
    """Saves ``(state, history)`` after a round; restores the latest one."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def save(self, round_index: int, state, history: list[dict]) -> None:
        self._manager.save(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), history=ocp.args.JsonSave({"rounds": history})))
        self._manager.wait_until_finished()

    def restore(self, round_index: int, like_state):
        """Returns ``(state, history)`` saved at ``round_index``; ``like_state`` gives structure and dtypes."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        out = self._manager.restore(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
        return out["state"], list(out["history"]["rounds"])

    def close(self) -> None:
        self._manager.close()
