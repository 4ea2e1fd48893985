"""FedReg's ResNet-9 with Fixup (``models.fixup``): counts, the spec's initialisation, and the forward and
backward pass against a PyTorch network written here from the spec's layer list (``fedreg.md`` section 5.1)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bfedjax as bf
from bfedjax.models import FixupResNet9, get_model, init_params, num_params
from bfedjax.models.fixup import fixup_resnet9_param_count


@pytest.mark.parametrize("classes,expected", [
    # convs 1,728 + 73,728 + 2 x 147,456 + 294,912 + 1,179,648 + 2 x 2,359,296 = 6,563,520; 23 scalars;
    # dense 512 x K + K
    (10, 6_563_520 + 23 + 5_130),
    (100, 6_563_520 + 23 + 51_300),
])
def test_parameter_count(classes, expected):
    model = get_model("resnet9_fixup", classes)
    params = jax.eval_shape(lambda k: init_params(model, (32, 32, 3), k), jax.random.PRNGKey(0))
    assert num_params(params) == fixup_resnet9_param_count(classes) == expected
    assert params["layer3"]["block0"]["conv2"]["kernel"].shape == (3, 3, 512, 512)
    assert "layer2" in params and "block0" not in params["layer2"]  # layer 2 has no block
    assert params["linear"]["kernel"].shape == (512, classes) and params["bias2"].shape == (1,)


@pytest.fixture(scope="module")
def initial():
    return init_params(FixupResNet9(num_classes=10), (32, 32, 3), jax.random.PRNGKey(0))


def test_fixup_initialisation(initial):
    p = jax.tree.map(np.asarray, initial)
    for name, features in (("prep", 64), ("layer1", 128), ("layer2", 256), ("layer3", 512)):
        kernel = p[name]["conv"]["kernel"]
        assert abs(kernel.std() / math.sqrt(2 / (features * 9)) - 1) < 0.05, name  # He fan-out normal
        assert abs(kernel.mean()) < 0.1 * kernel.std()
        assert (p[name]["bias1a"], p[name]["bias1b"], p[name]["scale"]) == (0, 0, 1)
    for name, features in (("layer1", 128), ("layer3", 512)):
        block = p[name]["block0"]
        std = block["conv1"]["kernel"].std()
        assert abs(std / (math.sqrt(2 / (features * 9)) / math.sqrt(2)) - 1) < 0.05  # times num_layers ** -0.5
        assert not block["conv2"]["kernel"].any()  # the residual branch starts at zero
        assert [float(block[s][0]) for s in ("bias1a", "bias1b", "bias2a", "scale", "bias2b")] == [0, 0, 0, 1, 0]
    assert not p["linear"]["kernel"].any() and not p["linear"]["bias"].any() and p["bias2"] == 0
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 32, 3))
    logits = jax.jit(FixupResNet9().apply)({"params": initial}, x)  # jitted: one compile, not one per operation
    np.testing.assert_array_equal(logits, 0)  # zero logits at the start


def _torch_reference(p):
    """The spec's network in PyTorch (NCHW); ``p`` is the Flax pytree with torch tensors as leaves (HWIO kernels)."""
    conv = lambda x, kernel: F.conv2d(x, kernel.permute(3, 2, 0, 1), padding=1)  # noqa: E731

    def layer(x, q, pool):
        x = F.relu(conv(x + (q["bias1a"]), q["conv"]["kernel"]) * (q["scale"]) + (q["bias1b"]))
        return F.max_pool2d(x, 2) if pool else x

    def block(x, q):
        y = F.relu(conv(x + (q["bias1a"]), q["conv1"]["kernel"]) + (q["bias1b"]))
        y = conv(y + (q["bias2a"]), q["conv2"]["kernel"]) * (q["scale"]) + (q["bias2b"])
        return F.relu(y + x)

    def forward(x):  # x [B, 3, 32, 32]
        x = layer(x, p["prep"], pool=False)
        x = block(layer(x, p["layer1"], pool=True), p["layer1"]["block0"])
        x = layer(x, p["layer2"], pool=True)
        x = block(layer(x, p["layer3"], pool=True), p["layer3"]["block0"])
        x = F.max_pool2d(x, 4).flatten(1) + (p["bias2"])
        return x @ (p["linear"]["kernel"]) + (p["linear"]["bias"])

    return forward


def test_forward_and_gradients_match_the_spec_in_pytorch(initial):
    """Every parameter perturbed off its Fixup start (zero branches and head would hide the layer order)."""
    leaves, tree = jax.tree.flatten(initial)
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    params = jax.tree.unflatten(tree, [
        leaf + (0.3 if leaf.size == 1 else 0.02) * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)])
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (2, 32, 32, 3)))
    model = FixupResNet9(num_classes=10)
    def loss(q):
        logits = model.apply({"params": q}, x)
        return jnp.sum(jnp.sin(logits)), logits

    # the logits and the gradient from one jitted program: one compile, not one per operation
    grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params)

    torch_params = jax.tree.map(lambda a: torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True),
                                params)
    reference = _torch_reference(torch_params)(torch.tensor(x, dtype=torch.float64).permute(0, 3, 1, 2))
    torch.sin(reference).sum().backward()
    scale = float(reference.detach().abs().max())
    assert scale > 0.1
    np.testing.assert_allclose(np.asarray(logits), reference.detach().numpy(), atol=2e-4 * scale)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        want = _leaf(torch_params, path).grad.numpy()
        np.testing.assert_allclose(np.asarray(g), want, atol=2e-3 * np.abs(want).max() + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_a_fedreg_round_trains_every_layer():
    """FedReg takes the model (no BatchNorm) and two local steps reach every layer: the first moves only the
    zero-initialised head, whose gradient then reaches the convolutions and scalars."""
    rng = np.random.default_rng(0)
    labels = np.arange(4) % 2
    images = (rng.normal(size=(4, 32, 32, 3)) * 0.5 + labels[:, None, None, None]).astype(np.float32)
    fed = bf.data.stack_clients(images, labels, [np.arange(2), np.arange(2, 4)], x_test=images, y_test=labels,
                                num_classes=2)
    model = get_model("resnet9_fixup", 2)
    algo = bf.algorithms.build("fedreg", model, fed, lr=0.05, batch_size=1, local_epochs=1, gamma=0.25,
                               eta_s=0.1, eta_p=1e-3).replace(evaluate=None)
    init = init_params(model, (32, 32, 3), jax.random.PRNGKey(0))
    res = bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(1), init_params=init, evaluate_local=False)
    final = res.state.server["params"]
    unchanged = [jax.tree_util.keystr(path) for path, a in jax.tree_util.tree_leaves_with_path(final)
                 if np.array_equal(a, _leaf(init, path))]
    assert not unchanged


def test_inputs_that_are_not_32x32_are_refused():
    with pytest.raises(ValueError, match="32x32"):
        jax.eval_shape(lambda k: init_params(FixupResNet9(), (28, 28, 1), k), jax.random.PRNGKey(0))
