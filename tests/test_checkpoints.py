"""Checkpoints: damaged ones are skipped, SIGKILL and resume, and bitwise determinism for a seed.

FOLA's determinism across a resume is pinned in test_engine.py (test_resume_from_checkpoint_gives_the_same_run).
"""
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.checkpoint import DifferentRunError, RoundCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _metrics(result):
    """The run's metrics without the wall-clock ``seconds``."""
    return {k: v for k, v in result.metrics.items() if k != "seconds"}


def _assert_same_run(got, want):
    assert got.metrics.keys() == want.metrics.keys()
    for name, values in _metrics(want).items():
        np.testing.assert_array_equal(got.metrics[name], values, err_msg=name)
    chex.assert_trees_all_equal(got.state, want.state)


def _damage(step_dir: pathlib.Path, how: str) -> None:
    """Damages a saved round as a disk, a copy or a person might."""
    if how == "overwrite":  # bytes in the middle of every file
        for path in [p for p in step_dir.rglob("*") if p.is_file()]:
            data = bytearray(path.read_bytes())
            data[len(data) // 3:len(data) // 3 + 8] = b"\xff" * 8
            path.write_bytes(bytes(data))
    elif how == "truncate_history":
        path = step_dir / "history" / "metadata"
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    elif how == "delete_state":
        (step_dir / "state" / "manifest.ocdbt").unlink()
    elif how == "half_written":  # the files are there, orbax's commit marker is not
        (step_dir / "commit_success.txt").unlink()
    else:
        raise ValueError(how)


def _damage_lines(caplog):
    return [r.getMessage() for r in caplog.records if re.match(r"checkpoint rounds? .* damaged", r.getMessage())]


ROUNDS = 12  # a Ctrl-C after round 2, then a SIGKILL two rounds after the resume: rounds 7..12 and the final
# evaluation leave the kill a second or more
RUN = [sys.executable, "-m", "experiments.run", "--dataset=digits", "--num_clients=4", "--hidden=16",
       "--batch_size=16", "--lr=0.1", "--partition=dirichlet_per_class", "--alpha=0.5", "--max_train=400",
       "--algorithm=fedavg", f"--rounds={ROUNDS}", "--noevaluate_local"]
# Python keeps SIGINT ignored where its parent ignored it (a background job, or make started from one, as CI may
# run the suite): the victims restore the KeyboardInterrupt a terminal's Ctrl-C raises, then run the binary as
# `python -m` would.
WITH_CTRL_C = [sys.executable, "-c", "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('experiments.run', run_name='__main__', alter_sys=True)", *RUN[3:]]


def _records(output_dir):
    """metrics.jsonl without ``seconds``, as canonical JSON text (bitwise: floats print exactly, NaN too)."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.dumps({k: v for k, v in json.loads(l).items() if k != "seconds"}, sort_keys=True) for l in lines]


def _summary(output_dir):
    summary = json.loads((output_dir / "summary.json").read_text())
    return json.dumps({k: v for k, v in summary.items() if k != "flags"}, sort_keys=True)  # flags: the output dir


def _read_until(victim, text):
    """The victim's stdout, a line at a time, up to the line holding ``text``."""
    seen = ""
    while text not in seen:
        line = victim.stdout.readline()
        assert line, f"the run ended before {text!r}: " + seen[-1000:] + victim.stderr.read()[-2000:]
        seen += line
    return seen


def test_interrupted_then_killed_run_resumes_to_the_same_final_metrics(tmp_path):  # first: the slowest
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) after round 2: one line naming the way
    on, exit status 130, no traceback from the run or from orbax's checkpoint threads. The same command resumes;
    SIGKILL two rounds later; the same command again finishes with the metrics and summary of a run never
    stopped."""
    # A compilation cache shared by the four processes keeps this test short; it changes no number.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    done = subprocess.run([*RUN, f"--output_dir={straight}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    def victim():  # its own process group: the signals reach it alone
        return subprocess.Popen([*WITH_CTRL_C, f"--output_dir={stopped}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    interrupted = victim()
    seen = _read_until(interrupted, "round    2")  # round 2 is checkpointed and logged
    os.killpg(interrupted.pid, signal.SIGINT)
    rest, err = interrupted.communicate(timeout=120)
    assert f"round {ROUNDS:4d}" not in seen + rest, "the run ended before the signal; fix the test: more rounds"
    assert interrupted.returncode == 130, (interrupted.returncode, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "interrupted; rerun the same command to resume from the last checkpointed round (--noresume starts over)")

    killed = victim()
    resumed = re.search(r"^resuming at round (\d+): rounds? 1(-\d+)? restored from the last checkpoint",
                        _read_until(killed, "resuming at round"), re.M)
    assert resumed and 3 <= int(resumed[1]) < ROUNDS, resumed
    seen = _read_until(killed, f"round {int(resumed[1]) + 1:4d}")
    os.killpg(killed.pid, signal.SIGKILL)
    rest, _ = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before the kill; fix the test: more rounds"
    assert not (stopped / "summary.json").exists() and f"round {ROUNDS:4d}" not in seen + rest

    again = subprocess.run([*RUN, f"--output_dir={stopped}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "round    1  GA" not in again.stdout and f"round {ROUNDS:4d}  GA" in again.stdout  # resumed
    assert re.search(r"^resuming at round \d+: rounds? 1(-\d+)? restored from the last checkpoint", again.stdout, re.M)
    assert "damaged" not in again.stderr
    assert _records(stopped) == _records(straight) and len(_records(straight)) == ROUNDS
    assert _summary(stopped) == _summary(straight)


TINY = {"w": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones(4, jnp.int32)}}


def _saved(directory, rounds=3):
    ckpt = RoundCheckpointer(str(directory))
    for r in range(1, rounds + 1):
        ckpt.save(r, jax.tree.map(lambda x: x + r, TINY), [{"round": i} for i in range(1, r + 1)])
    ckpt.close()


@pytest.mark.parametrize("how", ["overwrite", "truncate_history", "delete_state", "half_written"])
def test_restore_latest_skips_a_damaged_newest_checkpoint(tmp_path, caplog, how):
    _saved(tmp_path)
    _damage(tmp_path / "3", how)
    ckpt = RoundCheckpointer(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        r, state, history = ckpt.restore_latest(TINY)
    assert r == 2 and history == [{"round": 1}, {"round": 2}]
    chex.assert_trees_all_equal(state, jax.tree.map(lambda x: x + 2, TINY))
    [line] = _damage_lines(caplog)
    assert re.fullmatch(rf"checkpoint round 3 in {re.escape(str(tmp_path))} is damaged \(\w+: [^\n]+\); "
                        r"resuming from round 2 \(set aside as 3\.damaged\)", line), line
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3.damaged"]
    ckpt.save(3, TINY, history + [{"round": 3}])  # orbax saves the set-aside round afresh
    assert ckpt.restore_latest(TINY)[0] == 3
    ckpt.close()


def test_overwritten_array_bytes_fail_the_saved_checksum_and_are_set_aside(tmp_path, caplog):
    """Bytes overwritten inside an array's data file, its size kept: orbax reads it without complaint (a new user
    saw a resumed run stall on NaN), the checksum saved with the round does not match."""
    state = {"w": jnp.arange(4000.0).reshape(40, 100), "b": jnp.ones(3)}
    ckpt = RoundCheckpointer(str(tmp_path))
    for r in (1, 2, 3):
        ckpt.save(r, jax.tree.map(lambda x: x + r, state), [{"round": i} for i in range(1, r + 1)])
    ckpt.close()
    data = max((p for p in (tmp_path / "3" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 200] = b"\x01" * 200
    data.write_bytes(bytes(raw))
    ckpt = RoundCheckpointer(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        r, restored, _ = ckpt.restore_latest(state)
    ckpt.close()
    assert r == 2
    chex.assert_trees_all_equal(restored, jax.tree.map(lambda x: x + 2, state))
    [line] = _damage_lines(caplog)
    assert "ValueError: its arrays differ from the checksum saved with them" in line, line


def test_a_checkpoint_of_another_run_is_not_resumed_and_one_line_names_what_differs(digits, small_fed, tiny_model,
                                                                                     tmp_path):
    def run(lr=0.1, key=0, fed=small_fed, **identity):
        return bf.simulate(bf.algorithms.fedavg(tiny_model, lr=lr, batch_size=16), fed, rounds=3,
                           key=jax.random.PRNGKey(key), evaluate_local=False, checkpoint_dir=str(tmp_path),
                           checkpoint_identity=identity or {"flags": {"partition": "dirichlet"}})

    bf.simulate(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16), small_fed, rounds=2, key=jax.random.PRNGKey(0),
                evaluate_local=False, checkpoint_dir=str(tmp_path), checkpoint_identity={"flags": {"partition": "dirichlet"}})
    parts = bf.data.partition(digits.y_train[:500], "dirichlet_per_class", 5, seed=1, alpha=0.5)  # small_fed: seed 0
    other_split = bf.data.stack_clients(digits.x_train[:500], digits.y_train[:500], parts, x_test=digits.x_test,
                                        y_test=digits.y_test, num_classes=10, name="digits")
    for changed, differs in [(dict(lr=0.2), "lr 0.2 (saved: 0.1)"), (dict(key=1), "initial_state (another checksum), key (another checksum);"),
                             (dict(fed=other_split), "data (another checksum)"),
                             (dict(flags={"partition": "iid"}), "partition iid (saved: dirichlet)")]:
        with pytest.raises(DifferentRunError) as err:
            run(**changed)
        message = str(err.value)
        assert message.startswith(f"the checkpoint in {tmp_path} (round 2) was saved by another run, which differs "
                                  f"in {differs}") and message.endswith("or start over with --noresume"), message
        assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # another run's folder: nothing set aside
    assert run().metrics["round"] == [1, 2, 3]  # the same run resumes


def test_run_identities_compare_what_both_sides_name(tmp_path):
    """A flag another bfedjax version added (on one side only, e.g. unset: None) does not refuse a resume; numpy
    scalars are JSON; a differing entry is named."""
    state = {"w": jnp.ones(3)}
    ckpt = RoundCheckpointer(str(tmp_path), run_identity={"flags": {"lr": np.float32(0.5), "clients": np.int64(4)}})
    ckpt.save(1, state, [{"round": 1}])
    ckpt.close()
    newer = RoundCheckpointer(str(tmp_path), run_identity={"flags": {"lr": 0.5, "clients": 4, "new_flag": None}})
    assert newer.restore_latest(state)[0] == 1
    newer.close()
    other = RoundCheckpointer(str(tmp_path), run_identity={"flags": {"lr": 0.5, "clients": 5, "new_flag": None}})
    with pytest.raises(DifferentRunError, match=r"differs in clients 5 \(saved: 4\);"):
        other.restore_latest(state)


def test_a_model_change_is_named_and_a_given_initial_server_state_is_not_compared(small_fed, tiny_model, tmp_path):
    """The identity is read before the arrays: another model's checkpoint names the initial state, not orbax's
    shape error; a given init_server (pre-training, recomputed by a resume and not bitwise repeatable on every
    accelerator) is left out, so a resume from a slightly different one goes on."""
    algo = lambda model: bf.algorithms.fedavg(model, lr=0.1, batch_size=16)  # noqa: E731
    run = dict(key=jax.random.PRNGKey(0), evaluate_local=False, checkpoint_dir=str(tmp_path / "model"))
    bf.simulate(algo(tiny_model), small_fed, rounds=1, **run)
    with pytest.raises(DifferentRunError, match=r"differs in initial_state \(another checksum\);"):
        bf.simulate(algo(bf.models.get_model("mlp", 10, hidden=(32,))), small_fed, rounds=2, **run)
    server = algo(tiny_model).server_init(tiny_model.init(jax.random.PRNGKey(1), small_fed.x[0][:1])["params"])
    run = dict(run, checkpoint_dir=str(tmp_path / "given"), clients_per_round=np.int64(3))
    bf.simulate(algo(tiny_model), small_fed, rounds=1, init_server=server, **run)
    nudged = jax.tree.map(lambda p: p + 1e-7, server)
    assert bf.simulate(algo(tiny_model), small_fed, rounds=2, init_server=nudged, **run).metrics["round"] == [1, 2]


def test_a_save_cut_short_by_a_kill_is_ignored(tmp_path, caplog):
    """A kill during a save leaves orbax's ``<round>.orbax-checkpoint-tmp``: not a checkpoint, no warning."""
    _saved(tmp_path)
    os.rename(tmp_path / "3", tmp_path / "3.orbax-checkpoint-tmp")
    ckpt = RoundCheckpointer(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert ckpt.restore_latest(TINY)[0] == 2
        ckpt.save(3, TINY, [{"round": i} for i in (1, 2, 3)])
    ckpt.close()
    assert not _damage_lines(caplog)
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]


