r"""Why the zoo's convolutions are matrix products on a CPU, and why CPU runs take clients in turn.

    python -m experiments.bench_conv        # prints a markdown table (about 3 minutes on 2 cores)

1. Seconds per local step of FedReg's CNN (batch 20) inside a ``lax.scan`` of 20
   SGD steps, with ``lax.conv_general_dilated``'s autodiff, with the custom-VJP
   ``models.conv.loop_friendly_conv`` and with ``models.conv.matmul_conv``
   (im2col; what the zoo uses on a CPU).
2. Seconds to evaluate HBFL's CNN2 on the 10,000 Fashion-MNIST test images
   (``metrics.classification.evaluate``) in batches of 1,000 and of 250
   (``EVAL_BATCH_SIZE``), with the zoo's dispatcher (``lax``'s convolution when
   nothing is differentiated) and with ``matmul_conv`` for every batch.
3. Seconds per FedAvg round on the one-class protocol of
   ``experiments.fedreg_one_class`` (10 clients x 20 images, 5 local epochs),
   clients vmapped together against one after another (``clients_per_chunk=1``),
   with the zoo's convolutions.
"""
from __future__ import annotations

import time

from absl import flags

from experiments import errors

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 3, "Timed repetitions (after one compile run).")


def _best_of(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def step_in_scan(conv_impl, repeats: int) -> float:
    """Seconds per SGD step of the FedReg CNN on 20 images inside a 20-step scan, with ``conv_impl``."""
    import jax
    import jax.numpy as jnp
    import optax
    import bfedjax as bf
    from bfedjax.models import zoo
    saved, zoo.zoo_conv = zoo.zoo_conv, conv_impl  # the CNN looks the name up when traced
    try:
        model = bf.models.get_model("fedreg_cnn", 10)
        params = bf.models.zoo.init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
        x = jax.random.uniform(jax.random.PRNGKey(1), (20, 28, 28, 1))
        y = jnp.arange(20) % 10
        loss = lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y))

        def train(p):
            step = lambda p, _: (jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p)), None)
            return jax.lax.scan(step, p, None, length=20)[0]

        return _best_of(lambda: jax.jit(train)(params), repeats) / 20
    finally:
        zoo.zoo_conv = saved


def with_lax_signature(impl):
    """``impl(x, w, strides, pads)`` (``models.conv``'s NHWC convolutions) called as ``lax.conv_general_dilated``."""
    from jax import lax

    def conv(lhs, rhs, window_strides, padding, **unused):
        if isinstance(padding, str):
            padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
        return impl(lhs, rhs, tuple(window_strides), tuple(tuple(p) for p in padding))
    return conv


def evaluation(conv_impl, batch_size: int, repeats: int) -> float:
    """Seconds to score CNN2 on the Fashion-MNIST test set in batches of ``batch_size`` with ``conv_impl``."""
    import jax
    import jax.numpy as jnp
    import bfedjax as bf
    from bfedjax.models import zoo
    data = bf.data.load("fashion_mnist", max_train=1000, seed=0)
    x, y = jnp.asarray(data.x_test), jnp.asarray(data.y_test)
    saved, zoo.zoo_conv = zoo.zoo_conv, conv_impl
    try:
        model = bf.models.get_model("cnn2", 10)
        params = zoo.init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
        score = jax.jit(lambda p: bf.metrics.classification.evaluate(
            lambda p, xb: model.apply({"params": p}, xb), p, x, y, batch_size))
        return _best_of(lambda: score(params), repeats)
    finally:
        zoo.zoo_conv = saved


def fedavg_round(clients_per_chunk, repeats: int) -> float:
    """Seconds per FedAvg round (CNN, 10 one-class clients, 5 epochs)."""
    import jax
    import bfedjax as bf
    data = bf.data.load("mnist_5k", pixels="unit")
    fed = bf.data.from_partition(data, bf.data.single_class(data.y_train, 200, seed=0, samples_per_client=20))
    algo = bf.algorithms.fedavg(bf.models.get_model("fedreg_cnn", 10), lr=0.2, clip_norm=None, local_epochs=5,
                                batch_size=20)
    res = bf.simulate(algo, fed, rounds=repeats + 1, clients_per_round=10, key=jax.random.PRNGKey(0),
                      client_weights="uniform", evaluate_local=False, clients_per_chunk=clients_per_chunk)
    return min(res.metrics["seconds"][1:])  # round 1 includes compilation


def main(argv):
    del argv
    import jax
    from jax import lax
    from bfedjax.models import conv
    rows = [("CNN step in a scan, lax autodiff", step_in_scan(lax.conv_general_dilated, FLAGS.repeats)),
            ("CNN step in a scan, loop_friendly_conv (custom VJP)",
             step_in_scan(with_lax_signature(conv.loop_friendly_conv), FLAGS.repeats)),
            ("CNN step in a scan, matmul_conv (im2col)", step_in_scan(with_lax_signature(conv.matmul_conv), FLAGS.repeats)),
            *((f"CNN2 evaluation, 10,000 images in batches of {b}, {name}", evaluation(impl, b, FLAGS.repeats))
              for b in (1000, 250) for name, impl in (("zoo dispatcher (lax conv)", conv.conv_general_dilated),
                                                      ("matmul_conv", with_lax_signature(conv.matmul_conv)))),
            ("FedAvg round, 10 clients vmapped", fedavg_round(None, FLAGS.repeats)),
            ("FedAvg round, clients_per_chunk=1", fedavg_round(1, FLAGS.repeats))]
    print(f"device: {jax.devices()[0].device_kind}\n\n| measurement | seconds |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    errors.run(main)
