r"""Which convolution a client trained alone should take on a CPU (``models.conv.ALONE_MATMUL_CONV_MAX_BYTES``,
``models.conv.WINOGRAD_TILES``).

    python -m experiments.bench_conv_alone                     # every zoo CNN at 32, 1 and 0 MiB (about 4 minutes)
    python -m experiments.bench_conv_alone --models=fedreg_cnn --alone_mib=32,1
    python -m experiments.bench_conv_alone --alone_mib=1 --winograd_modes=on,off
    python -m experiments.bench_conv_alone --alone_mib=1 --winograd_modes=on --winograd_tiles=3:4,5:4

FedAvg rounds (lr 0.01, clip 10) of 10 clients x 20 procedural images, B = 10, the clients in turn
(``clients_per_chunk=1``) on every CPU core as a JAX device (``core.layout.use_cpu_cores``), for each
``--alone_mib``: the largest patch matrix whose differentiated convolution stays an im2col matrix product
when no vmap batches it (32: the product for every patch matrix these rounds build; 0: XLA's
convolutions with ``loop_friendly_conv``'s backward for all), and for each ``--winograd_modes`` setting (on: the
library's ``WINOGRAD_TILES``, the Winograd convolution for the stride-1 convolutions XLA would take; off: none).
Prints the fastest and the median of
``--rounds`` rounds (default 5) after a warm-up, and the first round (compilation + one round).
"""
from __future__ import annotations

from absl import flags

from experiments import bench, errors  # bench's flags (--rounds among them) are this script's too

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["lenet", "cnn1", "cnn2", "fedreg_cnn", "fola_cnn", "mcmahan_cnn", "resnet20"],
                  "Zoo CNNs to time.")
flags.DEFINE_list("alone_mib", ["32", "1", "0"], "Values of ALONE_MATMUL_CONV_MAX_BYTES (MiB) to time.")
errors.check_list("alone_mib", lambda v: float(v) >= 0, "sizes in MiB >= 0", "32,1,0")
flags.DEFINE_list("winograd_modes", ["on"], "Winograd settings to time: on (the library's WINOGRAD_TILES, or "
                  "--winograd_tiles), off (none).")
errors.check_list("winograd_modes", lambda v: v in ("on", "off"), "on or off", "on,off")
flags.DEFINE_list("winograd_tiles", None, "'on' takes these kernel:tile pairs instead of the library's CPU table, "
                  "e.g. 3:4,5:4 (F(4x4, 3x3) and F(4x4, 5x5)).")
errors.check_list("winograd_tiles", lambda v: len(v.split(":")) == 2 and all(p.isdigit() for p in v.split(":")),
                  "kernel:tile pairs", "3:4,5:4")

CIFAR_SHAPED = ("fola_cnn", "mcmahan_cnn", "resnet20")


def main(argv):
    del argv
    bench.time_compilations_afresh()
    import bfedjax as bf
    devices = bf.core.layout.use_cpu_cores()  # before JAX's first computation
    import jax
    tiles = (dict(tuple(int(p) for p in pair.split(":")) for pair in FLAGS.winograd_tiles) if FLAGS.winograd_tiles
             else dict(bf.models.conv.WINOGRAD_TILES.get("cpu", {})))
    print(f"device: {jax.devices()[0].device_kind}, {devices} CPU devices; Winograd tiles (kernel: tile) {tiles}\n\n"
          "| model | alone MiB | Winograd | round (s) | median (s) | first round (s) |\n|---|---|---|---|---|---|")
    for name in FLAGS.models:
        shape = (32, 32, 3) if name in CIFAR_SHAPED else (28, 28, 1)
        config = bench.Config(name, "uniform", 10, 10, model=name, samples_per_client=20, clients_per_chunk=1)
        fed = bench.federate(bench.load_images(shape), config)
        for mib in FLAGS.alone_mib:
            for winograd in FLAGS.winograd_modes:
                bf.models.conv.ALONE_MATMUL_CONV_MAX_BYTES["cpu"] = int(float(mib) * 2**20)
                bf.models.conv.WINOGRAD_TILES["cpu"] = tiles if winograd == "on" else {}
                jax.clear_caches()  # the limits are read when a model is traced
                algorithm = bench.make_algorithm("fedavg", bf.models.get_model(name, 10), fed, 10)
                t = bench.time_library(algorithm, fed, config, "vmap", FLAGS.rounds or 5, client_devices=devices)
                print(f"| {name} | {mib} | {winograd} | {t['round_s']:.4f} | {t['median_round_s']:.4f} | "
                      f"{t['compile_s']:.1f} |", flush=True)


if __name__ == "__main__":
    errors.run(main)
