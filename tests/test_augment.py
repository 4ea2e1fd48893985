"""Mini-batch augmentation (Fischer et al.'s CIFAR-10 shifts and flips) and kernel weight decay."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.algorithms.local_sgd import make_sgd_client
from bfedjax.core import ClientContext, ClientData
from bfedjax.core.simulate import traced_hparams
from bfedjax.core.types import Batch


def _shifted(image, sy, sx, mirror):
    """Reference: out[i, j] = image[clip(i - sy), clip(j - sx)], then optionally mirrored."""
    h, w = image.shape[:2]
    rows = np.clip(np.arange(h) - sy, 0, h - 1)
    cols = np.clip(np.arange(w) - sx, 0, w - 1)
    out = image[rows][:, cols]
    return out[:, ::-1] if mirror else out


def test_shift_flip_outputs_are_edge_filled_shifts_or_their_mirrors():
    x = np.random.default_rng(0).normal(size=(16, 10, 10, 3)).astype(np.float32)
    y = np.asarray(bf.data.random_shift_flip(jnp.asarray(x), jax.random.PRNGKey(3), max_shift=0.2))
    chex.assert_shape(y, x.shape)
    seen_mirror, seen_shift = set(), set()
    for image, out in zip(x, y):
        matches = [(sy, sx, m) for sy in range(-2, 3) for sx in range(-2, 3) for m in (False, True)
                   if np.array_equal(out, _shifted(image, sy, sx, m))]
        assert matches, "output is not a shift (<= 2 px) or mirrored shift of its input"
        seen_mirror.add(matches[0][2])
        seen_shift.add(matches[0][:2])
    assert seen_mirror == {False, True} and len(seen_shift) > 3  # both branches and several shifts occur


def test_crop_flip_outputs_are_zero_filled_shifts_or_their_mirrors():
    x = np.random.default_rng(1).normal(size=(24, 9, 9, 2)).astype(np.float32)
    y = np.asarray(bf.data.random_crop_flip(jnp.asarray(x), jax.random.PRNGKey(5), padding=2))
    chex.assert_shape(y, x.shape)

    def cropped(image, sy, sx, mirror):  # out[i, j] = image[i - sy, j - sx], 0 outside
        padded = np.pad(image, ((2, 2), (2, 2), (0, 0)))
        out = padded[2 - sy: 2 - sy + 9, 2 - sx: 2 - sx + 9]
        return out[:, ::-1] if mirror else out

    seen = set()
    for image, out in zip(x, y):
        matches = [(sy, sx, m) for sy in range(-2, 3) for sx in range(-2, 3) for m in (False, True)
                   if np.array_equal(out, cropped(image, sy, sx, m))]
        assert matches, "output is not a zero-padded crop (<= 2 px) or its mirror"
        seen.add(matches[0])
    assert any(m for _, _, m in seen) and any(sy or sx for sy, sx, _ in seen)
    assert (y == 0).any() and not (x == 0).any()  # the zero border shows where a crop is shifted
    chex.assert_trees_all_equal(bf.data.random_crop_flip(jnp.asarray(x), jax.random.PRNGKey(0), padding=0,
                                                         flip=False), jnp.asarray(x))
    assert bf.data.AUGMENTATIONS["crop_flip"] is bf.data.random_crop_flip


def test_shift_flip_without_shift_or_flip_is_the_identity():
    x = jnp.arange(2 * 8 * 8 * 1, dtype=jnp.float32).reshape(2, 8, 8, 1)
    chex.assert_trees_all_equal(bf.data.random_shift_flip(x, jax.random.PRNGKey(0), max_shift=0.0, flip=False), x)


def test_shift_flip_rejects_flat_inputs_with_the_fix():
    with pytest.raises(ValueError, match="--augment=none"):
        bf.data.random_shift_flip(jnp.zeros((4, 64)), jax.random.PRNGKey(0))


def test_augmented_algorithm_trains_on_augmented_batches(small_fed, tiny_model, tiny_params):
    plain = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    aug = bf.data.augmented(plain, bf.data.random_shift_flip)
    runs = [bf.core.simulate(a, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params,
                             evaluate_local=False) for a in (plain, aug)]
    p_plain, p_aug = (r.state.server["params"] for r in runs)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(p_aug))
    diff = sum(float(jnp.abs(a - b).sum()) for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_aug)))
    assert diff > 1e-3  # the augmented batches changed the trajectory
    identity = bf.data.augmented(plain, lambda x, key: x)  # an identity augmentation only re-splits keys
    again = bf.core.simulate(identity, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params,
                             evaluate_local=False)
    chex.assert_trees_all_close(again.state.server["params"], p_plain, rtol=1e-5, atol=1e-6)


def test_augmented_final_pass_reads_augmented_data(small_fed, tiny_model, tiny_params):
    """The final pass (offline Fisher, reported losses) sees the client's data augmented once per round."""
    plain = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)

    def final(local, ctx):  # a spy: fedavg's final pass plus the inputs it was given
        message, persistent, metrics = plain.client_final(local, ctx)
        return message, persistent, {**metrics, "x_seen": ctx.data.x, "y_seen": ctx.data.y}

    spy = plain.replace(client_final=final)
    shift = lambda x, key: x + jax.random.normal(key, x.shape)  # noqa: E731 (an augmentation that moves every input)
    aug = bf.data.augmented(spy, shift)
    data = ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(16))
    ctx = ClientContext({"params": tiny_params}, (), data, {"lr": jnp.float32(0.1)})
    key, step_key = jax.random.PRNGKey(7), jax.random.PRNGKey(8)
    local = aug.client_init(ctx, key)
    chex.assert_trees_all_equal(local.inner, spy.client_init(ctx, key))  # the inner algorithm's keys are unchanged
    batch = Batch(data.x[:16], data.y[:16], jnp.ones(16))
    local = aug.client_step(local, batch, ctx, step_key)
    k_augment, k_step = jax.random.split(step_key)
    chex.assert_trees_all_equal(local.inner, spy.client_step(spy.client_init(ctx, key), batch._replace(
        x=shift(batch.x, k_augment)), ctx, k_step))
    chex.assert_trees_all_equal(local.params, local.inner.params)  # reads go through to the inner state
    message, _, metrics = jax.jit(aug.client_final)(local, ctx)
    # one draw per batch of 16 rows, from keys split off the init key's fold
    n = data.x.shape[0]  # 138 rows: 9 batches, the last padded from 10 rows to 16
    keys = jax.random.split(jax.random.fold_in(key, bf.data.augment._FINAL_KEY_SALT), -(-n // 16))
    padded = jnp.pad(data.x, [(0, 16 * len(keys) - n)] + [(0, 0)] * (data.x.ndim - 1))
    expected = jnp.concatenate([shift(padded[16 * i:16 * (i + 1)], k) for i, k in enumerate(keys)])[:n]
    chex.assert_trees_all_close(metrics["x_seen"], expected, rtol=1e-6)
    assert float(jnp.abs(metrics["x_seen"] - data.x).min()) > 0  # not the raw data
    chex.assert_trees_all_equal(metrics["y_seen"], data.y)
    chex.assert_trees_all_equal(message, spy.client_final(local.inner, ctx)[0])  # fedavg's message reads no data


def test_fedregs_pseudo_and_perturbed_data_come_from_augmented_images(small_fed, tiny_model, tiny_params):
    """FedReg spec 2.3: one pseudo / perturbed batch per mini-batch of a pass over the client's augmented loader
    (they were built from the raw images, the same with and without --augment)."""
    plain = bf.algorithms.fedreg(tiny_model, lr=0.1, batch_size=16, clamp="none")
    shift = lambda x, key: x + 0.5  # noqa: E731 (a deterministic augmentation)
    data = ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(small_fed.counts[0]))
    ctx = ClientContext({"params": tiny_params}, (), data, traced_hparams(plain, 1))
    key = jax.random.PRNGKey(3)
    local = bf.data.augmented(plain, shift).client_init(ctx, key)
    moved = plain.client_init(dataclasses.replace(ctx, data=data._replace(x=data.x + 0.5)), key)
    chex.assert_trees_all_close(local.inner.reg, moved.reg, rtol=1e-6, atol=1e-6)
    raw = plain.client_init(ctx, key)
    assert float(jnp.abs(local.inner.reg.perturbed_x - raw.reg.perturbed_x).max()) > 0.1


def test_augmented_round_vmap_matches_sequential(small_fed, tiny_model, tiny_params):
    from bfedjax.core import RoundConfig, init_state, make_round_step
    from bfedjax.core.simulate import round_arrays, traced_hparams
    algo = bf.data.augmented(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16), bf.data.random_shift_flip)
    config = RoundConfig(5, 3, clients_per_chunk=2)
    out = [make_round_step(algo, config, backend)(init_state(algo, tiny_params, config), round_arrays(small_fed),
                                                   jax.random.PRNGKey(4), traced_hparams(algo, 1))
           for backend in ("vmap", "sequential")]
    chex.assert_trees_all_close(out[0], out[1], rtol=2e-5, atol=2e-6)


