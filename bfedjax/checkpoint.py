"""Round checkpoints with orbax: the engine state and the metrics so far.

A run that crashes resumes from its last saved round with the same result it
would have had (round keys are derived from the run key and the round index).
A damaged newest checkpoint (overwritten or truncated files, a step folder
without orbax's commit marker) is set aside and the run resumes from the
newest good one, with one warning line.
"""
from __future__ import annotations

import os
import shutil

import jax
from absl import logging

from bfedjax.optional import require

ocp = require("orbax.checkpoint")

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, just before renaming the step folder into place


class RoundCheckpointer:
    """Saves ``(state, history)`` after a round; restores the newest readable one."""

    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True))

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def save(self, round_index: int, state, history: list[dict]) -> None:
        self._manager.save(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), history=ocp.args.JsonSave({"rounds": history})))
        self._manager.wait_until_finished()

    def restore(self, round_index: int, like_state):
        """Returns ``(state, history)`` saved at ``round_index``; ``like_state`` gives structure and dtypes.

        Raises whatever orbax or json raise for a damaged or mismatched checkpoint, or ``ValueError``
        for a step folder without orbax's commit marker or whose history does not hold rounds 1..round.
        """
        if not os.path.exists(os.path.join(self.directory, str(round_index), COMMIT_MARKER)):
            raise ValueError(f"half-written: no {COMMIT_MARKER}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        out = self._manager.restore(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
        history = list(out["history"]["rounds"])
        if [h.get("round") for h in history[:round_index]] != list(range(1, round_index + 1)):
            raise ValueError(f"its history holds rounds {[h.get('round') for h in history]}, not 1..{round_index}")
        return out["state"], history[:round_index]

    def restore_latest(self, like_state, owner: str = "the algorithm"):
        """Restores the newest checkpoint that can be read into ``like_state``'s structure.

        Returns ``(round, state, history)``, or ``None`` when the folder holds no checkpoint. Newer
        checkpoints that cannot be restored are renamed ``<round>.damaged`` (orbax ignores them and
        saves those rounds afresh) and one warning line says so. With none restorable it raises a
        one-line ``ValueError``: "does not match ``owner``'s state" when every checkpoint reads
        fine on its own (written by another algorithm or setting), else "no readable checkpoint".
        """
        skipped = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, history = self.restore(step, like_state)
            except Exception as err:  # orbax, tensorstore and json raise many types for damaged files
                skipped.append((step, err))
                continue
            if skipped:
                self._set_aside(skipped, step)
            return step, state, history
        if not skipped:
            return None
        newest, err = skipped[0]
        mismatch = all(self._readable(step) for step, _ in skipped)
        self.close()  # the caller gets an exception, not a checkpointer to close
        if mismatch:
            raise ValueError(f"the checkpoint in {self.directory} (round {newest}) does not match {owner}'s state: "
                             "it was written by another algorithm, setting or bfedjax version; fix: start over "
                             "(--noresume / a new directory)") from err
        raise ValueError(f"no readable checkpoint in {self.directory} (newest: round {newest}, damaged: "
                         f"{_one_line(err)}); fix: start over with --noresume or a new --output_dir "
                         "(simulate: a new checkpoint_dir)") from err

    def _readable(self, step: int) -> bool:
        """Whether the checkpoint at ``step`` restores in its own saved structure (its files are intact)."""
        try:
            self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(), history=ocp.args.JsonRestore()))
            return os.path.exists(os.path.join(self.directory, str(step), COMMIT_MARKER))
        except Exception:  # noqa: BLE001 - any failure means the files cannot be read
            return False

    def _set_aside(self, skipped: list, good: int) -> None:
        """Renames the skipped step folders ``<round>.damaged`` and logs one line about it."""
        for step, _ in skipped:
            target = os.path.join(self.directory, f"{step}.damaged")
            shutil.rmtree(target, ignore_errors=True)
            os.rename(os.path.join(self.directory, str(step)), target)
        self._manager.reload()
        several = len(skipped) > 1
        logging.warning("checkpoint round%s %s in %s %s damaged (%s); resuming from round %d (set aside as %s)",
                        "s" if several else "", ", ".join(str(step) for step, _ in skipped), self.directory,
                        "are" if several else "is", "; ".join(f"round {step}: {_one_line(err)}" if several
                                                             else _one_line(err) for step, err in skipped),
                        good, ", ".join(f"{step}.damaged" for step, _ in skipped))

    def close(self) -> None:
        self._manager.close()


def _one_line(err: Exception, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (orbax's messages run to pages)."""
    text = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    return text if len(text) <= limit else text[:limit - 3] + "..."
