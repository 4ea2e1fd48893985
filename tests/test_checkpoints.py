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
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.checkpoint import RoundCheckpointer

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


ROUNDS = 10  # rounds 3..10 and the final evaluation leave the kill a second or more
RUN = [sys.executable, "-m", "experiments.run", "--dataset=digits", "--num_clients=4", "--hidden=16",
       "--batch_size=16", "--lr=0.1", "--partition=dirichlet_per_class", "--alpha=0.5", "--max_train=400",
       "--algorithm=fedavg", f"--rounds={ROUNDS}", "--noevaluate_local"]


def _records(output_dir):
    """metrics.jsonl without ``seconds``, as canonical JSON text (bitwise: floats print exactly, NaN too)."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.dumps({k: v for k, v in json.loads(l).items() if k != "seconds"}, sort_keys=True) for l in lines]


def _summary(output_dir):
    summary = json.loads((output_dir / "summary.json").read_text())
    return json.dumps({k: v for k, v in summary.items() if k != "flags"}, sort_keys=True)  # flags: the output dir


def test_sigkilled_run_resumes_to_the_same_final_metrics(tmp_path):  # first: the slowest, xdist starts it at once
    # A compilation cache shared by the three processes keeps this test short; it changes no number.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = subprocess.run([*RUN, f"--output_dir={straight}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    with open(tmp_path / "killed.log", "w") as log:  # the child keeps its own descriptor
        victim = subprocess.Popen([*RUN, f"--output_dir={killed}"], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    metrics, deadline = killed / "metrics.jsonl", time.monotonic() + 300
    try:
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # round 2 is checkpointed, logged
            assert victim.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no round 2 after 300 s"
            time.sleep(0.01)
    finally:
        victim.kill()  # SIGKILL; a no-op for a process that already ended
    assert victim.wait(timeout=60) == -signal.SIGKILL, "the run ended before the kill; fix the test: more --rounds"
    assert not (killed / "summary.json").exists() and metrics.read_text().count("\n") < ROUNDS

    again = subprocess.run([*RUN, f"--output_dir={killed}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "round    1  GA" not in again.stdout and f"round {ROUNDS:4d}  GA" in again.stdout  # resumed
    assert re.search(r"^resuming at round \d+: rounds 1-\d+ restored from the last checkpoint", again.stdout, re.M)
    assert "damaged" not in again.stderr
    assert _records(killed) == _records(straight) and len(_records(straight)) == ROUNDS
    assert _summary(killed) == _summary(straight)


def test_ctrl_c_is_one_line_and_the_rerun_resumes(tmp_path):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) in the middle of a run: one line naming
    the way on, exit status 130, no traceback from the run or from orbax's checkpoint threads; the same command
    then resumes and finishes every round."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    rounds = 60  # round lines can wait in the pipe while the run goes on: 58 checkpointed rounds leave seconds
    command = [*RUN[:-2], f"--rounds={rounds}", "--noevaluate_local", f"--output_dir={tmp_path / 'run'}"]
    assert RUN[:3] == [sys.executable, "-m", "experiments.run"] and RUN[-2:] == [f"--rounds={ROUNDS}",
                                                                                 "--noevaluate_local"]
    # Python keeps SIGINT ignored where its parent ignored it (a background job, or make started from one, as
    # CI may run the suite): the victim restores the KeyboardInterrupt a terminal's Ctrl-C raises, then runs
    # the binary as `python -m` would.
    with_ctrl_c = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('experiments.run', run_name='__main__', alter_sys=True)")
    victim = subprocess.Popen([sys.executable, "-c", with_ctrl_c, *command[3:]], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own process group: the signal reaches it alone
    seen = ""
    while "round    2" not in seen:  # a line at a time: round 2 is checkpointed and logged
        line = victim.stdout.readline()
        assert line, "the run ended before round 2: " + victim.stderr.read()[-2000:]
        seen += line
    os.killpg(victim.pid, signal.SIGINT)
    rest, err = victim.communicate(timeout=120)
    assert f"round {rounds:4d}" not in seen + rest, "the run ended before the signal; fix the test: more rounds"
    assert victim.returncode == 130, (victim.returncode, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "interrupted; rerun the same command to resume from the last checkpointed round (--noresume starts over)")
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming at round" in again.stdout and f"round {rounds:4d}  GA" in again.stdout
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["round"] for l in records] == list(range(1, rounds + 1))


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
