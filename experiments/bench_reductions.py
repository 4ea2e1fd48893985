r"""Sums and the median over model-sized arrays: the library's forms against XLA's plain ones, on this machine.

    python -m experiments.bench_reductions                                   # about a minute on 2 CPU cores
    python -m experiments.bench_reductions --output=results/bench/reductions.md

The library sums a training step's model-sized arrays with ``tree.row_sums``: on a CPU a matrix-vector
product with a vector of ones, which XLA fuses with the array's producer, where XLA:CPU would emit a
tree reduction that reads a transposed weight gradient or a flag array slowly. This script times, in a
jitted loop of ``--steps`` iterations on the MLP 784-200-200-10 (``--batch_size`` random images), each
sum in the library's form and in the plain ``jnp.sum`` form:

  * clip norm: FOLA's local step (``algorithms.local_sgd``: clipped to global norm 10, the gradient plus
    the prior pull, and the Fisher), its clip norm by ``tree.tree_squared_norm`` or by ``jnp.sum`` (the
    library's function swapped for the plain one while the loop is traced);
  * Adam's clip norm: FedAvg's local Adam steps (clip norm 10), clipped by ``local_sgd.clip_by_global_norm``
    (``tree.tree_squared_norm``) or by ``optax.clip_by_global_norm`` (swapped in while the client is built);
  * DP-SGD step: ``privacy.dp.private_gradient`` against the same maths with ``jnp.sum`` for the
    per-example norms and the clipped sum;
  * finite check: a FOLA round (100 clients in turn, B = 50), each client's message checked by
    ``core.finite.finite_rows`` or with ``jnp.all(jnp.isfinite(...))`` per leaf, the two rounds taken in turn;
  * median: of the MLP's 199,210 precisions (FOLA's ``precision_median`` diagnostic, on by default), by
    ``order_statistics.median`` (no sort) or ``jnp.median`` (XLA's sort), alone and in FOLA's round as
    above with its diagnostics on;
  * column count: per coordinate of 100 clients' MLPs, how many clients lie below a threshold (a pass of
    ``order_statistics``' bisection), a row at a time (``tree.sum_over_rows``) or as the ``[C]`` ones times
    the materialised mask (``tree.weighted_sum``'s matrix-vector product);
  * robust rules: the coordinate-wise median and trimmed mean of 100 clients' MLPs, and the robust Gaussian
    product (``posteriors.robust``, on ``order_statistics``' column statistics and sums a row at a time)
    against the same through a sort (the product: its former argsorts and sums over the client axis).

Prints the fastest of ``--repeats`` runs (per iteration; per round for the finite check) and the
speed-up; on a GPU both forms are ``jnp.sum`` (``row_sums`` keeps the product for CPUs).
"""
from __future__ import annotations

import contextlib
import sys
import time
from unittest import mock

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 20, "Iterations of each jitted loop.")
flags.DEFINE_integer("repeats", 5, "Timed runs of each loop (the fastest reported).")
flags.DEFINE_integer("batch_size", 10, "Images per step.")
flags.DEFINE_integer("robust_clients", 100, "Clients of the robust rules' rows (each an MLP 784-200-200-10).")
flags.DEFINE_integer("fola_clients", 100, "Clients of the FOLA rounds' rows (100 images each, B = 50).")
flags.DEFINE_string("output", None, "Also write the markdown table to this file.")
for _name in ("steps", "repeats", "batch_size", "robust_clients", "fola_clients"):
    flags.register_validator(_name, lambda v: v >= 1, message=f"--{_name} must be >= 1")


