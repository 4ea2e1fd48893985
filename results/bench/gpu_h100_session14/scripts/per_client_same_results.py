"""Three rounds of FedAvg, FOLA, BFL and FedProx (E = 2) on digits (8 clients, Dirichlet 0.5), server states saved to the .npz named: run it in two checkouts (e.g. before and after a change) and compare the files with numpy.array_equal. PYTHONPATH=<checkout> python per_client_same_results.py out.npz"""
import sys, time, numpy as np, jax
import bfedjax as bf
print(bf.__file__)
data = bf.data.load("digits")
parts = bf.data.partition(data.y_train, "dirichlet_per_class", 8, seed=0, alpha=0.5)
fed = bf.data.stack_clients(data.x_train, data.y_train, parts, x_test=data.x_test, y_test=data.y_test, num_classes=10)
out = {}
for name in ("fedavg", "fola", "bfl", "fedprox"):
    model = bf.models.get_model("mlp", 10, hidden=(32,))
    algo = bf.algorithms.build(name, model, fed, batch_size=16, **({"local_epochs": 2} if name == "fedprox" else {}))
    t = time.perf_counter()
    res = bf.simulate(algo, fed, rounds=3, key=jax.random.PRNGKey(1))
    print(name, f"{time.perf_counter()-t:.2f}s", res.metrics["global_accuracy"][-1])
    for i, leaf in enumerate(jax.tree.leaves(res.state.server)):
        out[f"{name}_{i}"] = np.asarray(leaf)
np.savez(sys.argv[1], **out)
