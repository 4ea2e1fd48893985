"""The client axis sharded over 8 forced CPU devices gives the 1-device results."""
import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_eight_devices_match_one_device():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_check.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SHARDING OK" in out.stdout


def test_two_processes_match_one_process():
    """experiments/multihost_example.py over 2 CPU processes (gloo) gives the single-process result."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "experiments.multihost_example", f"--coordinator=localhost:{port}",
           "--num_processes=2", "--rounds=2"]
    from conftest import FAST_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_FLAGS)  # one device per process
    procs = [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    lines = [next(l for l in out.splitlines() if "GA per round" in l) for out, _ in outs]
    assert lines[0].split("GA per round")[1] == lines[1].split("GA per round")[1]

    import jax
    import bfedjax as bf
    data = bf.data.load("digits")
    fed = bf.data.from_partition(data, bf.data.partition(data.y_train, "dirichlet_per_class", 8, seed=0, alpha=0.5))
    algo = bf.algorithms.fola(bf.models.get_model("mlp", 10, hidden=(32,)), lr=0.1, lam=10.0, batch_size=16)
    single = bf.simulate(algo, fed, rounds=2, key=jax.random.PRNGKey(0), evaluate_local=False)
    multi = ast.literal_eval(lines[0].split("GA per round")[1].strip())
    assert max(abs(a - b) for a, b in zip(multi, single.metrics["global_accuracy"])) < 1e-6
