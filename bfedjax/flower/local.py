"""Run a Flower app on this machine: a SuperLink and N SuperNodes on 127.0.0.1 (``LocalDeployment``).

``python -m experiments.flower_local`` runs ``experiments/flower_app`` this way, and
``tests/test_flower.py`` checks its rounds against ``bf.simulate``.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1 running the Flower app in folder ``app``.

    Node n gets ``--node-config partition-id=n``. The app is submitted with ``flwr run`` and the run
    config ``run_config`` plus ``output-dir=<work>`` and ``timeout``; it writes one JSON record per round
    to ``<work>/metrics.jsonl`` and ``done.json`` (or ``error.txt``) at the end, as
    ``experiments/flower_app`` does. Use as a context manager: entering starts the processes (free
    ports, a private ``FLWR_HOME`` and ``logs/`` in ``work``) and submits the run (``run_id``); leaving
    stops every process group (the SuperExec, ServerApp and ClientApp processes too). ``wait()`` blocks
    until the app is done and returns its per-round records.
    """

    def __init__(self, app: str | os.PathLike, run_config: str, num_nodes: int, work: str | os.PathLike, *,
                 timeout: float = 900.0):
        self.app, self.run_config, self.num_nodes, self.timeout = str(app), run_config, num_nodes, timeout
        self.work = pathlib.Path(work).resolve()
        self.output, self.logs, self.home = self.work, self.work / "logs", self.work / "flwr_home"
        self.run_id, self.started, self._procs = None, None, []
        bindir = os.path.dirname(sys.executable)  # flower-superlink, flower-supernode, flwr, flwr-clientapp
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
                    "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        # Flower starts a ClientApp process per message: a shared compilation cache spares later rounds' compiles.
        self.env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.work / "jax_cache"))
        self.env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

    def __enter__(self) -> "LocalDeployment":
        for folder in (self.home, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        for stale in ("done.json", "error.txt", "metrics.jsonl"):
            (self.output / stale).unlink(missing_ok=True)
        port = free_port()
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                               f'address = "127.0.0.1:{port}"\ninsecure = true\n')
        self.started = time.time()
        try:
            self._start("superlink", "flower-superlink", "--insecure", "--port", str(port),
                        "--disable-runtime-dependency-installation")
            for n in range(self.num_nodes):
                self._start(f"supernode{n}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                            "--port", str(free_port()), "--node-config", f"partition-id={n}", "--max-wait-time", "120")
            self.run_id = self._submit()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, name: str, *command: str) -> None:
        with open(self.logs / f"{name}.log", "w") as log:
            self._procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=self.work, start_new_session=True))

    def _submit(self) -> str:
        """``flwr run`` until the SuperLink answers; the run id."""
        overrides = f'{self.run_config} output-dir="{self.output}" timeout={self.timeout}'.strip()
        while True:
            submitted = subprocess.run(["flwr", "run", self.app, "local", "--format", "json", "--run-config",
                                        overrides], env=self.env, cwd=self.work, capture_output=True, text=True,
                                       timeout=120)
            text = submitted.stdout
            if '"success": true' in text:
                return json.loads(text[text.index("{"):])["run-id"]
            if "unavailable" not in text or time.time() - self.started > 120:
                raise RuntimeError("flwr run failed: " + (text + submitted.stderr)[-2000:] + self.tails())
            time.sleep(0.5)

    def records(self) -> list[dict]:
        """The server's per-round records so far (``metrics.jsonl``)."""
        path = self.output / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait(self, on_record=None) -> list[dict]:
        """Blocks until the app is done; calls ``on_record`` with each new round record; returns them all."""
        done, error, seen = self.output / "done.json", self.output / "error.txt", 0
        while True:
            finished = done.exists() or error.exists()
            records = self.records()
            for record in records[seen:]:
                if on_record:
                    on_record(record)
            seen = len(records)
            if error.exists():
                raise RuntimeError(error.read_text().strip() + self.diagnosis())
            if finished:
                return records
            if time.time() - self.started > self.timeout:
                raise TimeoutError(f"the Flower run did not finish in {self.timeout:.0f} s" + self.diagnosis())
            time.sleep(0.5)

    def tails(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.logs.glob("*.log")))

    def diagnosis(self) -> str:
        """The processes' log tails and the ServerApp's log (``flwr log``), for a failure message."""
        if self.run_id is None:
            return self.tails()
        shown = subprocess.run(["flwr", "log", str(self.run_id), "local", "--show"], env=self.env,
                               capture_output=True, text=True, timeout=60)
        return self.tails() + "\n--- flwr log (ServerApp)\n" + shown.stdout[-3000:]

    def stop(self) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs = []


__all__ = ["LocalDeployment", "free_port"]