def plain_squared_norm(tree):
    """``sum`` of every leaf's squares with ``jnp.sum`` (XLA's reduction)."""
    import jax
    import jax.numpy as jnp
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def plain_private_gradient(apply_fn, params, batch, key, clip_norm: float, noise_multiplier: float):
    """``privacy.dp.private_gradient``'s maths with ``jnp.sum`` for the per-example norms and the clipped sum."""
    import jax
    import jax.numpy as jnp
    from bfedjax.laplace.fisher import per_example_grads
    from bfedjax.privacy.dp import clip_factors, gaussian_like
    losses, grads = per_example_grads(apply_fn, params, batch)
    norms = jnp.sqrt(sum(jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1) for g in jax.tree.leaves(grads)))
    factor = clip_factors(norms, clip_norm)
    total = jax.tree.map(lambda g: jnp.sum(g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), grads)
    total = jax.tree.map(jnp.add, total, gaussian_like(total, key, noise_multiplier * clip_norm))
    n = jnp.maximum(jnp.sum(batch.mask), 1.0)
    return jnp.sum(losses * batch.mask) / n, jax.tree.map(lambda g: g / n, total)


def plain_finite_rows(tree, slots: int):
    """``core.finite.finite_rows`` with ``jnp.all(jnp.isfinite(...))`` per leaf."""
    import jax
    import jax.numpy as jnp
    rows = [jnp.all(jnp.isfinite(jnp.reshape(x, (slots, -1))), axis=1) for x in jax.tree.leaves(tree)]
    return jnp.sum(jnp.stack(rows, axis=1).astype(jnp.float32), axis=1) == len(rows)


def sorted_robust_product(stacked, weights, mask, trim: float, precision_cap: float):
    """``posteriors.robust.robust_product`` through stable argsorts over the client axis and sums over it (its
    form before ``order_statistics``), for ``[C, P]`` means and precisions."""
    import jax.numpy as jnp
    from bfedjax.posteriors import DiagGaussian
    from bfedjax.posteriors.robust import trimmed_count
    real = (mask > 0)[:, None]
    k = jnp.sum(mask > 0).astype(jnp.int32)
    drop = trimmed_count(k, trim)
    rank = jnp.argsort(jnp.argsort(jnp.where(real, stacked.mean, jnp.inf), axis=0, stable=True), axis=0, stable=True)
    kept = real & (rank >= drop) & (rank < k - drop)
    lam = jnp.minimum(stacked.precision, precision_cap * jnp.median(stacked.precision, axis=0)[None])
    wk = jnp.where(kept, weights[:, None], 0.0)
    wk = wk / jnp.maximum(jnp.sum(wk, axis=0, keepdims=True), 1e-30)
    precision = jnp.sum(wk * lam, axis=0)
    return DiagGaussian(jnp.sum(wk * lam * jnp.where(kept, stacked.mean, 0.0), axis=0) / precision, precision)


def loops(model, params, batch):
    """``{sum: (library loop, plain loop)}``, each ``(params, key) -> params`` jitted over ``--steps`` iterations."""
    import jax
    import jax.numpy as jnp
    from bfedjax.models import apply_fn_of
    import optax
    from bfedjax.algorithms import fedavg, fola, local_sgd
    from bfedjax.core import ClientContext, ClientData
    from bfedjax.core.simulate import traced_hparams
    from bfedjax.privacy.dp import private_gradient
    from bfedjax.tree import tree_squared_norm

    def local_steps(algorithm, server, swap=None):
        """``(params, key) -> params``: ``--steps`` of ``algorithm``'s local steps on ``batch`` from ``server``
        (the loop's ``params`` argument is unused); ``swap`` (a ``mock.patch``) is active while it is traced."""
        data = ClientData(batch.x, batch.y, jnp.int32(batch.x.shape[0]))
        ctx = ClientContext(server, (), data, traced_hparams(algorithm, 2))

        def run(params, key):
            with swap or contextlib.nullcontext():
                local = algorithm.client_init(ctx, key)
                step = lambda i, local: algorithm.client_step(local, batch, ctx, jax.random.fold_in(key, i))
                return jax.lax.fori_loop(0, FLAGS.steps, step, local).params
        return run

    def clip_loop(squared_norm):
        """FOLA's local steps (``local_sgd``: clip norm 10 of the gradient plus the prior pull), its clip norm
        summed by ``squared_norm``."""
        algorithm = fola(model, lr=0.01, lam=100.0, precision_diagnostics=False)
        server = {"params": params, "precision": jax.tree.map(jnp.ones_like, params)}
        return local_steps(algorithm, server, mock.patch.object(local_sgd, "tree_squared_norm", squared_norm))

    def adam_loop(clip):
        """FedAvg's local Adam steps (``local_sgd``'s stateful path, clip norm 10), clipped by ``clip``."""
        with mock.patch.object(local_sgd, "clip_by_global_norm", clip):  # read when the client is built
            algorithm = fedavg(model, lr=0.001, optimizer="adam")
        return local_steps(algorithm, algorithm.server_init(params))

    def dp_loop(gradient):
        def step(i, params, key):
            _, grad = gradient(apply_fn, params, batch, jax.random.fold_in(key, i), clip_norm=1.0, noise_multiplier=1.0)
            return jax.tree.map(lambda t, g: t - 0.01 * g, params, grad)
        return lambda params, key: jax.lax.fori_loop(0, FLAGS.steps, lambda i, p: step(i, p, key), params)

    apply_fn = apply_fn_of(model)
    return {"clip norm (SGD step, FOLA's pull)": (clip_loop(tree_squared_norm), clip_loop(plain_squared_norm)),
            "clip norm (Adam step, FedAvg; against optax.clip_by_global_norm)": (
                adam_loop(local_sgd.clip_by_global_norm), adam_loop(optax.clip_by_global_norm)),
            "DP-SGD step": (dp_loop(private_gradient), dp_loop(plain_private_gradient))}


