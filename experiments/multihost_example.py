r"""Multi-host (or multi-process) bfedjax: the client axis sharded over every process's devices.

Run one process per host (here two processes on one machine, CPU):

    python -m experiments.multihost_example --process_id=0 --num_processes=2 &
    python -m experiments.multihost_example --process_id=1 --num_processes=2

Every process loads the same data and partition (they are seeded), calls
``jax.distributed.initialize`` and runs the same ``simulate``: the mesh spans
all processes' devices, each process trains the clients whose shards it
holds, and the aggregation's sums become cross-process all-reduces.
"""
from __future__ import annotations

from absl import flags

from experiments import errors

FLAGS = flags.FLAGS
flags.DEFINE_string("coordinator", "localhost:12355", "host:port of process 0.")
flags.DEFINE_integer("num_processes", 2, "Number of processes.")
flags.DEFINE_integer("process_id", 0, "This process's index.")
flags.DEFINE_integer("rounds", 2, "Federated rounds.")


def main(argv):
    del argv
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    jax.distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    import bfedjax as bf
    from bfedjax.core.sharding import client_mesh

    data = bf.data.load("digits")
    parts = bf.data.partition(data.y_train, "dirichlet_per_class", 8, seed=0, alpha=0.5)
    fed = bf.data.from_partition(data, parts)
    algo = bf.algorithms.fola(bf.models.get_model("mlp", 10, hidden=(32,)), lr=0.1, lam=10.0, batch_size=16)
    mesh = client_mesh()
    print(f"process {jax.process_index()}: {jax.local_device_count()} local of {jax.device_count()} devices",
          flush=True)
    result = bf.simulate(algo, fed, rounds=FLAGS.rounds, key=jax.random.PRNGKey(0), mesh=mesh,
                         evaluate_local=False)
    print(f"process {jax.process_index()}: GA per round {result.metrics['global_accuracy']}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    errors.run(main)
