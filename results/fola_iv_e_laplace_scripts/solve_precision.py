"""float32 against float64: the full-Hessian product's solve (FOLA laplace="full", offline, 2 digit clients {0-4}/{5-9},
softmax regression, 3 local epochs). Run from the repository root: python results/fola_iv_e_laplace_scripts/solve_precision.py"""
import jax, jax.numpy as jnp, numpy as np, bfedjax as bf
from jax.flatten_util import ravel_pytree
from bfedjax.core import ClientContext, ClientData, local_training
from bfedjax.core.simulate import traced_hparams
from bfedjax.models.apply import apply_fn_of
d = bf.data.load("digits")
parts = bf.data.partition(d.y_train, "class_groups", 2, groups=[[0,1,2,3,4],[5,6,7,8,9]], seed=0)
fed = bf.data.stack_clients(d.x_train, d.y_train, parts, x_test=d.x_test, y_test=d.y_test, num_classes=10)
model = bf.models.get_model("logistic", 10); apply = apply_fn_of(model)
params = model.init(jax.random.PRNGKey(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
for eps in (1e-5, 1e-3):
    algo = bf.algorithms.fola(model, lr=0.05, lam=1.0, batch_size=50, local_epochs=3, laplace="full", fisher="offline", eps=eps)
    server = algo.server_init(params); msgs = []
    for c in (0, 1):
        data = ClientData(jnp.asarray(fed.x[c]), jnp.asarray(fed.y[c]), jnp.int32(fed.counts[c]))
        msgs.append(local_training(algo, ClientContext(server, (), data, traced_hparams(algo, 1)), jax.random.PRNGKey(c))[0])
    w = [0.51, 0.49]
    stats = jax.tree.map(lambda a, b: w[0] * a + w[1] * b, *[algo.client_stats(m) for m in msgs])
    new, _ = algo.server_from_stats(server, stats, jnp.ones(2), {}, None)
    eta, P = (np.asarray(s, np.float64) for s in stats)
    m64 = np.linalg.solve(P + eps * np.eye(len(eta)), eta)
    unravel = ravel_pytree(params)[1]
    acc = lambda p: float(np.mean(np.argmax(apply(p, jnp.asarray(d.x_test)), -1) == d.y_test))
    m32 = np.asarray(ravel_pytree(new["params"])[0])
    print(f"eps {eps}: cond {np.linalg.cond(P + eps*np.eye(len(eta))):.2e} max|m32-m64| {np.abs(m32-m64).max():.3g} (max|m| {np.abs(m64).max():.3g}); "
          f"acc f32 {acc(new['params']):.4f} f64 {acc(unravel(jnp.asarray(m64, jnp.float32))):.4f}; logits max diff {np.abs(np.asarray(apply(new['params'], jnp.asarray(d.x_test))) - np.asarray(apply(unravel(jnp.asarray(m64, jnp.float32)), jnp.asarray(d.x_test)))).max():.3g}")
