"""Three FOLA laplace="full" offline rounds (E = 15, as iv-e-laplace-steps) through simulate: seconds per round and GA.
Run from the repository root (or with PYTHONPATH at another checkout): python results/fola_iv_e_laplace_scripts/full_rounds.py"""
import time, jax, numpy as np, bfedjax as bf
data = bf.data.load("mnist_5k")
parts = bf.data.partition(data.y_train, "class_groups", 2, groups=[[0,1,2,3,4],[5,6,7,8,9]], seed=0)
fed = bf.data.stack_clients(data.x_train, data.y_train, parts, x_test=data.x_test, y_test=data.y_test, num_classes=10)
model = bf.models.get_model("logistic", 10)
algo = bf.algorithms.fola(model, lr=0.01, lam=1.0, batch_size=200, local_epochs=15, laplace="full", fisher="offline", eps=1e-5, profile="paper")
r = bf.simulate(algo, fed, rounds=3, key=jax.random.PRNGKey(0), clients_per_round=2)
print("seconds", np.round(r.metrics["seconds"], 2), "GA", np.round(r.metrics["global_accuracy"], 4))
