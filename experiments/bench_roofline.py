r"""What the roofline predicts for the GPU targets' rounds, without a GPU.

    python -m experiments.bench_roofline                       # H100: the measured matmul peak of
                                                               # results/bench/gpu_h100/bench.json, 3.35 TB/s HBM3
    python -m experiments.bench_roofline --peak_tflops=989 --bandwidth_tbs=4.8   # e.g. an H200's spec sheet

For each GPU target configuration of ``experiments.bench`` (K clients x 100 samples,
B = 10, E = 1) it prints the round's training FLOPs (XLA's cost analysis of the
model, times 3 for forward + backward, on the real samples), its per-client
parameter traffic (``bench_anchors.round_traffic_bytes``), the roofline time (the
larger of FLOPs over peak and bytes over bandwidth) and which bound it is, and,
where the earlier H100 run measured the same row, that round's time and its
fraction of the roofline. The roofline ignores activations, launches and the
sequential dependence of local steps, so it is a floor, not a forecast.
"""
from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import bench, bench_anchors, errors

FLAGS = flags.FLAGS
flags.DEFINE_float("peak_tflops", None, "Peak FLOP/s in TFLOP/s (default: the matmul peak measured in --measured).")
flags.DEFINE_float("bandwidth_tbs", 3.35, "Memory bandwidth in TB/s (H100 SXM HBM3: 3.35).")
flags.DEFINE_string("measured", "results/bench/gpu_h100/bench.json", "An earlier GPU run of experiments.bench "
                    "(its peak and, where it has them, its rows' round times).")

# (configuration, model, algorithm, clients): the rows the GPU targets read.
TARGET_ROWS = (("mlp K=100 B=10", "mlp", "fedavg", 100), ("mlp K=1000 B=10", "mlp", "fedavg", 1000),
               ("fedreg_cnn K=100 B=10", "fedreg_cnn", "fedavg", 100), ("fola_cnn K=100 B=10", "fola_cnn", "fola", 100))
SAMPLES, BATCH = 100, 10


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fix: flags take the form --name=value")
    import jax
    import bfedjax as bf
    measured = {}
    peak = FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else None
    if os.path.exists(FLAGS.measured):
        with open(FLAGS.measured) as f:
            report = json.load(f)
        peak = peak or report["matmul_peak_gflops"] * 1e9
        measured = {(r["config"], r["algorithm"]): r["round_s"] for r in report["rows"]
                    if r["backend"] == "vmap" or r.get("default")}
    if peak is None:
        raise app.UsageError(f"{FLAGS.measured} does not exist; fix: pass --peak_tflops (and --bandwidth_tbs)")
    bandwidth = FLAGS.bandwidth_tbs * 1e12
    print(f"peak {peak / 1e12:.1f} TFLOP/s, bandwidth {bandwidth / 1e12:.2f} TB/s; K clients x {SAMPLES} samples, "
          f"B = {BATCH}, E = 1\n")
    print("| configuration | algorithm | TFLOP | GB moved | roofline (ms) | bound | measured (ms) | % of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for config, model_name, algorithm, clients in TARGET_ROWS:
        shape = bench.INPUT_SHAPES[model_name]
        model = bf.models.get_model(model_name, 10, hidden=(200, 200))
        params = model.init(jax.random.PRNGKey(0), jax.numpy.zeros((1,) + shape))["params"]
        param_count = sum(p.size for p in jax.tree.leaves(params))
        flops = clients * SAMPLES * bench.training_flops_per_sample(model, shape)
        moved = bench_anchors.round_traffic_bytes(param_count, clients, SAMPLES // BATCH, algorithm)
        floor = bench_anchors.roofline_seconds(flops, moved, peak, bandwidth)
        bound = "compute" if flops / peak >= moved / bandwidth else "memory"
        seen = measured.get((config, algorithm))
        seen_text = f"{1e3 * seen:.1f} | {100 * floor / seen:.0f}" if seen else "- | -"
        print(f"| {config} | {algorithm} | {flops / 1e12:.3f} | {moved / 1e9:.2f} | {1e3 * floor:.2f} | {bound} | "
              f"{seen_text} |")


if __name__ == "__main__":
    errors.run(main)