def fola_round_ms(fed_images, swap, diagnostics: bool = False) -> tuple[float, float]:
    """``(library, plain)``: FOLA's default-layout round (``--fola_clients`` x 100 images, B = 50, in turn on every
    core; ``diagnostics``: with its per-round precision diagnostics, the default), compiled as it is and with
    ``swap`` (a ``mock.patch`` of the library's form by the plain one) active, the two rounds taken in turn;
    fastest of ``--repeats`` ms each."""
    import bfedjax as bf
    from experiments import bench
    config = bench.Config(f"mlp K={FLAGS.fola_clients} B=50", "uniform", FLAGS.fola_clients, 50, clients_per_chunk=1)
    fed = bench.federate(fed_images, config)
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    algorithm = bf.algorithms.build("fola", model, fed, batch_size=50, lr=0.01, precision_diagnostics=diagnostics)
    algorithm = algorithm.replace(evaluate=None)  # rounds train only, as in experiments.bench
    devices = bench.default_devices(fed, 1)
    library = bench.prepared_round(algorithm, fed, config, "vmap", True, devices)
    with swap:  # the round is traced and compiled here
        plain = bench.prepared_round(algorithm, fed, config, "vmap", True, devices)
    best = bench.time_in_turn({"library": (algorithm, library), "plain": (algorithm, plain)}, FLAGS.repeats)
    return 1e3 * best["library"], 1e3 * best["plain"]


