"""The bench's row ``mlp K=100 B=50`` (Fashion-MNIST, 100 samples a client) in its default layout (``vmap/c1x2``:
clients in turn on each of 2 CPU devices), several variants' rounds in turn; prints each one's fastest round.

    python results/bench/session29_fola_floor/scripts/ab.py 15 fedavg:fedavg fola:fola \\
        fedavg_peel:fedavg:BFED_PEEL=1,BFED_MASK=1 fola_peel:fola:BFED_PEEL=1,BFED_MASK=1

A variant is ``label:algorithm[:ENV=1,...]``, the variables (``step_ab.py`` lists them; they need
``first_step_peel.patch``) set while its round is traced.
"""
import os
import sys

from experiments import bench

bench.FLAGS(["ab"])
from bfedjax.core import layout  # noqa: E402

layout.use_cpu_cores()  # two CPU devices, as the bench
import bfedjax as bf  # noqa: E402


def main(argv):
    rounds = int(argv[0])
    config = next(c for c in bench.configurations(True) if c.name == "mlp K=100 B=50")
    fed = bench.federate(bench.load_images(), config)
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    prepared = {}
    for spec in argv[1:]:
        label, name, envs = (spec.split(":") + [""])[:3]
        saved = dict(os.environ)
        os.environ.update(kv.split("=") for kv in filter(None, envs.split(",")))
        algorithm = bench.make_algorithm(name, model, fed, config.batch_size)
        prepared[label] = (algorithm, bench.prepared_variant(algorithm, fed, config, "vmap/c1x2"))  # compiled here
        os.environ.clear()
        os.environ.update(saved)
    for label, seconds in bench.time_in_turn(prepared, rounds).items():
        print(f"{label:18s} {seconds * 1000:7.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
