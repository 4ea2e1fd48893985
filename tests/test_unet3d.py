"""pytorch-3dunet's UNet3D (FedRef's FeTS model) against its layer table written in PyTorch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.models.unet3d import nearest_resize

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _torch_unet3d(cin, out, features, levels, groups):
    """pytorch-3dunet's UNet3D(layer_order="gcr", conv_upscale=2, upsample="default") as plain torch modules."""
    def single(c_in, c_out):
        return torch.nn.Sequential(torch.nn.GroupNorm(groups if c_in >= groups else 1, c_in),
                                   torch.nn.Conv3d(c_in, c_out, 3, padding=1, bias=False), torch.nn.ReLU())

    def double(c_in, c_out, encoder):
        middle = max(c_out // 2, c_in) if encoder else c_out
        return torch.nn.Sequential(single(c_in, middle), single(middle, c_out))

    widths = [features * 2 ** i for i in range(levels)]
    encoders = torch.nn.ModuleList([double(cin if i == 0 else widths[i - 1], w, True) for i, w in enumerate(widths)])
    decoders = torch.nn.ModuleList([double(widths[i] + widths[i + 1], widths[i], False)
                                    for i in reversed(range(levels - 1))])
    head = torch.nn.Conv3d(widths[0], out, 1)

    def forward(x):
        skips = []
        for i, encoder in enumerate(encoders):
            x = encoder(F.max_pool3d(x, 2) if i else x)
            skips.append(x)
        for decoder, skip in zip(decoders, skips[-2::-1]):
            x = decoder(torch.cat([skip, F.interpolate(x, size=skip.shape[2:], mode="nearest")], dim=1))
        return head(x)

    return torch.nn.ModuleList([encoders, decoders, head]), forward


def _copy(flax_params, modules):
    """Flax's UNet3D parameters in creation order -> the torch modules (Conv3d: DHWIO -> OIDHW)."""
    leaves = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(flax_params)[0]]
    order = lambda path: (int(path[0].key.rsplit("_", 1)[1]), path[0].key.split("_")[0])
    convs = sorted([(p, v) for p, v in leaves if p[0].key.startswith("Conv")], key=lambda pv: order(pv[0]))
    norms = sorted([(p, v) for p, v in leaves if p[0].key.startswith("GroupNorm")], key=lambda pv: order(pv[0]))
    torch_convs = [m for m in modules.modules() if isinstance(m, torch.nn.Conv3d)]
    torch_norms = [m for m in modules.modules() if isinstance(m, torch.nn.GroupNorm)]
    flax_convs = {}
    for path, value in convs:
        flax_convs.setdefault(path[0].key, {})[path[1].key] = np.asarray(value)
    flax_norms = {}
    for path, value in norms:
        flax_norms.setdefault(path[0].key, {})[path[1].key] = np.asarray(value)
    assert len(flax_convs) == len(torch_convs) and len(flax_norms) == len(torch_norms)
    with torch.no_grad():
        for module, values in zip(torch_convs, flax_convs.values()):
            module.weight.copy_(torch.from_numpy(values["kernel"].transpose(4, 3, 0, 1, 2).copy()))
            if module.bias is not None:
                module.bias.copy_(torch.from_numpy(values["bias"].copy()))
        for module, values in zip(torch_norms, flax_norms.values()):
            module.weight.copy_(torch.from_numpy(values["scale"].copy()))
            module.bias.copy_(torch.from_numpy(values["bias"].copy()))


def test_fedref_fets_configuration_has_pytorch_3dunets_parameter_count():
    model = bf.models.UNet3D(features=4, levels=4, num_groups=4, out_channels=4)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 16, 1)))["params"]  # shapes only
    modules, _ = _torch_unet3d(1, 4, 4, 4, 4)
    count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    assert count == sum(p.numel() for p in modules.parameters()) == 64_136


def test_logits_match_the_torch_layer_table_on_odd_sizes():
    model = bf.models.UNet3D(features=4, levels=4, num_groups=4, out_channels=3)
    x = np.random.default_rng(0).normal(size=(2, 11, 12, 10, 1)).astype(np.float32)  # 11 -> 5 -> 2 -> 1
    # jitted init, perturbation and forward: one compile each rather than an eager compile per operation
    params = jax.jit(model.init)(jax.random.PRNGKey(1), jnp.asarray(x))["params"]
    # move GroupNorm's scale and offset off 1 and 0, so the test sees their placement
    params = jax.jit(lambda params: jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.1 * jax.random.normal(jax.random.PRNGKey(len(str(p))), v.shape)
        if p[0].key.startswith("GroupNorm") else v, params))(params)
    modules, forward = _torch_unet3d(1, 3, 4, 4, 4)
    _copy(params, modules)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(x)))
    with torch.no_grad():
        ref = forward(torch.from_numpy(x.transpose(0, 4, 1, 2, 3))).numpy().transpose(0, 2, 3, 4, 1)
    assert ours.shape == (2, 11, 12, 10, 3)
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4)  # float32 GroupNorm over 1x1x1 at the bottom
    assert np.abs(ref).max() > 0.1