def test_weight_decay_adds_l2_on_kernels_only(small_fed, tiny_model, tiny_params):
    batch = Batch(jnp.asarray(small_fed.x[0, :16]), jnp.asarray(small_fed.y[0, :16]), jnp.ones(16))
    ctx = ClientContext({"params": tiny_params}, (),
                        ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(16)),
                        {"lr": jnp.float32(0.1)})
    stepped = []
    for wd in (0.0, 0.5):
        init, step = make_sgd_client(tiny_model, clip_norm=None, weight_decay=wd)
        stepped.append(step(init(ctx, jax.random.PRNGKey(0)), batch, ctx, jax.random.PRNGKey(0)).params)
    expected = jax.tree_util.tree_map_with_path(
        lambda path, a, w: a - 0.1 * 0.5 * w if path[-1].key == "kernel" else a, stepped[0], tiny_params)
    chex.assert_trees_all_close(stepped[1], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight_decay"):
        make_sgd_client(tiny_model, weight_decay=-1.0)


def test_fedref_reads_the_inner_local_state_through_augmented(small_fed, tiny_model, tiny_params):
    """``with_reference_model(augmented(...), loss_report="last_batch")`` reads ``local.loss`` of the inner state."""
    from bfedjax.algorithms.fedref import with_reference_model
    base = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    loss_fn = bf.tasks.classification(tiny_model).loss
    for algo in (with_reference_model(bf.data.augmented(base, bf.data.random_shift_flip), loss_fn=loss_fn,
                                      loss_report="last_batch"),
                 bf.data.augmented(with_reference_model(base, loss_fn=loss_fn, loss_report="last_batch"),
                                   bf.data.random_shift_flip)):
        out = bf.core.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params=tiny_params,
                               evaluate_local=False)
        assert out.metrics["round"] == [1]
