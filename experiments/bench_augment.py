r"""What in-round augmentation costs: rounds of FOLA's CIFAR CNN with ``--augment`` none, crop_flip and
autoaugment_cutout (FOLA's Table I).

    python -m experiments.bench_augment                           # 10 clients x 96 images, B = 32 (about 2 minutes)
    python -m experiments.bench_augment --augment_clients=20 --augment_algorithms=fola

One local epoch per round on procedural 32x32x3 images (only the speed is measured), lr 0.01, the clients
vmapped in one chunk. Prints the fastest and median of ``--rounds`` rounds (default 5) after a warm-up, the
first round (compilation + one round) and each row's time over the unaugmented round's; then each
augmentation alone on one batch (jitted; the fastest of 5 repetitions of 50 calls).
"""
from __future__ import annotations

from absl import flags

from experiments import bench, errors  # bench's flags (--rounds among them) are this script's too

FLAGS = flags.FLAGS
flags.DEFINE_list("augmentations", ["none", "crop_flip", "autoaugment_cutout"], "Values of --augment to time.")
flags.DEFINE_list("augment_algorithms", ["fedavg", "fola"], "Algorithms to time.")
flags.DEFINE_integer("augment_clients", 10, "Clients per round.", lower_bound=1)
flags.DEFINE_integer("augment_batch_size", 32, "Local batch size (FOLA's Table II: 32).", lower_bound=1)

SAMPLES_PER_CLIENT = 96  # 3 local steps of 32


def main(argv):
    del argv
    bench.time_compilations_afresh()
    import bfedjax as bf
    import jax
    for name in FLAGS.augmentations:
        if name not in bf.data.AUGMENTATIONS:
            raise ValueError(f"--augmentations: {name!r} is not one of {sorted(bf.data.AUGMENTATIONS)}; "
                             "fix: e.g. --augmentations=none,autoaugment_cutout")
    config = bench.Config("augment", "uniform", FLAGS.augment_clients, FLAGS.augment_batch_size, model="fola_cnn",
                          samples_per_client=SAMPLES_PER_CLIENT, clients_per_chunk=FLAGS.augment_clients)
    data = bench.load_images((32, 32, 3))
    fed = bench.federate(data, config)
    model = bf.models.get_model("fola_cnn", 10)
    print(f"device: {jax.devices()[0].device_kind}; {FLAGS.augment_clients} clients x {SAMPLES_PER_CLIENT} "
          f"images, B = {FLAGS.augment_batch_size}, 1 epoch\n\n"
          "| algorithm | augment | round (s) | median (s) | first round (s) | / none |\n|---|---|---|---|---|---|")
    for algorithm_name in FLAGS.augment_algorithms:
        plain = bench.make_algorithm(algorithm_name, model, fed, FLAGS.augment_batch_size)
        base = None
        for name in FLAGS.augmentations:
            augment = bf.data.augmentation(name, data.input_shape, ((0.5,) * 3, (0.5,) * 3))
            algorithm = plain if augment is None else bf.data.augmented(plain, augment)
            t = bench.time_library(algorithm, fed, config, "vmap", FLAGS.rounds or 5)
            base = t["round_s"] if name == "none" else base
            ratio = f"{t['round_s'] / base:.2f}" if base else "-"
            print(f"| {algorithm_name} | {name} | {t['round_s']:.4f} | {t['median_round_s']:.4f} | "
                  f"{t['compile_s']:.1f} | {ratio} |", flush=True)
    print(f"\n| augment | ms per batch of {FLAGS.augment_batch_size} |\n|---|---|")
    batch = jax.numpy.asarray(data.x_train[:FLAGS.augment_batch_size])
    for name in FLAGS.augmentations:
        augment = bf.data.augmentation(name, data.input_shape, ((0.5,) * 3, (0.5,) * 3))
        if augment is not None:
            print(f"| {name} | {1e3 * _fastest_call(jax.jit(augment), batch):.2f} |", flush=True)


def _fastest_call(fn, batch, calls: int = 50, repetitions: int = 5) -> float:
    """Seconds per call of ``fn(batch, key)``: the fastest of ``repetitions`` runs of ``calls`` calls."""
    import time

    import jax
    keys = jax.random.split(jax.random.PRNGKey(0), calls)
    fn(batch, keys[0]).block_until_ready()
    best = float("inf")
    for _ in range(repetitions):
        start = time.perf_counter()
        for key in keys:
            out = fn(batch, key)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


if __name__ == "__main__":
    errors.run(main)