def test_every_checkpoint_damaged_raises_naming_the_folder(small_fed, tiny_model, tmp_path):
    _saved(tmp_path, rounds=2)
    for r in (1, 2):
        _damage(tmp_path / str(r), "overwrite")
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    with pytest.raises(ValueError, match=rf"^no readable checkpoint in {re.escape(str(tmp_path))} \(newest: round 2, "
                                         r"damaged: \w+: .*\); fix: start over with --noresume") as err:
        bf.simulate(algo, small_fed, rounds=3, key=jax.random.PRNGKey(0), checkpoint_dir=str(tmp_path))
    assert "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # nothing moved: the person decides


def test_checkpoint_of_another_state_keeps_the_does_not_match_message(small_fed, tiny_model, tmp_path):
    _saved(tmp_path, rounds=2)  # intact files, another structure (as from another algorithm)
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    with pytest.raises(ValueError, match=r"\(round 2\) does not match fedavg's state: .*fix: start over"):
        bf.simulate(algo, small_fed, rounds=3, key=jax.random.PRNGKey(0), checkpoint_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_damaged_newest_checkpoints_resume_from_the_newest_good_one(small_fed, tiny_model, tmp_path, caplog):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    run = dict(rounds=3, key=jax.random.PRNGKey(0), evaluate_local=False, checkpoint_dir=str(tmp_path))
    straight = bf.simulate(algo, small_fed, **run)
    _damage(tmp_path / "3", "overwrite")
    _damage(tmp_path / "2", "truncate_history")
    with caplog.at_level(logging.WARNING):
        resumed = bf.simulate(algo, small_fed, **run)  # restores round 1, trains rounds 2 and 3 again
    _assert_same_run(resumed, straight)
    [line] = _damage_lines(caplog)
    assert re.fullmatch(rf"checkpoint rounds 3, 2 in {re.escape(str(tmp_path))} are damaged \(round 3: \w+: .+; "
                        r"round 2: JSONDecodeError: .+\); resuming from round 1 \(set aside as 3\.damaged, 2\.damaged\)",
                        line), line
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "2.damaged", "3", "3.damaged"]  # rounds 2, 3 saved afresh


def test_same_seed_gives_bitwise_identical_metrics_across_runs_and_a_resume(small_fed, tiny_model, tmp_path):
    algo = bf.algorithms.build("fedavg", tiny_model, small_fed)
    key = jax.random.PRNGKey(3)
    straight = bf.simulate(algo, small_fed, rounds=4, key=key)
    first = bf.simulate(algo, small_fed, rounds=2, key=key, checkpoint_dir=str(tmp_path))
    for name, values in _metrics(first).items():  # a second run: the same numbers, to the bit
        np.testing.assert_array_equal(values, straight.metrics[name][:2], err_msg=name)
    resumed = bf.simulate(algo, small_fed, rounds=4, key=key, checkpoint_dir=str(tmp_path))
    _assert_same_run(resumed, straight)
