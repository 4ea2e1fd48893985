"""JAX's persistent compilation cache as the library and ``experiments.run`` turn it on (core.compile_cache)."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = """
import sys, jax, jax.numpy as jnp
from bfedjax.core import compile_cache
mode = sys.argv[1]
if mode == "started":
    jnp.ones(1).block_until_ready()
if mode == "no_filelock":
    sys.modules["filelock"] = None  # as if not installed
    try:
        compile_cache.use_compilation_cache()
    except ImportError as err:
        print("ImportError:", err)
    print("jax:", jax.config.jax_compilation_cache_dir)
    sys.exit()
if mode == "unwritable":
    try:
        compile_cache.use_compilation_cache(sys.argv[2])
    except ValueError as err:
        print("ValueError:", err)
    sys.exit()
print("dir:", compile_cache.use_compilation_cache())
print("jax:", jax.config.jax_compilation_cache_dir)
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


def _env(tmp_path, **extra):
    """The environment of a fresh process: no cache of the suite's, every program cached however quick."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            **extra}


def _python(tmp_path, *args, **env):
    out = subprocess.run([sys.executable, "-c", PROGRAM, *args], cwd=ROOT, capture_output=True, text=True,
                         env=_env(tmp_path, **env), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _entries(directory: pathlib.Path) -> dict:
    """``{entry: its last-use stamp}`` of a JAX cache directory (JAX rewrites the stamp on every hit)."""
    return {p.name[:-len("-cache")]: (directory / (p.name[:-len("-cache")] + "-atime")).read_bytes()
            for p in directory.glob("*-cache")}


def test_the_next_process_loads_the_program_from_the_default_directory(tmp_path):
    directory = tmp_path / "xdg" / "bfedjax" / "jax"
    assert f"dir: {directory}\njax: {directory}\n" in _python(tmp_path, "fresh")
    first = _entries(directory)
    assert first  # the jitted program was written
    _python(tmp_path, "fresh")
    second = _entries(directory)
    assert second.keys() == first.keys()  # nothing compiled anew
    assert any(second[k] != first[k] for k in first)  # and the program was read back


def test_a_cache_the_user_set_or_switched_off_is_left_alone(tmp_path):
    own = tmp_path / "own"
    out = _python(tmp_path, "fresh", JAX_COMPILATION_CACHE_DIR=str(own))
    assert f"dir: {own}\njax: {own}\n" in out
    assert list(own.glob("*-cache")) and not (tmp_path / "xdg").exists()  # JAX's own setting: no size bound
    out = _python(tmp_path, "fresh", JAX_ENABLE_COMPILATION_CACHE="false")
    assert "dir: None\njax: None\n" in out and not (tmp_path / "xdg").exists()


def test_a_process_that_already_computed_caches_what_it_compiles_next(tmp_path):
    directory = tmp_path / "xdg" / "bfedjax" / "jax"
    assert f"dir: {directory}\n" in _python(tmp_path, "started")  # a notebook that ran cells before the call
    assert _entries(directory)


def test_a_directory_that_cannot_be_made_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    out = _python(tmp_path, "unwritable", str(tmp_path / "file" / "cache"))
    assert out.startswith("ValueError: compilation cache directory") and "fix: name a writable directory" in out
    assert out.count("\n") == 1


def _run(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "experiments.run", "--dataset=digits", "--num_clients=4",
                           "--hidden=16", "--max_train=400", "--algorithm=fedavg", "--rounds=1", *flags], cwd=ROOT,
                          capture_output=True, text=True, env=_env(tmp_path), timeout=600)


def test_the_binary_compiles_a_round_once_for_the_next_run(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path, f"--compilation_cache_dir={cache}", f"--output_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-2000:]
    after_first = _entries(cache)
    rounds = {k: v for k, v in after_first.items() if k.startswith("jit_round_step")}
    assert len(rounds) == 1
    second = _run(tmp_path, f"--compilation_cache_dir={cache}", f"--output_dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-2000:]
    (key, stamp), = rounds.items()
    assert _entries(cache)[key] != stamp  # the second run read the round back
    assert _entries(cache).keys() == after_first.keys()  # and compiled nothing anew
    assert not (tmp_path / "xdg").exists()  # the named directory, not the default one
    (tmp_path / "file").write_text("")
    bad = _run(tmp_path, f"--compilation_cache_dir={tmp_path / 'file' / 'cache'}", f"--output_dir={tmp_path / 'c'}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: --compilation_cache_dir: compilation cache directory {tmp_path / 'file' / 'cache'} cannot be "
        "created (Not a directory); fix: name a writable directory"]


def test_without_filelock_the_error_names_the_extra_and_nothing_is_cached(tmp_path):
    out = _python(tmp_path, "no_filelock")
    assert "ImportError: filelock is not installed" in out and "pip install 'bfedjax[experiments]'" in out
    assert out.endswith("jax: None\n") and not (tmp_path / "xdg").exists()
