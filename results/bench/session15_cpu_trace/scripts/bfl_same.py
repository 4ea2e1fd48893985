"""BFL variants, 2 rounds on digits; server leaves saved to the .npz named (compare across checkouts with compare_npz.py).
PYTHONPATH=<checkout> python bfl_same.py OUT.npz [VARIANT,...] (default: all four)"""
import sys, time, numpy as np, jax
import bfedjax as bf
print(bf.__file__)
data = bf.data.load("digits")
parts = bf.data.partition(data.y_train, "dirichlet_per_class", 6, seed=0, alpha=0.5)
fed = bf.data.stack_clients(data.x_train, data.y_train, parts, x_test=data.x_test, y_test=data.y_test, num_classes=10)
out = {}
variants = {"mlp_flipout": ("mlp", {}), "mlp_lrt_biases": ("mlp", {"gradient_estimator": "local_reparameterization", "variational_biases": True}),
            "mlp_reparam": ("mlp", {"gradient_estimator": "reparameterization"}), "resnet20": ("resnet20", {})}
chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else list(variants)
for name, (m, kw) in ((n, variants[n]) for n in chosen):
    model = bf.models.get_model(m, 10, **({"hidden": (32,)} if m == "mlp" else {}))
    algo = bf.algorithms.build("bfl", model, fed, batch_size=32, **kw)
    t = time.perf_counter()
    res = bf.simulate(algo, fed, rounds=2, key=jax.random.PRNGKey(1))
    print(name, f"{time.perf_counter()-t:.2f}s", res.metrics["global_accuracy"][-1], flush=True)
    for i, leaf in enumerate(jax.tree.leaves(res.state.server)):
        out[f"{name}_{i}"] = np.asarray(leaf)
np.savez(sys.argv[1], **out)
