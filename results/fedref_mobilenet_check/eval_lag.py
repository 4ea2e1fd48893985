"""MobileNetV3-Small trained alone (no federation) on the 4,000 MNIST-5k training digits, SGD, batches of 64, in
training mode; after every epoch the test accuracy in inference mode (BatchNorm's running statistics, PyTorch's
momentum 0.01). eval_lag.txt beside this file is the output of

    python results/fedref_mobilenet_check/eval_lag.py mobilenet_v3_small 0.01 16

stopped after epoch 13 (0-based) to free the machine. Columns: epoch, the mean loss of its first and last five
batches, the test accuracy.
"""
import time, sys, jax, jax.numpy as jnp, numpy as np, optax
import bfedjax as bf
from bfedjax.models import get_model, init_params
from bfedjax.models.apply import train_apply_fn_of, apply_fn_of
d = bf.data.load("mnist_5k")
model = get_model(sys.argv[1], 10)
v = init_params(model, d.x_train.shape[1:], jax.random.PRNGKey(0))
train = train_apply_fn_of(model); apply = apply_fn_of(model)
lr = float(sys.argv[2]); B = 64
def loss(p, xb, yb):
    logits, new = train(p, xb, jnp.ones(B), jax.random.PRNGKey(0))
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), new
@jax.jit
def step(p, xb, yb):
    (l, new), g = jax.value_and_grad(loss, has_aux=True)(p, xb, yb)
    return jax.tree.map(lambda a, d: a - lr * d, new, g), l
@jax.jit
def acc(p):
    return jnp.mean(jnp.argmax(apply(p, d.x_test), -1) == d.y_test)
rng = np.random.default_rng(0)
for epoch in range(int(sys.argv[3])):
    perm = rng.permutation(len(d.y_train)); ls = []
    for i in range(len(perm) // B):
        idx = perm[i*B:(i+1)*B]
        v, l = step(v, d.x_train[idx], d.y_train[idx]); ls.append(float(l))
    print(epoch, "train loss", np.mean(ls[:5]), np.mean(ls[-5:]), "test acc (eval mode)", float(acc(v)), flush=True)