def fastest_ms(fn, params, key) -> float:
    import jax
    jax.block_until_ready(fn(params, key))  # compile
    best = float("inf")
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, key))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best / FLAGS.steps


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fix: flags take the form --name=value")
    import bfedjax as bf
    devices = bf.core.layout.use_cpu_cores()  # the round's default layout: clients in turn on every core
    import jax
    import jax.numpy as jnp
    from experiments import bench
    model = bf.models.get_model("mlp", 10, hidden=(200, 200))
    params = bf.models.init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
    batch = bf.core.Batch(jax.random.normal(jax.random.PRNGKey(1), (FLAGS.batch_size, 28, 28, 1)),
                          jnp.arange(FLAGS.batch_size) % 10, jnp.ones((FLAGS.batch_size,), jnp.float32))
    device = jax.devices()[0]
    lines = [f"Device: {device.platform} ({device.device_kind}); MLP 784-200-200-10, B = {FLAGS.batch_size}; "
             f"ms per iteration, fastest of {FLAGS.repeats} runs of {FLAGS.steps}.", "",
             "| sum | library (ms) | jnp.sum / jnp.median (ms) | speed-up |", "|---|---|---|---|"]
    for name, (library, plain) in loops(model, params, batch).items():
        fast, slow = (fastest_ms(jax.jit(fn), params, jax.random.PRNGKey(2)) for fn in (library, plain))
        lines.append(f"| {name} | {fast:.3f} | {slow:.3f} | {slow / fast:.2f}x |")
        print(lines[-1], flush=True)
    images, fola_module = bench.load_images(), sys.modules["bfedjax.algorithms.fola"]
    round_name = (f"FOLA round, {FLAGS.fola_clients} clients x 100 images, B = 50, in turn on {devices} devices "
                  "(rounds alternated)")
    # the streamed round calls finite_rows under the name core.engine imported
    fast, slow = fola_round_ms(images, mock.patch.object(bf.core.engine, "finite_rows", plain_finite_rows))
    lines.append(f"| finite check: {round_name} | {fast:.1f} | {slow:.1f} | {slow / fast:.2f}x |")
    print(lines[-1], flush=True)
    precisions = jax.random.lognormal(jax.random.PRNGKey(3), shape=(199_210,))  # the MLP's count
    fast, slow = (fastest_ms(jax.jit(lambda x, _, f=f: f(x)), precisions, None) * FLAGS.steps
                  for f in (bf.order_statistics.median, jnp.median))
    lines.append(f"| median of 199,210 floats (against jnp.median) | {fast:.1f} | {slow:.1f} | {slow / fast:.2f}x |")
    print(lines[-1], flush=True)
    c = FLAGS.robust_clients
    clients = jax.random.normal(jax.random.PRNGKey(4), (c, 199_210))  # the clients' MLPs
    everyone, trimmed = jnp.ones((c,)), int(0.1 * c)
    fast, slow = (fastest_ms(jax.jit(f), clients, clients[0]) * FLAGS.steps for f in (
        lambda x, t: bf.tree.sum_over_rows(lambda i: (x[i] < t).astype(jnp.int32), x.shape[0]),
        lambda x, t: bf.tree.weighted_sum((x < t[None]).astype(jnp.float32), jnp.ones((x.shape[0],)))))
    lines.append(f"| column count below a threshold, {c} clients x 199,210 coordinates (rows streamed; against the "
                 f"mask's matrix-vector product) | {fast:.1f} | {slow:.1f} | {slow / fast:.2f}x |")
    print(lines[-1], flush=True)
    for name, ours, sorted_form in (
            ("median", bf.posteriors.robust.coordinate_median, lambda x, m: jnp.median(x, axis=0)),
            ("trimmed mean (trim 0.1)", lambda x, m: bf.posteriors.robust.trimmed_mean(x, m, 0.1),
             lambda x, m: jnp.mean(jnp.sort(x, axis=0)[trimmed:c - trimmed], axis=0))):
        fast, slow = (fastest_ms(jax.jit(lambda x, m, f=f: f(x, m)), clients, everyone) * FLAGS.steps
                      for f in (ours, sorted_form))
        lines.append(f"| robust {name} of {c} clients x 199,210 coordinates (against the sort) | {fast:.0f} | "
                     f"{slow:.0f} | {slow / fast:.2f}x |")
        print(lines[-1], flush=True)
    posteriors = bf.posteriors.DiagGaussian(clients, jnp.abs(clients) + 0.5)
    fast, slow = (fastest_ms(jax.jit(lambda g, w, f=f: f(g, w, everyone, trim=0.2, precision_cap=3.0)), posteriors,
                             everyone / c) * FLAGS.steps
                  for f in (bf.posteriors.robust.robust_product, sorted_robust_product))
    lines.append(f"| robust product (trim 0.2, precision cap 3) of {c} clients x 199,210 coordinates (against "
                 f"argsorts) | {fast:.0f} | {slow:.0f} | {slow / fast:.2f}x |")
    print(lines[-1], flush=True)
    fast, slow = fola_round_ms(images, mock.patch.object(fola_module, "median", jnp.median), diagnostics=True)
    lines.append(f"| median: {round_name}, precision diagnostics on (FOLA's default) | {fast:.1f} | {slow:.1f} | "
                 f"{slow / fast:.2f}x |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            f.write(f"`python -m experiments.bench_reductions {' '.join(sys.argv[1:])}`\n\n" + text)


if __name__ == "__main__":
    app.run(main)
