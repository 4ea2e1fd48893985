"""Two rounds each of the algorithms whose clients draw noise (BFL with Flipout and with local reparameterisation,
HBFL with ``rho_init_std``, FedAvg with DP-SGD), on 400 digits over 4 clients; saves every server leaf to OUT.npz.
Run it with two trees of the library and compare (``--compare A.npz B.npz``), e.g. before and after the flat draws:

    PYTHONPATH=$BEFORE python results/bench/session31_scanned_blocks/scripts/same_rounds.py /tmp/before.npz
    PYTHONPATH=. python results/bench/session31_scanned_blocks/scripts/same_rounds.py /tmp/after.npz
    python results/bench/session31_scanned_blocks/scripts/same_rounds.py --compare /tmp/before.npz /tmp/after.npz
"""
import sys

import numpy as np


def save(path):
    import jax

    import bfedjax as bf
    data = bf.data.load("digits")
    fed = bf.data.from_partition(data, bf.data.partition(data.y_train[:400], "iid", 4, seed=0))
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    algorithms = {
        "bfl_flipout": bf.algorithms.build("bfl", model, fed, batch_size=32),
        "bfl_lr": bf.algorithms.build("bfl", model, fed, batch_size=32, gradient_estimator="local_reparameterization"),
        "hbfl": bf.algorithms.build("hbfl", model, fed, batch_size=32, local_epochs=1, rho_init_std=0.1),
        "fedavg_dp": bf.algorithms.build("fedavg", model, fed, batch_size=32, dp_clip=1.0, dp_noise=1.0),
    }
    leaves = {}
    for name, algorithm in algorithms.items():
        result = bf.simulate(algorithm.replace(evaluate=None), fed, rounds=2, key=jax.random.PRNGKey(0),
                             evaluate_local=False)
        for i, leaf in enumerate(jax.tree.leaves(result.state.server)):
            leaves[f"{name}/{i}"] = np.asarray(leaf)
    np.savez(path, **leaves)
    print(len(leaves), "leaves saved")


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    assert sorted(a.files) == sorted(b.files), "different algorithms or trees"
    same = sum(np.array_equal(a[k], b[k]) for k in a.files)
    print(f"{same} of {len(a.files)} leaves bitwise equal")


if __name__ == "__main__":
    compare(*sys.argv[2:4]) if sys.argv[1] == "--compare" else save(sys.argv[1])
