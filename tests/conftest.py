"""Shared small fixtures: digits, a 5-client skewed split, a tiny MLP; fast XLA compiles for the suite."""
import os
import shutil
import tempfile

# XLA:CPU compile time dominates this suite (small data, many distinct round programs): LLVM at -O0 without its
# expensive passes compiles 2-3x faster (CPU time of tests/test_hbfl.py 3m40s -> 1m47s, of the Flipout tests +
# test_bfl + test_models 4m42s -> 1m44s), and the tests' few training steps barely feel the slower kernels.
# XLA:CPU's older elemental emitters instead of its MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false)
# take another third off: CPU time of `pytest -n 2 tests/test_engine.py tests/test_models.py` 700 s -> 398 s,
# of tests/test_hbfl.py 143 s -> 93 s (one run each, 2 cores, session 21). The programs are the same and
# their results agree within the tests' tolerances; benchmarks and binaries keep the default compiler.
# Set before JAX starts a backend and inherited by the binaries and notebooks the tests start.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

# A fresh JAX compilation cache per test session, shared by the pytest-xdist workers and the binaries the tests
# start (which would otherwise cache under ~/.cache: experiments.run's --compilation_cache_dir), removed at the end
# (pytest_unconfigure, Ctrl-C included): the tests compile many identical programs, which then compile once.
# Every program is cached, however short its compile (session 28: 0.91x the wall time of caching those of 0.3 s
# and over on test_engine + test_algorithms, 3 pairs; the whole suite 775 against 829 s; about 100 MB of cache;
# results/suite_compile_cache.md). A JAX_COMPILATION_CACHE_DIR set outside is used as it is, and kept.
OWN_COMPILATION_CACHE = None if os.environ.get("JAX_COMPILATION_CACHE_DIR") else tempfile.mkdtemp(prefix="bfedjax-jax-")
if OWN_COMPILATION_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_COMPILATION_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import bfedjax as bf  # noqa: E402


@pytest.fixture(scope="session")
def digits():
    return bf.data.load("digits")


@pytest.fixture(scope="session")
def small_fed(digits):
    """5 clients over 500 digits, Dirichlet 0.5: ragged sizes, so padding is exercised."""
    parts = bf.data.partition(digits.y_train[:500], "dirichlet_per_class", 5, seed=0, alpha=0.5)
    return bf.data.stack_clients(digits.x_train[:500], digits.y_train[:500], parts,
                                 x_test=digits.x_test, y_test=digits.y_test, num_classes=10, name="digits")


@pytest.fixture(scope="session")
def tiny_model():
    return bf.models.get_model("mlp", 10, hidden=(16,))


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
    return tiny_model.init(jax.random.PRNGKey(1), np.zeros((1, 8, 8, 1), np.float32))["params"]


@pytest.fixture(scope="session")
def halves(digits):
    """Two clients holding digits 0-4 and 5-9 (FOLA's Sec. IV-E split) of the first 400 training digits."""
    parts = bf.data.partition(digits.y_train[:400], "class_groups", 2, groups=[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]],
                              seed=0)
    return bf.data.stack_clients(digits.x_train[:400], digits.y_train[:400], parts, x_test=digits.x_test,
                                 y_test=digits.y_test, num_classes=10, name="digits")


@pytest.fixture(scope="session")
def logistic():
    """``(model, params)``: softmax regression on the 8x8 digits (d = 650)."""
    model = bf.models.get_model("logistic", 10)
    params = model.init(jax.random.PRNGKey(3), np.zeros((1, 8, 8, 1), np.float32))["params"]
    return model, params


def pytest_unconfigure(config):
    """Removes the compilation cache this process made (under pytest-xdist the controller's, which the workers
    inherited with the environment)."""
    if OWN_COMPILATION_CACHE:
        shutil.rmtree(OWN_COMPILATION_CACHE, ignore_errors=True)
