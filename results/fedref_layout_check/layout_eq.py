"""fedref_table's classification runs: one vmap over the clients (clients_per_chunk=None, as the script passed
before session 38) against simulate's default layout ("auto"), LeNet-5 on MNIST-5k nested, 8 rounds, seed 0:
time and the per-round test accuracy."""
import time, jax, numpy as np
import bfedjax as bf
from bfedjax.core.simulate import round_key
data = bf.data.load("mnist_5k", pixels="unit")
model = bf.models.get_model("lenet", 10)
fed = bf.data.from_partition(data, bf.data.partition(data.y_train, "nested", 10, seed=0))
for name, opts in (("fedavg", {"clip_norm": None}), ("fedref", {"variant": "code", "p": 5, "lam": 0.01})):
    algo = bf.algorithms.build(name, model, fed, lr=0.01, batch_size=64, local_epochs=1, **opts)
    key = jax.random.PRNGKey(0)
    init = algo.init_params(round_key(key, 0), fed.input_shape)
    curves = {}
    for layout in (None, "auto"):
        t = time.perf_counter()
        res = bf.simulate(algo, fed, rounds=8, key=key, evaluate_local=False, init_params=init,
                          round_fractions=(0.5, 0.6, 0.7, 0.8, 0.9), clients_per_chunk=layout)
        curves[layout] = np.asarray(res.metrics["global_accuracy"])
        print(f"{name} {str(layout):5s} -> chunk {res.clients_per_chunk}: {time.perf_counter() - t:.1f}s acc {curves[layout]}", flush=True)
    print(f"{name}: largest accuracy difference {np.max(np.abs(curves[None] - curves['auto'])):.4f}")
