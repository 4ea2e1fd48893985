"""Gradient inversion (DLG / Geiping et al.) on a tiny logistic regression, PSNR, TV and plots."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bfedjax.privacy import inversion as inv


def _logits(params, x):
    return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]


def _update_fn(params, x, y):
    """Parameter change of one SGD step (lr 0.1) on the cross-entropy: ``-lr * grad``."""
    def ce(p):
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(_logits(p, x)) * jax.nn.one_hot(y, 10), axis=-1))
    return jax.tree.map(lambda g: -0.1 * g, jax.grad(ce)(params))


@pytest.fixture(scope="module")
def problem():
    k_w, k_x = jax.random.split(jax.random.PRNGKey(0))
    params = {"w": 0.1 * jax.random.normal(k_w, (16, 10)), "b": jnp.zeros(10)}
    x = jax.random.uniform(k_x, (1, 4, 4, 1))
    y = jnp.array([3])
    return params, x, y, _update_fn(params, x, y)


def test_psnr_identities():
    x = jax.random.uniform(jax.random.PRNGKey(1), (3, 4, 4, 1))
    assert np.all(np.isposinf(inv.psnr(x, x)))
    e = 0.1
    np.testing.assert_allclose(inv.psnr(x + e, x), np.full(3, 10 * np.log10(1 / e ** 2)), rtol=1e-4)
    np.testing.assert_allclose(inv.psnr(x - 2 * e, x, max_value=2.0), 10 * np.log10(4 / (2 * e) ** 2), rtol=1e-4)
    # per-image: only the second image is wrong
    values = inv.psnr(x.at[1].add(0.5), x)
    assert values.shape == (3,) and np.isposinf(values[0]) and np.isposinf(values[2])
    np.testing.assert_allclose(values[1], 10 * np.log10(1 / 0.25), rtol=1e-4)
    with pytest.raises(ValueError, match="same shape|one shape"):
        inv.psnr(x, x[:2])


def test_total_variation_hand_values():
    assert float(inv.total_variation(jnp.full((2, 4, 5, 3), 0.7))) == 0.0
    checker = 0.5 * ((np.arange(4)[:, None] + np.arange(6)[None, :]) % 2)  # every neighbour differs by 0.5
    np.testing.assert_allclose(inv.total_variation(jnp.asarray(checker)[None, :, :, None]), 1.0, rtol=1e-6)
    ramp = 0.1 * np.tile(np.arange(5.0), (4, 1))  # horizontal steps of 0.1, no vertical change
    np.testing.assert_allclose(inv.total_variation(jnp.asarray(ramp)[None, :, :, None]), 0.1, rtol=1e-5)
    with pytest.raises(ValueError, match="N, H, W, C"):
        inv.total_variation(jnp.zeros((4, 4)))


def test_step_decay_lr_boundaries():
    sched = inv.step_decay_lr(2.0, 800)  # milestones 300, 500, 700
    got = [float(sched(s)) for s in (0, 299, 300, 499, 500, 699, 700, 799)]
    np.testing.assert_allclose(got, [2.0, 2.0, 0.2, 0.2, 0.02, 0.02, 0.002, 0.002], rtol=1e-6)


def test_dlg_l2_recovers_image(problem):
    params, x, y, observed = problem
    rec = inv.reconstruct(_update_fn, params, observed, x.shape, y, key=jax.random.PRNGKey(2),
                          distance="l2", iterations=300, lr=0.1)
    assert rec.x.shape == x.shape
    assert float(inv.psnr(rec.x, x)[0]) > 30.0
    # the returned loss is the objective at the returned x
    np.testing.assert_allclose(rec.loss, inv._l2(_update_fn(params, rec.x, y), observed), rtol=1e-4, atol=1e-12)


def test_cosine_tv_beats_random_start(problem):
    params, x, y, observed = problem
    key = jax.random.PRNGKey(2)
    start = float(inv.psnr(jax.random.uniform(key, x.shape), x)[0])  # the attack's own initialisation
    rec = inv.reconstruct(_update_fn, params, observed, x.shape, y, key=key, distance="cosine",
                          tv_weight=1e-2, iterations=300, lr=0.1)
    assert float(rec.x.min()) >= 0.0 and float(rec.x.max()) <= 1.0
    assert float(inv.psnr(rec.x, x)[0]) > start + 15.0


def test_clamp_keeps_x_in_range(problem):
    params, x, y, observed = problem  # x has pixels outside [0.25, 0.75], so the attack pushes against the bounds
    rec = inv.reconstruct(_update_fn, params, observed, x.shape, y, key=jax.random.PRNGKey(3), distance="l2",
                          iterations=50, lr=0.1, clamp=(0.25, 0.75))
    assert float(rec.x.min()) >= 0.25 and float(rec.x.max()) <= 0.75
    assert np.any(np.isclose(rec.x, 0.25)) or np.any(np.isclose(rec.x, 0.75))


def test_bad_arguments_raise(problem):
    params, x, y, observed = problem
    with pytest.raises(ValueError, match="l2"):
        inv.reconstruct(_update_fn, params, observed, x.shape, y, key=jax.random.PRNGKey(0), distance="l1")
    with pytest.raises(ValueError, match="tv_weight"):
        inv.reconstruct(_update_fn, params, observed, (1, 16), y, key=jax.random.PRNGKey(0), tv_weight=0.1)
    with pytest.raises(ValueError, match="low < high"):
        inv.reconstruct(_update_fn, params, observed, x.shape, y, key=jax.random.PRNGKey(0), clamp=(1.0, 0.0))


def test_save_reconstruction_png(tmp_path):
    originals = np.random.default_rng(0).uniform(size=(3, 4, 4, 1))
    recs = {"DLG (l2)": originals + 0.01, "cosine+TV": originals[..., 0]}
    path = inv.save_reconstruction_png(tmp_path / "sub" / "inv.png", originals, recs,
                                       psnrs={k: inv.psnr(np.asarray(v).reshape(originals.shape), originals)
                                              for k, v in recs.items()}, title="tiny")
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    with pytest.raises(ValueError, match="expected the originals"):
        inv.save_reconstruction_png(tmp_path / "bad.png", originals, {"x": originals[:2]})