def test_initialisation_is_torchs_default_with_a_xavier_head():
    model = bf.models.UNet3D(features=4, levels=2, out_channels=1)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 4, 1)))["params"]  # one compile
    head = params[max((k for k in params if k.startswith("Conv")), key=lambda k: int(k.rsplit("_", 1)[1]))]
    assert not jnp.any(head["bias"]) and head["kernel"].shape == (1, 1, 1, 4, 1)
    bound = float(np.sqrt(6 / (4 + 1)))  # Xavier uniform, fan_in 4, fan_out 1
    assert 0.5 * bound < float(jnp.abs(head["kernel"]).max()) <= bound
    first = params["Conv_0"]["kernel"]  # 3x3x3, 1 -> 2: PyTorch's U(-1/sqrt(27), 1/sqrt(27))
    assert first.shape == (3, 3, 3, 1, 2) and 0.8 / np.sqrt(27) < float(jnp.abs(first).max()) <= 1 / np.sqrt(27)
    assert "bias" not in params["Conv_0"]
    assert all(bool(jnp.all(params[k]["scale"] == 1)) for k in params if k.startswith("GroupNorm"))


def test_nearest_resize_is_torchs_nearest():
    x = np.random.default_rng(2).normal(size=(1, 5, 7, 3, 2)).astype(np.float32)
    for size in [(11, 15, 7), (10, 14, 6), (5, 7, 3)]:
        ours = np.asarray(nearest_resize(jnp.asarray(x), size))
        ref = F.interpolate(torch.from_numpy(x.transpose(0, 4, 1, 2, 3)), size=size, mode="nearest")
        np.testing.assert_array_equal(ours, ref.numpy().transpose(0, 2, 3, 4, 1))


def test_binary_head_and_input_errors():
    model = bf.models.UNet3D(features=4, levels=2)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 2, 1)))  # jitted: one compile each
    assert jax.jit(model.apply)(params, jnp.ones((2, 4, 4, 2, 1))).shape == (2, 4, 4, 2)
    with pytest.raises(ValueError, match="x\\[..., None\\]"):
        model.apply(params, jnp.ones((2, 4, 4, 2)))
    with pytest.raises(ValueError, match="levels >= 2"):
        bf.models.UNet3D(levels=1).init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 4, 1)))


def test_segmentation_task_evaluates_volumes_in_voxel_bounded_batches(monkeypatch):
    from bfedjax import tasks
    model = bf.models.UNet3D(features=4, levels=2)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 8, 8, 6, 1)), jnp.float32)
    y = jnp.asarray(rng.random((5, 8, 8, 6)) < 0.3, jnp.int32)
    task = bf.tasks.segmentation(model)
    params = task.init_params(jax.random.PRNGKey(0), x.shape[1:])
    fets = jax.ShapeDtypeStruct((1, 155, 240, 240, 1), jnp.float32)
    assert tasks._segmentation_batch(x, 50) == 50 and tasks._segmentation_batch(fets, 50) == 1
    # jitted (as the engine runs it): one compile each rather than an eager compile per operation; a new lambda
    # each time, so the second is traced afresh with the patched batch size
    whole = jax.jit(lambda params, x, y: task.evaluate(params, x, y))(params, x, y)
    monkeypatch.setattr(tasks, "SEGMENTATION_EVAL_VOXELS", 2 * 8 * 8 * 6)  # two volumes a batch: 3 batches, one padded
    assert tasks._segmentation_batch(x, 50) == 2
    pieces = jax.jit(lambda params, x, y: task.evaluate(params, x, y))(params, x, y)
    for name in ("dice", "iou", "hd95", "loss"):
        np.testing.assert_allclose(pieces[name], whole[name], rtol=1e-5, atol=1e-6)
    assert float(whole["hd95"]) > 0


def test_segmentation_task_with_classes_uses_the_authors_loss():
    from bfedjax.core.types import Batch
    from bfedjax.metrics import segmentation as S
    model = bf.models.UNet3D(features=4, levels=2, out_channels=4)  # 4 classes: one logit per class
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 8, 8, 6, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, size=(3, 8, 8, 6)), jnp.int32)
    task = bf.tasks.segmentation(model, loss="dice_focal")
    params = task.init_params(jax.random.PRNGKey(0), x.shape[1:])
    # every function jitted (as the engine runs them): one compile each rather than an eager compile per operation
    logits = jax.jit(task.apply_fn)(params, x)
    assert logits.shape == (3, 8, 8, 6, 4)
    mask = jnp.asarray([1.0, 1.0, 0.0])
    loss = jax.jit(task.loss)(params, Batch(x=x, y=y, mask=mask))
    np.testing.assert_allclose(loss, jax.jit(S.dice_focal_loss)(logits[:2], y[:2]), rtol=1e-5)
    scores = jax.jit(task.evaluate)(params, x, y)
    assert {"dice_class1", "dice_class2", "dice_class3"} <= set(scores) and "dice_class4" not in scores
    probs = jax.jit(task.predict, static_argnums=3)(params, x, jax.random.PRNGKey(1), 1)
    assert probs.shape == (1, 3, 8, 8, 6, 4)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(jnp.argmax(probs[0], -1), jnp.argmax(logits, -1))
    with pytest.raises(ValueError, match="fix: one of ce_dice"):
        bf.tasks.segmentation(model, loss="dice")
