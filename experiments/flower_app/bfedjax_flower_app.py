"""The Flower app of ``experiments/flower_app``: ``experiments.run``'s flags over a SuperLink.

Run config (``pyproject.toml``'s ``[tool.flwr.app.config]``, ``flwr run --run-config``):
  flags: ``experiments.run``'s flags (data set, partition, model, algorithm, options, ``--rounds``,
    ``--seed``); the server and every node build the same federation and algorithm from them.
  output-dir: where the server writes ``metrics.jsonl`` (one record per round, as
    ``experiments.run``'s plus ``rejected_clients``), ``server_round_<r>.npz`` (the server state after
    round r as named arrays, ``bfedjax.flower.leaf_names``) and ``done.json`` or ``error.txt``.
  timeout / wait-for-nodes: seconds to wait for the round's replies / for N SuperNodes.
Node config: ``partition-id`` n, the client the node holds (``0 <= n < --num_clients``).
The run computes what ``python -m experiments.run`` with the same flags computes (the server state
after every round is ``simulate``'s); flags the deployment cannot honour are refused in one line.
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import tempfile

import jax
import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from bfedjax.core.types import ClientData
from bfedjax.flower import AlgorithmStrategy, ClientSetup, client_app as make_client_app, leaf_names
from experiments import run as experiment

FLAGS = experiment.FLAGS
server_app = ServerApp()


@functools.lru_cache(maxsize=2)
def prepared(flags: str):
    """``experiments.run.prepare`` of the run config's flags (once per process)."""
    run = experiment.prepare(["flower_app", *shlex.split(flags)])
    unsupported = {"--attack": FLAGS.attack != "none", "--pretrain_fraction": FLAGS.pretrain_fraction > 0,
                   "--client_test_splits": FLAGS.client_test_splits,
                   "--round_fractions / --partition=nested": experiment.round_fractions() is not None,
                   "--on_nonfinite=stop": FLAGS.on_nonfinite == "stop"}
    refused = [name for name, used in unsupported.items() if used]
    if refused:
        raise ValueError(f"{', '.join(refused)} cannot run over Flower; fix: drop them from the run config's flags")
    return run


def _setup(context: Context) -> ClientSetup:
    run = prepared(str(context.run_config["flags"]))
    fed = run.fed
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no partition id; fix: start it with --node-config 'partition-id=<n>'")
    n = int(context.node_config["partition-id"])
    if not 0 <= n < fed.num_clients:
        raise ValueError(f"partition-id={n} is not a client of the {fed.num_clients}; fix: 0 <= partition-id < "
                         f"{fed.num_clients}")
    group = 0 if run.client_groups is None else int(run.client_groups[n])
    return ClientSetup(run.algorithm, n, ClientData(fed.x[n], fed.y[n], int(fed.counts[n])), group)


client_app = make_client_app(_setup)


def _write(path: str, write) -> None:
    """Writes ``path`` through a temporary file in its folder, so a reader never sees half of it."""
    folder = os.path.dirname(path)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False, suffix=".tmp") as handle:
        write(handle)
    os.replace(handle.name, path)


def _recorder(output_dir: str):
    if not output_dir:
        return None
    os.makedirs(output_dir, exist_ok=True)
    records = []

    def on_round(record, server):
        records.append(record)
        arrays = dict(zip(leaf_names(server), (np.asarray(x) for x in jax.tree.leaves(server))))
        _write(os.path.join(output_dir, f"server_round_{record['round']}.npz"), lambda f: np.savez(f, **arrays))
        _write(os.path.join(output_dir, "metrics.jsonl"),
               lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))

    return on_round


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Registers the nodes and runs ``--rounds`` rounds of the algorithm with ``AlgorithmStrategy``."""
    config = context.run_config
    output_dir = str(config.get("output-dir", ""))
    try:
        run = prepared(str(config["flags"]))
        fed = run.fed
        strategy = AlgorithmStrategy(
            run.algorithm, num_clients=fed.num_clients, key=jax.random.PRNGKey(FLAGS.seed), x_test=fed.x_test,
            y_test=fed.y_test, clients_per_round=FLAGS.clients_per_round, participation=FLAGS.participation,
            client_weights=run.client_weights, hparams_fn=experiment.learning_rate_fn(),
            evaluate_local=FLAGS.evaluate_local, straggler_fraction=FLAGS.straggler_fraction,
            straggler_weighting=FLAGS.straggler_weighting, wait_for_nodes=float(config.get("wait-for-nodes", 120.0)),
            on_round=_recorder(output_dir))
        strategy.start(grid, num_rounds=FLAGS.rounds, timeout=float(config.get("timeout", 600.0)))
    except Exception as err:
        if output_dir:
            os.makedirs(output_dir, exist_ok=True)
            _write(os.path.join(output_dir, "error.txt"), lambda f: f.write(f"{type(err).__name__}: {err}".encode()))
        raise
    if output_dir:
        _write(os.path.join(output_dir, "done.json"), lambda f: f.write(json.dumps({"rounds": FLAGS.rounds}).encode()))
