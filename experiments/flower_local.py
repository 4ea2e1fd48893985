"""Any experiment over a real Flower deployment on this machine: a SuperLink and N SuperNodes on 127.0.0.1.

    python -m experiments.flower_local --flags="--algorithm=fola --dataset=digits --num_clients=3 --rounds=5" \
        --output_dir=out/flower

starts ``flower-superlink`` and one ``flower-supernode`` per client (``--node-config partition-id=n``,
free ports, a private ``FLWR_HOME`` in the output folder), submits ``experiments/flower_app`` with
``flwr run``, prints the server's round lines as they come, and stops every process at the end (or on
an error or Ctrl-C). The output folder gets the app's ``metrics.jsonl``, ``server_round_<r>.npz`` and
``done.json`` (or ``error.txt``), and ``logs/`` with each process's log. The server state after every
round equals ``python -m experiments.run`` with the same flags (``tests/test_flower.py`` checks it).
"""
from __future__ import annotations

import pathlib
import shlex

from absl import flags

from bfedjax.optional import require
from experiments import errors
from experiments.round_log import round_line

APP = pathlib.Path(__file__).resolve().parent / "flower_app"

flags.DEFINE_string("flags", "--algorithm=fola --dataset=digits --max_train=300 --num_clients=3 --hidden=16 "
                    "--rounds=3 --lr=0.05 --lam=100", "experiments.run's flags for the federation and algorithm; "
                    "one SuperNode per client (--num_clients).")
flags.DEFINE_string("output_dir", "out/flower", "Where the server writes its metrics and states, and logs/.")
flags.DEFINE_float("timeout", 900.0, "Seconds the whole Flower run may take.")
FLAGS = flags.FLAGS


def num_clients_of(run_flags: str) -> int:
    """``--num_clients`` of experiments.run's flags (one SuperNode per client, so it must be given)."""
    words = shlex.split(run_flags)
    for i, word in enumerate(words):
        if word.startswith("--num_clients="):
            return int(word.split("=", 1)[1])
        if word == "--num_clients" and i + 1 < len(words):
            return int(words[i + 1])
    raise ValueError("--flags has no --num_clients; fix: add e.g. --num_clients=3 to --flags (one SuperNode each)")


def main(argv):
    del argv
    require("flwr")
    from bfedjax.flower.local import LocalDeployment
    nodes = num_clients_of(FLAGS.flags)
    print(f"Flower: a SuperLink and {nodes} SuperNodes on 127.0.0.1 -> {FLAGS.output_dir} "
          f"(process logs in {FLAGS.output_dir}/logs)", flush=True)
    run_config = f'flags="{FLAGS.flags}" wait-for-nodes=120.0'
    with LocalDeployment(APP, run_config, nodes, FLAGS.output_dir, timeout=FLAGS.timeout) as deployment:
        records = deployment.wait(on_record=lambda record: print(round_line(record), flush=True))
    print(f"done: {len(records)} rounds over Flower (run {deployment.run_id}) -> {FLAGS.output_dir}")


if __name__ == "__main__":
    errors.run(main)
