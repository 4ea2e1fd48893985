"""Local SGD steps of MobileNetV3-Small (64 images of 28x28 resized to 64x64 inside the model) in a scan, one
client and two vmapped clients, with the depthwise convolutions as shifted slices (the CPU default) or as XLA's
grouped convolution (``--lax``). Output: depthwise_step.txt beside this file, from

    python results/fedref_mobilenet_check/depthwise_step.py && python results/fedref_mobilenet_check/depthwise_step.py --lax
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bfedjax.models import conv, get_model, init_params
from bfedjax.models.apply import train_apply_fn_of

if "--lax" in sys.argv:
    conv.SHIFTED_DEPTHWISE_PLATFORMS = ()
model = get_model("mobilenet_v3_small", 10)
variables = init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
train = train_apply_fn_of(model)
B, STEPS = 64, 4


def loss(p, x, y):
    logits, updated = train(p, x, jnp.ones(B), jax.random.PRNGKey(0))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated


def client(p, xs, ys):
    def step(p, batch):
        (value, updated), g = jax.value_and_grad(loss, has_aux=True)(p, *batch)
        return jax.tree.map(lambda a, d: a - 0.01 * d, updated, g), value
    return jax.lax.scan(step, p, (xs, ys))


for clients in (1, 2):
    x = jnp.asarray(np.random.default_rng(0).uniform(size=(clients, STEPS, B, 28, 28, 1)), jnp.float32)
    y = jnp.zeros((clients, STEPS, B), jnp.int32)
    rounds = jax.jit(jax.vmap(client, in_axes=(None, 0, 0)))
    jax.block_until_ready(rounds(variables, x, y))
    start = time.perf_counter()
    jax.block_until_ready(rounds(variables, x, y))
    seconds = time.perf_counter() - start
    print(f"{'lax grouped' if '--lax' in sys.argv else 'shifted slices'}: {clients} client(s), {STEPS} steps of "
          f"{B} images: {seconds:.2f} s, {seconds / STEPS:.3f} s a step", flush=True)
