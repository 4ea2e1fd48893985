"""How far HBFL's meme scales move in a round, in the setting of ``results/hbfl_fashion_mnist.md``.

    python results/hbfl_meme_precision/measure.py > results/hbfl_meme_precision/measure.txt

The table's split (Fashion-MNIST, 10,000 training images, 10 clients, Dirichlet alpha per class, E = 1, B = 128,
meme CNN2, Adam 1e-3, T = 1e-4, rho reset to -5 every round), its ``bayes_only`` HBFL (the meme's objective does
not read the local model, so its uploads are the hetero runs' for the same global mean). For each client of a
split: n_k, its local steps, and its uploaded precision lambda_k = 1 / sigma_k^2 relative to the initial
1 / softplus(-5)^2 (median and the 5th / 95th percentiles over the weights), at round 1 and at round 6 (from the
server state after 5 rounds); then each client's share of the product's weights q_k * lambda_k (q_k = n_k / n),
the mean over coordinates, against n_k / n (lambda constant) and n_k^2 / sum n^2 (lambda proportional to n_k).
"""
import jax
import jax.numpy as jnp
import numpy as np

from experiments import hbfl_table

hbfl_table.FLAGS(["measure"])
import bfedjax as bf  # noqa: E402
from bfedjax.core import ClientContext, ClientData, local_training  # noqa: E402
from bfedjax.core.simulate import traced_hparams  # noqa: E402

SPLITS = [(0.1, 1), (0.05, 0)]  # the two seeds with the largest best-GA gaps of q_k = n_k / n below q_k = 1


def uploads(algo, fed, server, round_index):
    """``[(n_k, steps_k, lambda_k / lambda_0 over every weight)]`` of every client trained from ``server``."""
    lambda_0 = 1.0 / float(jax.nn.softplus(-5.0)) ** 2
    out = []
    for k in range(fed.num_clients):
        ctx = ClientContext(server, (), ClientData(jnp.asarray(fed.x[k]), jnp.asarray(fed.y[k]),
                                                   jnp.int32(fed.counts[k])), traced_hparams(algo, round_index))
        message = local_training(algo, ctx, jax.random.PRNGKey(100 + k))[0]
        scale = np.concatenate([np.ravel(s) for s in jax.tree.leaves(message["scale"])])
        out.append((int(fed.counts[k]), -(-int(fed.counts[k]) // algo.batch_size) * algo.local_epochs,
                    1.0 / scale ** 2 / lambda_0))
    return out


def main():
    data = bf.data.load("fashion_mnist", max_train=10_000, seed=0)
    for alpha, seed in SPLITS:
        fed = hbfl_table.federation(data, alpha, seed)
        algo, _, _ = hbfl_table.build("bayes_only", "hbfl", fed, data.num_classes)
        first = algo.server_init(algo.init_params(jax.random.PRNGKey(seed), fed.input_shape))
        later = bf.simulate(algo, fed, rounds=5, key=jax.random.PRNGKey(seed), evaluate_local=False,
                            clients_per_chunk=1).state.server
        for round_index, server in ((1, first), (6, later)):
            rows = uploads(algo, fed, server, round_index)
            n = np.array([r[0] for r in rows], np.float64)
            mean_lambda = np.array([r[2].mean() for r in rows])
            share = n * mean_lambda / np.sum(n * mean_lambda)
            print(f"alpha {alpha:g}, seed {seed}, round {round_index}")
            print("  n_k    steps  lambda/lambda_0: p5    median  p95    | share of q*lambda  n_k/n   n_k^2/sum n^2")
            for (nk, steps, rel), s in sorted(zip(rows, share), key=lambda t: -t[0][0]):
                p5, med, p95 = np.percentile(rel, [5, 50, 95])
                print(f"  {nk:5d}  {steps:5d}  {p5:20.3f}  {med:6.3f}  {p95:6.3f} | {s:17.3f}  "
                      f"{nk / n.sum():6.3f}  {nk ** 2 / np.sum(n ** 2):6.3f}")


if __name__ == "__main__":
    main()
