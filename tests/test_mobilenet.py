"""MobileNetV3-Small (``models.mobilenet``), FedRef's MNIST model: counts, torchvision's initialisation, and the
forward pass in both BatchNorm modes against a PyTorch network written here from torchvision's layer table.
(``results/fedref_mobilenet_check/`` compares the model with torchvision's own module.)"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bfedjax.models import MobileNetV3Small, get_model, init_params, num_params
from bfedjax.models.apply import apply_fn_of, train_apply_fn_of
from bfedjax.models.mobilenet import make_divisible, mobilenet_v3_small_param_count

# torchvision's mobilenet_v3_small: (kernel, expanded, out, squeeze-excite, hard-swish, stride), after the
# 3x3/2 stem of 16 and before the 1x1 conv to 576
TABLE = [(3, 16, 16, 1, 0, 2), (3, 72, 24, 0, 0, 2), (3, 88, 24, 0, 0, 1), (5, 96, 40, 1, 1, 2), (5, 240, 40, 1, 1, 1),
         (5, 240, 40, 1, 1, 1), (5, 120, 48, 1, 1, 1), (5, 144, 48, 1, 1, 1), (5, 288, 96, 1, 1, 2),
         (5, 576, 96, 1, 1, 1), (5, 576, 96, 1, 1, 1)]


def test_parameter_count_is_torchvisions():
    # torchvision's mobilenet_v3_small has 2,542,856 parameters, 1,615,848 of them in its 576-1024-1000 classifier
    features = 2_542_856 - (576 * 1024 + 1024) - (1024 * 1000 + 1000)
    variables = jax.eval_shape(lambda k: init_params(get_model("mobilenet_v3_small", 10), (28, 28, 1), k),
                               jax.random.PRNGKey(0))
    assert num_params(variables["params"]) == features + 576 * 10 + 10 == 932_778
    assert (num_params(variables["params"]), num_params(variables["batch_stats"])) == mobilenet_v3_small_param_count()
    assert [make_divisible(c // 4) for c in (16, 96, 240, 120, 144, 288, 576)] == [8, 24, 64, 32, 40, 72, 144]


@pytest.fixture(scope="module")
def variables():
    v = init_params(MobileNetV3Small(num_classes=10), (28, 28, 1), jax.random.PRNGKey(0))
    return jax.tree.map(np.asarray, v)


@pytest.fixture(scope="module")
def infer():
    """The inference forward, jitted once for the module: its 4 x 28 x 28 x 1 program serves two tests."""
    return jax.jit(apply_fn_of(MobileNetV3Small(num_classes=10)))


def test_torchvision_initialisation(variables):
    kernels = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
               if jax.tree_util.keystr(path).endswith("['kernel']") and leaf.ndim == 4]
    assert len(kernels) == 52
    for path, kernel in kernels:  # N(0, 2 / fan_out), fan_out = out_channels * kh * kw
        fan_out = kernel.shape[0] * kernel.shape[1] * kernel.shape[3]
        assert abs(kernel.std() / math.sqrt(2 / fan_out) - 1) < 0.15, jax.tree_util.keystr(path)
    big = variables["params"]["bneck9"]["expand"]["Conv_0"]["kernel"]  # 55,296 draws: not truncated at 2 sigma
    assert abs(big.std() / math.sqrt(2 / 576) - 1) < 0.02 and np.abs(big).max() > 3 * math.sqrt(2 / 576)
    head = variables["params"]["classifier"]
    bound = 1 / math.sqrt(576)  # a fresh torch.nn.Linear(576, 10)
    assert np.abs(head["kernel"]).max() <= bound and np.abs(head["kernel"]).max() > 0.9 * bound
    assert np.abs(head["bias"]).max() <= bound
    bn = variables["params"]["stem"]["BatchNorm_0"]
    assert (bn["scale"] == 1).all() and (bn["bias"] == 0).all()


def _torch_reference(params, stats, x, train, running_means=None):
    """torchvision's forward in PyTorch (NCHW, float64), weights from the Flax trees. In training mode the
    running means after the batch (PyTorch's momentum 0.01) are appended to ``running_means``, in layer order."""
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731

    def conv_bn(x, p, s, stride=1, groups=1, act=None):
        kernel = t(p["Conv_0"]["kernel"]).permute(3, 2, 0, 1)
        x = F.conv2d(x, kernel, stride=stride, padding=(kernel.shape[-1] - 1) // 2, groups=groups)
        bn, st = p["BatchNorm_0"], s["BatchNorm_0"]
        mean = t(st["mean"])
        x = F.batch_norm(x, mean, t(st["var"]), t(bn["scale"]), t(bn["bias"]), training=train, momentum=0.01,
                         eps=1e-3)
        if running_means is not None:
            running_means.append(mean.numpy())
        return {None: x, 0: F.relu(x), 1: F.hardswish(x)}[act]

    x = F.interpolate(t(x).permute(0, 3, 1, 2), size=(64, 64), mode="bilinear", align_corners=False)
    x = conv_bn(x.repeat(1, 3, 1, 1), params["stem"], stats["stem"], stride=2, act=1)
    for i, (_, expanded, out, se, hs, stride) in enumerate(TABLE):
        p, s = params[f"bneck{i}"], stats[f"bneck{i}"]
        y = conv_bn(x, p["expand"], s["expand"], act=hs) if expanded != x.shape[1] else x
        y = conv_bn(y, p["depthwise"], s["depthwise"], stride=stride, groups=expanded, act=hs)
        if se:
            fc = lambda z, q: F.conv2d(z, t(q["kernel"]).permute(3, 2, 0, 1), t(q["bias"]))  # noqa: E731
            y = y * F.hardsigmoid(fc(F.relu(fc(y.mean((2, 3), keepdim=True), p["se"]["fc1"])), p["se"]["fc2"]))
        y = conv_bn(y, p["project"], s["project"])
        x = x + y if stride == 1 and x.shape[1] == out else y
    x = conv_bn(x, params["last"], stats["last"], act=1).mean((2, 3))
    return (x @ t(params["classifier"]["kernel"]) + t(params["classifier"]["bias"])).numpy()


def test_forward_matches_torchvisions_layers_in_both_batchnorm_modes(variables, infer):
    rng = np.random.default_rng(0)
    variables = {"params": variables["params"],  # running statistics off their start, so eval mode reads them
                 "batch_stats": jax.tree.map(lambda a: a + rng.uniform(0.1, 0.5, a.shape), variables["batch_stats"])}
    x = rng.uniform(0, 1, (4, 28, 28, 1)).astype(np.float32)
    model = MobileNetV3Small(num_classes=10)
    want = _torch_reference(variables["params"], variables["batch_stats"], x, train=False)
    np.testing.assert_allclose(infer(variables, x), want, atol=1e-4 * np.abs(want).max())
    running_means = []
    want = _torch_reference(variables["params"], variables["batch_stats"], x, train=True, running_means=running_means)
    train = jax.jit(train_apply_fn_of(model))
    got, updated = train(variables, x, np.ones(4), jax.random.PRNGKey(1))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    # the running means move 1% of the way to the batch's, as PyTorch's momentum 0.01 (the stem, a block, the last)
    means = [updated["batch_stats"][name]["BatchNorm_0"]["mean"] for name in ("stem", "last")]
    means.insert(1, updated["batch_stats"]["bneck3"]["project"]["BatchNorm_0"]["mean"])
    # after the stem, bneck0 (depthwise, project), bneck1 and bneck2 (expand, depthwise, project), bneck3's two
    bneck3_project = 1 + 2 + 3 + 3 + 2
    for got_mean, want_mean in zip(means, [running_means[0], running_means[bneck3_project], running_means[-1]]):
        np.testing.assert_allclose(got_mean, want_mean, atol=1e-5)
    # a padded row (mask 0) leaves the batch statistics, and so the real rows' logits, unchanged
    padded, _ = train(variables, np.concatenate([x, 9 * x[:1]]), np.array([1, 1, 1, 1, 0.]), jax.random.PRNGKey(1))
    np.testing.assert_allclose(padded[:4], got, atol=1e-5 * np.abs(want).max())


def test_rgb_64_inputs_are_taken_as_they_are(variables, infer):
    x = np.random.default_rng(1).uniform(0, 1, (4, 28, 28, 1)).astype(np.float32)  # the forward test's shape
    rgb = np.repeat(np.asarray(jax.image.resize(x, (4, 64, 64, 1), "bilinear")), 3, axis=-1)
    np.testing.assert_allclose(infer(variables, x), infer(variables, rgb), atol=1e-6)


def test_a_vmapped_training_step_has_no_grouped_convolution_on_a_cpu(variables):
    """Two clients' gradients through the whole model (depthwise and squeeze-excitation convolutions included) lower
    to matrix products, slices and elementwise products: no convolution XLA:CPU would run as a slow loop."""
    if jax.default_backend() != "cpu":
        pytest.skip("the shifted depthwise convolutions are the CPU's")
    train = train_apply_fn_of(MobileNetV3Small(num_classes=10))
    loss = lambda v, x: jnp.sum(train(v, x, jnp.ones(2), jax.random.PRNGKey(0))[0])  # noqa: E731
    stacked = jax.tree.map(lambda a: np.stack([a, a]), variables)
    x = jax.ShapeDtypeStruct((2, 2, 28, 28, 1), jnp.float32)
    text = jax.jit(jax.vmap(jax.grad(loss))).lower(stacked, x).as_text()
    assert "convolution" not in text and "dot_general" in text


def test_wrong_channel_counts_are_refused():
    with pytest.raises(ValueError, match="grey or RGB"):
        init_params(MobileNetV3Small(num_classes=10), (28, 28, 2), jax.random.PRNGKey(0))
