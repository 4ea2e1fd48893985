"""FedReg (spec §8 identities): limits, projections, pseudo data, MG, and vmap/sequential parity."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bfedjax as bf
from bfedjax.algorithms.fedreg import clamp_bounds, project_update, remove_component, sign_ascent
from bfedjax.losses import soft_cross_entropy
from bfedjax.tree import tree_dot
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.models.apply import apply_fn_of


@pytest.fixture(scope="module")
def unit_fed():
    """20 one-class digits clients of 12 images each, pixels in [0, 1]."""
    ds = bf.data.load("digits", pixels="unit")
    parts = bf.data.single_class(ds.y_train, 20, seed=0, samples_per_client=12)
    return bf.data.from_partition(ds, parts)


def _round(algo, fed, params, config, backend="vmap", r=1):
    state = init_state(algo, params, config)
    return make_round_step(algo, config, backend)(state, round_arrays(fed), jax.random.PRNGKey(3),
                                                  traced_hparams(algo, r))


def _params(model, seed=1):
    return bf.models.zoo.init_params(model, (8, 8, 1), jax.random.PRNGKey(seed))


def test_gamma_one_without_projections_is_fedavg(unit_fed, tiny_model):
    params = _params(tiny_model)
    config = RoundConfig(unit_fed.num_clients, 5)
    reg = bf.algorithms.fedreg(tiny_model, lr=0.2, gamma=1.0, projections=False, local_epochs=2, batch_size=5)
    avg = bf.algorithms.fedavg(tiny_model, lr=0.2, clip_norm=None, local_epochs=2, batch_size=5)
    (reg_state, _), (avg_state, _) = _round(reg, unit_fed, params, config), _round(avg, unit_fed, params, config)
    chex.assert_trees_all_close(reg_state.server["params"], avg_state.server["params"], rtol=1e-6, atol=1e-7)


def test_gamma_zero_full_batch_takes_steps_along_the_global_gradient(unit_fed, tiny_model):
    params = _params(tiny_model)
    reg = bf.algorithms.fedreg(tiny_model, lr=0.1, gamma=0.0, projections=False, local_epochs=3, batch_size=12)
    state, _ = _round(reg, unit_fed, params, RoundConfig(unit_fed.num_clients, unit_fed.num_clients))
    apply_fn = apply_fn_of(tiny_model)
    grads = [jax.grad(lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        apply_fn(p, jnp.asarray(unit_fed.x[i, :12])), jnp.asarray(unit_fed.y[i, :12]))))(params)
        for i in range(unit_fed.num_clients)]
    mean_grad = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    expected = jax.tree.map(lambda p, g: p - 3 * 0.1 * g, params, mean_grad)
    chex.assert_trees_all_close(state.server["params"], expected, rtol=1e-5, atol=1e-6)


def _random_tree(key, shapes):
    keys = jax.random.split(key, len(shapes))
    return {f"w{i}": jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}


@pytest.mark.parametrize("seed", range(6))
def test_projections_satisfy_the_linearised_constraints(seed):
    shapes = [(3, 2), (4,)]
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    theta_g, params, g_s, g_p = (_random_tree(key, shapes) for key in k)
    out, ws, wp = project_update(params, theta_g, g_s, g_p)
    d = jax.tree.map(jnp.subtract, out, theta_g)
    assert float(tree_dot(d, g_p)) <= 1e-5                       # perturbed-data constraint (7)
    if float(tree_dot(g_s, g_p)) >= 0 or float(wp) == 0:
        assert float(tree_dot(d, g_s)) <= 1e-5                   # pseudo-data constraint (6) survives
    first, ws_again, _ = project_update(params, theta_g, g_s, jax.tree.map(jnp.zeros_like, g_p))
    if float(ws) > 0:                                            # the first projection is tight
        np.testing.assert_allclose(float(tree_dot(jax.tree.map(jnp.subtract, first, theta_g), g_s)), 0.0,
                                   atol=1e-5)
    twice, ws2, _ = project_update(first, theta_g, g_s, jax.tree.map(jnp.zeros_like, g_p))
    assert float(ws2) <= 1e-6                                    # idempotent
    chex.assert_trees_all_close(twice, first, atol=1e-6)


def test_pseudo_label_temperature_softens_the_generated_labels(unit_fed, tiny_model):
    from bfedjax.core import ClientContext, ClientData
    from bfedjax.core.simulate import traced_hparams
    theta_g = _params(tiny_model)
    data = ClientData(jnp.asarray(unit_fed.x[0]), jnp.asarray(unit_fed.y[0]), jnp.int32(unit_fed.counts[0]))
    reg = {}
    for tau in (1.0, 3.0):
        algo = bf.algorithms.fedreg(tiny_model, batch_size=6, pseudo_temperature=tau)
        ctx = ClientContext({"params": theta_g}, (), data, traced_hparams(algo, 1))
        reg[tau] = algo.client_init(ctx, jax.random.PRNGKey(0)).reg
    chex.assert_trees_all_equal(reg[1.0].pseudo_x, reg[3.0].pseudo_x)  # generation does not see tau
    logits = jnp.log(reg[1.0].pseudo_y)  # softmax(z) -> log gives z up to a per-row constant
    chex.assert_trees_all_close(reg[3.0].pseudo_y, jax.nn.softmax(logits / 3.0), atol=1e-6)
    entropy = lambda p: float(-jnp.sum(p * jnp.log(p)))
    assert entropy(reg[3.0].pseudo_y) > entropy(reg[1.0].pseudo_y)
    with pytest.raises(ValueError, match="pseudo_temperature"):
        bf.algorithms.fedreg(tiny_model, pseudo_temperature=0.0)


@pytest.mark.parametrize("seed", range(3))
def test_per_layer_projections_satisfy_each_leafs_constraints(seed):
    shapes = [(3, 2), (4,), (5,)]
    k = jax.random.split(jax.random.PRNGKey(seed + 10), 4)
    theta_g, params, g_s, g_p = (_random_tree(key, shapes) for key in k)
    out, ws, wp = project_update(params, theta_g, g_s, g_p, per_layer=True)
    d = jax.tree.map(jnp.subtract, out, theta_g)
    leaves = zip(jax.tree.leaves(d), jax.tree.leaves(g_s), jax.tree.leaves(g_p), jax.tree.leaves(params),
                 jax.tree.leaves(theta_g))
    for dl, sl, pl, param, theta in leaves:
        assert float(jnp.vdot(dl, pl)) <= 1e-5  # each leaf meets the perturbed-data constraint on its own
        alone, ws_l, wp_l = project_update({"w": param}, {"w": theta}, {"w": sl}, {"w": pl})
        np.testing.assert_allclose(np.asarray(alone["w"]), np.asarray(dl + theta), atol=1e-6)  # = its own Eq. 10
        assert float(ws_l) <= float(ws) + 1e-7 and float(wp_l) <= float(wp) + 1e-7
    glob, _, _ = project_update(params, theta_g, g_s, g_p)
    assert not np.allclose(np.concatenate([np.ravel(x) for x in jax.tree.leaves(glob)]),
                           np.concatenate([np.ravel(x) for x in jax.tree.leaves(out)]), atol=1e-4)


def test_first_projection_is_the_euclidean_projection_onto_the_half_space():
    rng = np.random.default_rng(0)
    for _ in range(5):
        theta_g, params, g_s = (rng.normal(size=3).astype(np.float32) for _ in range(3))
        out, _, _ = project_update({"w": params}, {"w": theta_g}, {"w": g_s}, {"w": np.zeros(3, np.float32)})
        # brute force: the feasible point {x : (x - theta_g) . g_s <= 0} nearest to params on a grid + the boundary
        grid = params + np.stack(np.meshgrid(*[np.linspace(-4, 4, 81)] * 3), -1).reshape(-1, 3)
        feasible = grid[(grid - theta_g) @ g_s <= 0]
        best = feasible[np.argmin(np.linalg.norm(feasible - params, axis=1))]
        assert np.linalg.norm(np.asarray(out["w"]) - params) <= np.linalg.norm(best - params) + 1e-5
        assert float((np.asarray(out["w"]) - theta_g) @ g_s) <= 1e-5


def test_projections_use_gradients_at_the_midpoint(unit_fed, tiny_model):
    """A FedReg step is the SGD step followed by Eq. 10 with both gradients at (theta + theta_g) / 2.

    The midpoint makes the linearised constraints exact for quadratic losses (the paper's argument);
    the gradients at theta itself give another step.
    """
    from bfedjax.core import Batch, ClientContext, ClientData
    from bfedjax.core.simulate import traced_hparams
    theta_g = _params(tiny_model)
    algo = bf.algorithms.fedreg(tiny_model, lr=0.2, gamma=0.4, eta_s=0.05, batch_size=5)
    data = ClientData(jnp.asarray(unit_fed.x[0]), jnp.asarray(unit_fed.y[0]), jnp.int32(unit_fed.counts[0]))
    ctx = ClientContext({"params": theta_g}, (), data, traced_hparams(algo, 1))
    batch = Batch(data.x[:5], data.y[:5], jnp.ones(5))
    step = jax.jit(algo.client_step)  # jitted as in the round: one compile, not one per operation
    first = step(jax.jit(algo.client_init)(ctx, jax.random.PRNGKey(0)), batch, ctx, jax.random.PRNGKey(1))
    second = step(first, batch, ctx, jax.random.PRNGKey(2))
    apply_fn = apply_fn_of(tiny_model)
    theta_gamma = jax.tree.map(lambda t, g: 0.4 * t + 0.6 * g, first.params, theta_g)
    grad = jax.grad(bf.losses.masked_mean_cross_entropy, argnums=1)(apply_fn, theta_gamma, batch)
    sgd = jax.tree.map(lambda t, g: t - 0.2 * g, first.params, grad)
    reg, k = first.reg, first.steps % first.reg.num_batches

    @jax.jit
    def projected(at):
        g_s = jax.grad(lambda p: soft_cross_entropy(apply_fn(p, reg.pseudo_x[k]), reg.pseudo_y[k], reg.mask[k]))(at)
        g_p = jax.grad(bf.losses.masked_mean_cross_entropy, argnums=1)(
            apply_fn, at, Batch(reg.perturbed_x[k], reg.perturbed_y[k], reg.mask[k]))
        return project_update(sgd, theta_g, g_s, g_p)[0]

    midpoint = jax.tree.map(lambda t, g: 0.5 * (t + g), sgd, theta_g)
    chex.assert_trees_all_close(second.params, projected(midpoint), rtol=1e-5, atol=1e-7)
    assert not np.allclose(jax.tree.leaves(projected(sgd))[1], jax.tree.leaves(second.params)[1], rtol=1e-5, atol=1e-7)


def test_soft_labels_make_the_global_model_stationary(digits, tiny_model):
    params, apply_fn = _params(tiny_model), apply_fn_of(tiny_model)
    x, y, mask = jnp.asarray(digits.x_train[:16]), jnp.asarray(digits.y_train[:16]), jnp.ones(16)
    soft = jax.nn.softmax(apply_fn(params, x))
    g_soft = jax.grad(lambda p: soft_cross_entropy(apply_fn(p, x), soft, mask))(params)
    g_hard = jax.grad(lambda p: soft_cross_entropy(apply_fn(p, x), jax.nn.one_hot(y, 10), mask))(params)
    assert float(optax.tree.norm(g_soft)) <= 1e-6 * float(optax.tree.norm(g_hard)) + 1e-7


def test_sign_ascent_raises_a_convex_loss_and_stays_in_bounds(digits):
    logistic = bf.models.get_model("logistic", 10)
    params, apply_fn = bf.models.zoo.init_params(logistic, (8, 8, 1), jax.random.PRNGKey(0)), apply_fn_of(logistic)
    x, y = jnp.asarray(digits.x_train[:8]), jnp.asarray(digits.y_train[:8])
    ce = lambda inputs: optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, inputs), y)
    previous = ce(x)
    for steps in range(1, 4):  # each extra step never lowers a convex loss
        current = ce(sign_ascent(apply_fn, params, x, y, eta=0.05, steps=steps))
        assert bool(jnp.all(current >= previous - 1e-6))
        previous = current
    chex.assert_trees_all_equal(sign_ascent(apply_fn, params, x, y, eta=0.0, steps=10), x)
    eta_p = 0.0005
    perturbed = sign_ascent(apply_fn, params, x, y, eta=eta_p, steps=10)
    assert float(jnp.max(jnp.abs(perturbed - x))) <= 10 * eta_p + 1e-6
    bounds = clamp_bounds(x, jnp.ones(8), "batch_range")
    clamped = sign_ascent(apply_fn, params, x, y, eta=0.5, steps=10, bounds=bounds)
    assert float(clamped.min()) >= float(x.min()) and float(clamped.max()) <= float(x.max())


def test_mg_gradient_is_orthogonal_to_the_uniform_label_gradient():
    g, u = _random_tree(jax.random.PRNGKey(0), [(5,), (2, 3)]), _random_tree(jax.random.PRNGKey(1), [(5,), (2, 3)])
    np.testing.assert_allclose(float(tree_dot(remove_component(g, u), u)), 0.0, atol=1e-5)
    parallel = jax.tree.map(lambda x: -2.5 * x, u)
    chex.assert_trees_all_close(remove_component(parallel, u), jax.tree.map(jnp.zeros_like, u), atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"mg": True}, {"granularity": "per_step"}, {"granularity": "full_set"}])
def test_fedreg_vmap_matches_sequential_and_learns(unit_fed, tiny_model, options):
    params = _params(tiny_model)
    algo = bf.algorithms.fedreg(tiny_model, lr=0.2, gamma=0.4, eta_s=0.05, local_epochs=2, batch_size=5,
                                **options)
    config = RoundConfig(unit_fed.num_clients, 4, clients_per_chunk=3)
    vm = _round(algo, unit_fed, params, config, "vmap")
    seq = _round(algo, unit_fed, params, config, "sequential")
    chex.assert_trees_all_close(vm, seq, rtol=2e-5, atol=2e-6)
    state, metrics = vm
    assert 0.0 < float(metrics["ws_active"]) <= 1.0 and 0.0 <= float(metrics["wp_active"]) <= 1.0


def test_one_class_digits_fedreg_keeps_up_with_fedavg(unit_fed, tiny_model):
    """Spec 7d: on one-class clients FedReg's curve is finite and not far below FedAvg's."""
    run = lambda algo: bf.simulate(algo, unit_fed, rounds=12, clients_per_round=5, key=jax.random.PRNGKey(0),
                                   client_weights="uniform", evaluate_local=False)
    reg = run(bf.algorithms.fedreg(tiny_model, lr=0.2, gamma=0.4, eta_s=0.05, local_epochs=3, batch_size=12))
    avg = run(bf.algorithms.fedavg(tiny_model, lr=0.2, clip_norm=None, local_epochs=3, batch_size=12))
    assert np.all(np.isfinite(reg.metrics["global_loss"]))
    assert reg.best_global_accuracy >= avg.best_global_accuracy - 0.1


def test_bad_options_raise(tiny_model):
    with pytest.raises(ValueError, match="granularity"):
        bf.algorithms.fedreg(tiny_model, granularity="per_epoch")
    with pytest.raises(ValueError, match="without BatchNorm or dropout"):
        bf.algorithms.fedreg(bf.models.get_model("mlp", 10, hidden=(8,), dropout_rate=0.2))


def _numpy_loss(w, x, y):
    """Mean softmax cross-entropy of the linear model ``x @ w`` (numpy, float64)."""
    logits = x.astype(np.float64) @ w.astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(y)), y].mean())


def test_forgetting_gap_is_the_papers_loss_difference():
    from bfedjax.core import ClientData
    from bfedjax.metrics.forgetting import forgetting_gap
    rng = np.random.default_rng(0)
    apply_fn = lambda w, x: x @ w  # noqa: E731
    theta = rng.normal(size=(6, 4)).astype(np.float32)
    local = rng.normal(size=(3, 6, 4)).astype(np.float32)
    local[2] = np.nan  # a padding slot: left out
    x = rng.normal(size=(2, 5, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=(2, 5)).astype(np.int32)
    counts = np.array([5, 3], np.int32)  # client 1's last two rows are padding
    previous = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(counts))
    gap = forgetting_gap(apply_fn, jnp.asarray(theta), jnp.asarray(local), jnp.array([1.0, 1.0, 0.0]), previous)
    expected = [np.mean([_numpy_loss(local[j], x[i, :c], y[i, :c]) for j in (0, 1)]) - _numpy_loss(theta, x[i, :c],
                                                                                                  y[i, :c])
                for i, c in enumerate(counts)]
    np.testing.assert_allclose(np.asarray(gap), expected, rtol=1e-5, atol=1e-6)
    unchanged = forgetting_gap(apply_fn, jnp.asarray(theta), jnp.stack([jnp.asarray(theta)] * 2), jnp.ones(2), previous)
    np.testing.assert_allclose(np.asarray(unchanged), 0.0, atol=1e-6)


def test_forgetting_rounds_follow_simulate_and_start_from_its_global_model():
    """FedReg's trajectory is ``simulate``'s; a FedAvg that does not move (lr 0) forgets nothing, which holds
    only when the gap is taken against the model the round's clients started from."""
    from bfedjax.metrics.forgetting import forgetting_rounds
    data = bf.data.load("mnist_5k", pixels="unit")
    fed = bf.data.from_partition(data, bf.data.single_class(data.y_train, 30, seed=0, samples_per_client=20))
    model = bf.models.get_model("mlp", 10)
    fedreg = bf.algorithms.build("fedreg", model, fed, lr=0.2, gamma=1.0, local_epochs=1, batch_size=20)
    frozen = bf.algorithms.build("fedavg", model, fed, lr=0.0, clip_norm=None, local_epochs=1, batch_size=20)
    key = jax.random.PRNGKey(3)
    out = forgetting_rounds({"fedavg": frozen, "fedreg": fedreg}, "fedreg", apply_fn_of(model), fed, key, rounds=3,
                            clients_per_round=5)
    reference = bf.simulate(fedreg, fed, rounds=3, key=key, clients_per_round=5, client_weights="uniform",
                            clients_per_chunk=None, evaluate_local=False)
    np.testing.assert_allclose(out["accuracy"], reference.metrics["global_accuracy"], rtol=0, atol=1e-6)
    assert len(out["gap"]["fedavg"]) == 2 and max(abs(g) for g in out["gap"]["fedavg"]) < 1e-5
    assert min(out["gap"]["fedreg"]) > 0.1  # FedReg's clients did move, on other classes than the previous round's
