"""Round checkpoints with orbax: the engine state and the metrics so far.

A run that crashes resumes from its last saved round with the same result it
would have had (round keys are derived from the run key and the round index).
A damaged newest checkpoint (overwritten or truncated files, a step folder
without orbax's commit marker, arrays whose bytes no longer match the checksum
saved with them) is set aside and the run resumes from the newest good one,
with one warning line. A checkpoint saved with another run identity (another
seed, data split, model or setting: ``run_identity``) is not resumed: one
line names what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import numpy as np
from absl import logging

from bfedjax.optional import require

ocp = require("orbax.checkpoint")

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, just before renaming the step folder into place


class DifferentRunError(ValueError):
    """The checkpoint folder holds a run of another identity (``RoundCheckpointer(run_identity=...)``)."""


def tree_digest(tree, max_values: int | None = None) -> str | None:
    """A hex blake2b checksum of a pytree of arrays: every leaf's dtype, shape and values, in leaf order.

    ``max_values``: hash at most about this many values a leaf, strided over its flattened values by a prime
    (a large data set's fingerprint, not a checksum; a prime stride walks over every position of an image
    rather than a few columns). ``None`` when a leaf is split over several hosts (this process cannot read all
    of it).
    """
    leaves = []
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            if not leaf.is_fully_addressable:
                return None
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
        if max_values is not None and np.size(leaf) > max_values:
            leaf = (leaf.shape, leaf.ravel()[::_prime_at_least(-(-np.size(leaf) // max_values))])
        leaves.append(leaf)
    digest = hashlib.blake2b(digest_size=16)
    for leaf in jax.device_get(leaves):
        shape, values = leaf if isinstance(leaf, tuple) else (np.shape(leaf), leaf)
        values = np.ascontiguousarray(values)
        digest.update(f"{values.dtype}{tuple(shape)}".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


class RoundCheckpointer:
    """Saves ``(state, history)`` after a round; restores the newest readable one.

    ``run_identity``: a JSON-able dict that names the run (``simulate`` passes its algorithm, hyper-parameters,
    key, data fingerprint and initial state's checksum, plus the caller's ``checkpoint_identity``), saved with
    every round; restoring a checkpoint saved with another identity raises ``DifferentRunError``. Each save
    also stores the state's checksum (``tree_digest``), which a restore checks.
    """

    def __init__(self, directory: str, max_to_keep: int = 3, run_identity: dict | None = None):
        self.directory = os.path.abspath(directory)
        self.run_identity = None if run_identity is None else json.loads(json.dumps(run_identity, default=_plain))
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True))

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def save(self, round_index: int, state, history: list[dict]) -> None:
        self._manager.save(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(
                {"rounds": history, "state_digest": tree_digest(state), "run": self.run_identity})))
        self._manager.wait_until_finished()

    def restore(self, round_index: int, like_state):
        """Returns ``(state, history)`` saved at ``round_index``; ``like_state`` gives structure and dtypes.

        Raises whatever orbax or json raise for a damaged or mismatched checkpoint, ``ValueError`` for a step
        folder without orbax's commit marker, whose history does not hold rounds 1..round or whose arrays
        differ from their saved checksum, and ``DifferentRunError`` for one saved with another run identity.
        """
        if not os.path.exists(os.path.join(self.directory, str(round_index), COMMIT_MARKER)):
            raise ValueError(f"half-written: no {COMMIT_MARKER}")
        # the identity first: another run's arrays may not even fit like_state (another model or client count)
        saved = self._manager.restore(round_index, args=ocp.args.Composite(history=ocp.args.JsonRestore()))["history"]
        self._check_identity(round_index, saved.get("run"))
        history = list(saved["rounds"])
        if [h.get("round") for h in history[:round_index]] != list(range(1, round_index + 1)):
            raise ValueError(f"its history holds rounds {[h.get('round') for h in history]}, not 1..{round_index}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        state = self._manager.restore(round_index, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
        saved_digest, digest = saved.get("state_digest"), tree_digest(state)
        if None not in (saved_digest, digest) and digest != saved_digest:  # older checkpoints, several hosts: none
            raise ValueError("its arrays differ from the checksum saved with them (overwritten bytes)")
        return state, history[:round_index]

    def _check_identity(self, round_index: int, saved: dict | None) -> None:
        """Raises ``DifferentRunError`` naming up to four differing entries, the caller's settings first
        (checkpoints from before run identities were saved, or a checkpointer without one, are not compared)."""
        if saved is None or self.run_identity is None or saved == self.run_identity:
            return
        ours, theirs = _flat(self.run_identity), _flat(saved)
        shown = {}  # by innermost name: a flag and the hyper-parameter it sets are one difference
        # entries on one side only (a flag added or removed by another bfedjax version) are not compared
        for path in sorted(ours.keys() & theirs.keys(), key=lambda p: (not p.startswith("settings."), p)):
            if ours[path] != theirs[path]:
                shown.setdefault(path.rsplit(".", 1)[-1], (ours[path], theirs[path]))
        names = list(shown)
        if not names:
            return
        listed = ", ".join(f"{name} (another checksum)" if all(map(_is_digest, shown[name])) else
                           f"{name} {_short(shown[name][0])} (saved: {_short(shown[name][1])})" for name in names[:4])
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        raise DifferentRunError(f"the checkpoint in {self.directory} (round {round_index}) was saved by another run, "
                                f"which differs in {listed}{more}; fix: a new --output_dir (simulate: a new "
                                "checkpoint_dir), or start over with --noresume")

    def restore_latest(self, like_state, owner: str = "the algorithm"):
        """Restores the newest checkpoint that can be read into ``like_state``'s structure.

        Returns ``(round, state, history)``, or ``None`` when the folder holds no checkpoint. Newer
        checkpoints that cannot be restored are renamed ``<round>.damaged`` (orbax ignores them and
        saves those rounds afresh) and one warning line says so. With none restorable it raises a
        one-line ``ValueError``: "does not match ``owner``'s state" when every checkpoint reads
        fine on its own (written by another algorithm or setting), else "no readable checkpoint". A
        checkpoint saved with another run identity raises ``DifferentRunError`` at once (nothing set aside).
        """
        skipped = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, history = self.restore(step, like_state)
            except DifferentRunError:
                self.close()  # another run's folder: nothing is set aside
                raise
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


def _flat(identity: dict, prefix: str = "") -> dict:
    """``{"settings": {"flags": {"lr": 0.1}}}`` -> ``{"settings.flags.lr": 0.1}``."""
    flat = {}
    for name, value in identity.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[prefix + name] = value
    return flat


def _prime_at_least(n: int) -> int:
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def _plain(value):
    """JSON for what ``json`` does not take: numpy scalars and arrays as numbers and lists, anything else as its
    ``repr``."""
    return value.tolist() if isinstance(value, (np.ndarray, np.generic, jax.Array)) else repr(value)


def _short(value, limit: int = 40) -> str:
    text = "unset" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)
