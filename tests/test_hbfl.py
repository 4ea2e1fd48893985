"""HBFL (spec section 8), FML, ABAVG, and the engine's architecture groups, stragglers and per-client test splits."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bfedjax as bf
from bfedjax.algorithms.hbfl import entropy_penalty, sample_weights
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, local_training, make_round_step
from bfedjax.core.sampling import NO_BUDGET, sample_cohort, straggler_epochs
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.core.types import Algorithm
from bfedjax.losses import cross_entropy, distillation, masked_mean
from bfedjax.posteriors import DiagGaussian, gaussian_product, gaussian_product_full

GROUPS = (0, 0, 1, 1, 1)  # clients 0-1: architecture 0, clients 2-4: architecture 1


@pytest.fixture(scope="module")
def fed_with_tests(digits):
    train, test = bf.data.dirichlet_train_test(digits.y_train[:500], digits.y_test, 5, alpha=0.5, seed=0)
    return bf.data.stack_clients(digits.x_train[:500], digits.y_train[:500], train, x_test=digits.x_test,
                                 y_test=digits.y_test, num_classes=10, test_parts=test)


@pytest.fixture(scope="module")
def local_models():
    return bf.models.get_model("mlp", 10, hidden=(8,)), bf.models.get_model("logistic", 10)


@pytest.fixture(scope="module")
def hetero_hbfl(tiny_model, local_models):
    return bf.algorithms.hbfl(tiny_model, input_shape=(8, 8, 1), local_models=local_models, batch_size=32,
                              meme_lr=1e-2, lr=0.05, local_epochs=1)


def _one_round(algo, fed, params, config, backend="vmap", key=3):
    state = init_state(algo, params, config, jax.random.PRNGKey(9))
    step = make_round_step(algo, config, backend)
    return step(state, round_arrays(fed), jax.random.PRNGKey(key), traced_hparams(algo, 1))


# --- engine: architecture groups ------------------------------------------------------------------


def test_grouped_round_equals_each_client_alone(hetero_hbfl, fed_with_tests, tiny_params):
    """3 of 5 clients in chunks of 2 over two architectures: the jitted grouped round equals one call per client
    and local_training by hand; HBFL uploads 2d floats and reports the best of meme and local model."""
    config = RoundConfig(5, 3, clients_per_chunk=2, client_groups=GROUPS)
    grouped = _one_round(hetero_hbfl, fed_with_tests, tiny_params, config)
    alone = _one_round(hetero_hbfl, fed_with_tests, tiny_params, config, backend="sequential")
    chex.assert_trees_all_close(grouped, alone, rtol=2e-5, atol=2e-6)
    # and by hand for one sampled client: its new local model is local_training's on its own data
    state = init_state(hetero_hbfl, tiny_params, config, jax.random.PRNGKey(9))
    cohort = sample_cohort(config, round_arrays(fed_with_tests), jax.random.PRNGKey(3), 32, 1)
    slot = next(i for i, c in enumerate(np.asarray(cohort.ids)) if c < 5 and GROUPS[c] == 1)
    client = int(cohort.ids[slot])
    row = client - 2  # clients 2-4 are rows 0-2 of group 1
    ctx = ClientContext(state.server, jax.tree.map(lambda p: p[row], state.persistent[1]),
                        ClientData(*(jnp.asarray(a) for a in (fed_with_tests.x[client], fed_with_tests.y[client], fed_with_tests.counts[client]))),
                        traced_hparams(hetero_hbfl, 1), group=1)
    _, persistent, _ = local_training(hetero_hbfl, ctx, cohort.keys[slot])
    chex.assert_trees_all_close(jax.tree.map(lambda p: p[row], grouped[0].persistent[1]), persistent,
                                rtol=2e-5, atol=2e-6)
    untouched = [r for r in range(3) if r + 2 not in np.asarray(cohort.ids)]
    for r in untouched:  # clients not sampled keep their local model
        chex.assert_trees_all_close(jax.tree.map(lambda p: p[r], grouped[0].persistent[1]),
                                    jax.tree.map(lambda p: p[r], state.persistent[1]))
    # identity 12: 2d floats up (mu and sigma), d down; the paper's per-client accuracy is the better model's
    message = jax.eval_shape(lambda: local_training(hetero_hbfl, ctx, cohort.keys[slot]))[0]
    d = bf.models.num_params(tiny_params)
    assert bf.models.num_params(message) == 2 * d and bf.models.num_params(hetero_hbfl.global_params(state.server)) == d
    metrics = grouped[1]
    assert metrics["client_test_accuracy"] >= max(metrics["client_test_meme_accuracy"],
                                                  metrics["client_test_local_model_accuracy"]) - 1e-6
    assert metrics["mean_meme_scale"] > 0 and metrics["mean_global_scale"] > 0


def test_group_state_has_each_architecture_shape(hetero_hbfl, tiny_params):
    state = init_state(hetero_hbfl, tiny_params, RoundConfig(5, 5, client_groups=GROUPS), jax.random.PRNGKey(0))
    assert state.persistent[0]["local"]["params"]["Dense_0"]["kernel"].shape == (2, 64, 8)  # two MLP clients
    assert state.persistent[1]["local"]["params"]["Dense_0"]["kernel"].shape == (3, 64, 10)  # three logistic
    a, b = (state.persistent[1]["local"]["params"]["Dense_0"]["kernel"][i] for i in (0, 1))
    assert float(jnp.abs(a - b).max()) > 0  # each client draws its own initial local model


def _fedper(trunk_width: int, heads: tuple[int, ...]):
    """FedPer-style personalisation from the engine alone: a shared linear trunk is averaged (streamed
    statistics), each group keeps a head of its own width (label space) in its persistent state."""
    def logits(trunk, head, x):
        return jnp.tanh(x.reshape(x.shape[0], -1) @ trunk) @ head

    def client_init(ctx, key):
        return {"trunk": ctx.server["params"], "head": ctx.persistent}

    def client_step(local, batch, ctx, key):
        loss = lambda p: masked_mean(cross_entropy(logits(p["trunk"], p["head"], batch.x), batch.y), batch.mask)
        grad = jax.grad(loss)(local)
        return jax.tree.map(lambda p, g: p - 0.1 * g, local, grad)

    return Algorithm(
        name="fedper", server_init=lambda params: {"params": params}, client_init=client_init,
        client_step=client_step, client_final=lambda local, ctx: ({"params": local["trunk"]}, local["head"], {}),
        client_stats=lambda message: message["params"],
        server_from_stats=lambda server, total, mask, hparams, key: ({"params": total}, {}),
        persistent_init=lambda params, key, group: 0.1 * jax.random.normal(key, (trunk_width, heads[group])),
        batch_size=16, num_groups=len(heads))


def test_personalised_heads_of_different_label_spaces_stream_in_chunks(small_fed):
    """Groups with different head widths (5 and 10 labels), streamed chunks = one call per client."""
    labels = np.where(np.asarray(GROUPS)[:, None] == 0, small_fed.y % 5, small_fed.y)  # group 0: a 5-label task
    fed = bf.data.FederatedData(small_fed.x, labels.astype(np.int32), small_fed.counts, small_fed.x_test,
                                small_fed.y_test, 10)
    algo = _fedper(6, (5, 10))
    trunk = 0.1 * jax.random.normal(jax.random.PRNGKey(0), (64, 6))
    config = RoundConfig(5, 4, clients_per_chunk=2, client_groups=GROUPS)
    streamed = _one_round(algo, fed, trunk, config)
    alone = _one_round(algo, fed, trunk, config, backend="sequential")
    chex.assert_trees_all_close(streamed, alone, rtol=2e-5, atol=2e-6)
    assert streamed[0].persistent[0].shape == (2, 6, 5) and streamed[0].persistent[1].shape == (3, 6, 10)


def test_groups_are_checked(hetero_hbfl, small_fed):
    with pytest.raises(ValueError, match="client_groups"):
        bf.simulate(hetero_hbfl, small_fed, rounds=1, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="0..1"):
        bf.simulate(hetero_hbfl, small_fed, rounds=1, key=jax.random.PRNGKey(0), client_groups=[0, 1, 2, 0, 0])


# --- engine: stragglers and per-client test splits -----------------------------------------------


def test_stragglers_off_every_client_runs_all_epochs(small_fed):
    config = RoundConfig(5, 5, straggler_fraction=0.0)
    cohort = sample_cohort(config, round_arrays(small_fed), jax.random.PRNGKey(1), 16, 3)
    assert np.all(np.asarray(cohort.budgets) == NO_BUDGET)


def test_straggler_draw_is_shared_and_bounded(small_fed):
    arrays = round_arrays(small_fed)
    config = RoundConfig(5, 5, straggler_fraction=0.4)
    first = straggler_epochs(config, arrays, jax.random.PRNGKey(4), 50)
    again = straggler_epochs(RoundConfig(5, 2, clients_per_chunk=1, straggler_fraction=0.4), arrays,
                             jax.random.PRNGKey(4), 50)
    np.testing.assert_array_equal(first, again)  # the draw depends on the round key and ids only
    assert np.sum(np.asarray(first) < 50) == 2 and np.all(np.asarray(first) >= 1)


def test_straggler_weighting_by_epochs_scales_q_by_x_over_e(small_fed):
    arrays = round_arrays(small_fed)
    key, epochs = jax.random.PRNGKey(4), 50
    unchanged = sample_cohort(RoundConfig(5, 5, straggler_fraction=0.4), arrays, key, 16, epochs)
    scaled = sample_cohort(RoundConfig(5, 5, straggler_fraction=0.4, straggler_weighting="by_epochs"), arrays, key,
                           16, epochs)
    x = np.asarray(straggler_epochs(RoundConfig(5, 5, straggler_fraction=0.4), arrays, key, epochs))
    n = np.asarray(small_fed.counts, np.float64)
    np.testing.assert_allclose(unchanged.weights, n / n.sum(), rtol=1e-6)
    np.testing.assert_allclose(scaled.weights, n * x / epochs / np.sum(n * x / epochs), rtol=1e-6)
    np.testing.assert_array_equal(unchanged.budgets, scaled.budgets)
    with pytest.raises(ValueError, match="straggler_weighting"):
        RoundConfig(5, 5, straggler_weighting="by_size")


def test_step_budget_equals_fewer_epochs(small_fed, tiny_model, tiny_params):
    """A client with a budget of one epoch's steps under E = 3 trains exactly as with E = 1."""
    three = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, local_epochs=3)
    one = three.replace(local_epochs=1)
    data = ClientData(*(jnp.asarray(a) for a in (small_fed.x[1], small_fed.y[1], small_fed.counts[1])))
    ctx = ClientContext({"params": tiny_params}, (), data, traced_hparams(three, 1))
    steps = int(np.ceil(int(small_fed.counts[1]) / 16))
    budgeted = local_training(three, ctx, jax.random.PRNGKey(2), jnp.int32(steps))
    chex.assert_trees_all_close(budgeted, local_training(one, ctx, jax.random.PRNGKey(2)))
    full = local_training(three, ctx, jax.random.PRNGKey(2))
    assert float(jnp.abs(full[0]["params"]["Dense_0"]["kernel"] - budgeted[0]["params"]["Dense_0"]["kernel"]).max()) > 0


def test_train_and_test_splits_share_dirichlet_proportions(digits):
    train, test = bf.data.dirichlet_train_test(digits.y_train, digits.y_test, 4, alpha=0.3, seed=1)
    for parts, labels in ((train, digits.y_train), (test, digits.y_test)):
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat)) and flat.max() < len(labels)  # disjoint
    for tr, te in zip(train, test):
        p_train = np.bincount(digits.y_train[tr], minlength=10) / len(digits.y_train)
        p_test = np.bincount(digits.y_test[te], minlength=10) / len(digits.y_test)
        np.testing.assert_allclose(p_train / np.bincount(digits.y_train, minlength=10) * len(digits.y_train),
                                   p_test / np.bincount(digits.y_test, minlength=10) * len(digits.y_test), atol=0.1)
    iid_train, _ = bf.data.dirichlet_train_test(digits.y_train, digits.y_test, 4, alpha=100.0, seed=1)
    mix = np.stack([np.bincount(digits.y_train[p], minlength=10) / len(p) for p in iid_train])
    assert np.abs(mix - 0.1).max() < 0.05  # alpha = 100: near-uniform label mixes


@pytest.mark.parametrize("chunk", [None, 1])  # vmapped (padding batches scored and masked) and in turn (skipped)
def test_client_test_metrics_use_each_clients_split(fed_with_tests, tiny_model, tiny_params, chunk):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.0, batch_size=32)  # lr 0: every local model is tiny_params
    _, metrics = _one_round(algo, fed_with_tests, tiny_params, RoundConfig(5, 5, clients_per_chunk=chunk))
    task = bf.tasks.classification(tiny_model)
    own = [task.evaluate(tiny_params, *(a[:int(fed_with_tests.test_counts[n])] for a in
                                        (fed_with_tests.x_test_clients[n], fed_with_tests.y_test_clients[n])))
           for n in range(5)]
    np.testing.assert_allclose(metrics["client_test_accuracy"], np.mean([o["accuracy"] for o in own]), rtol=1e-5)


def test_evaluation_skips_batches_that_are_all_padding():
    """``map_real_batches`` scores a batch only if it holds a real row: the others are zeros, not ``score``'s value."""
    from bfedjax.metrics.classification import map_real_batches, padded_batches
    x = jnp.arange(10.0)
    xb, _, mb = padded_batches(x, x, 4)                    # batches of 4, 4 and 2 (+2 padding) rows
    mask = mb * (jnp.arange(12).reshape(3, 4) < 5)          # a client split with 5 real rows: batches 0 and 1
    np.testing.assert_allclose(map_real_batches(lambda b: jnp.sum(b) + 100.0, xb, mask), [106.0, 122.0, 0.0])


# --- HBFL (spec section 8) --------------------------------------------------------------------------


def test_full_product_recovers_least_squares():
    """Identity 1: with Lambda_k = X_k^T X_k / s^2 and q_k = 1 the product's mean is the global LS solution."""
    rng = np.random.default_rng(0)
    theta, s2 = rng.normal(size=5), 0.3
    xs = [rng.normal(loc=k, scale=1 + k, size=(n, 5)) for k, n in enumerate((50, 120, 200))]
    ys = [x @ theta + rng.normal(scale=np.sqrt(s2), size=len(x)) for x in xs]
    means = np.stack([np.linalg.lstsq(x, y, rcond=None)[0] for x, y in zip(xs, ys)])
    precisions = np.stack([x.T @ x / s2 for x in xs])
    np.testing.assert_allclose(precisions @ means[..., None] * s2, np.stack([x.T @ y for x, y in zip(xs, ys)])[..., None],
                               rtol=1e-8)  # (A.4)-(A.5): Lambda_k mu_k = eta_k
    mean, _ = gaussian_product_full(jnp.asarray(means), jnp.asarray(precisions), jnp.ones(3))  # float32
    global_ls = np.linalg.lstsq(np.concatenate(xs), np.concatenate(ys), rcond=None)[0]
    np.testing.assert_allclose(mean, global_ls, rtol=1e-4, atol=1e-5)
    assert np.linalg.norm(means.mean(0) - global_ls) > 1e-2  # averaging the local modes is not the optimum


def test_diagonal_product_is_exact_for_orthogonal_designs():
    """Identity 2: every X_k^T X_k diagonal -> the diagonal product is the full one and the LS solution."""
    rng = np.random.default_rng(1)
    theta, xs, ys = rng.normal(size=4), [], []
    for k in range(3):
        q, _ = np.linalg.qr(rng.normal(size=(40, 4)))
        x = q * rng.uniform(0.5, 3.0, size=4)  # orthogonal columns, different scales
        xs.append(x)
        ys.append(x @ theta + 0.1 * rng.normal(size=40))
    means = jnp.asarray(np.stack([np.linalg.lstsq(x, y, rcond=None)[0] for x, y in zip(xs, ys)]), jnp.float32)
    diag = jnp.asarray(np.stack([np.diag(x.T @ x) for x in xs]), jnp.float32)
    product = gaussian_product(DiagGaussian(means, diag), jnp.ones(3))
    global_ls = np.linalg.lstsq(np.concatenate(xs), np.concatenate(ys), rcond=None)[0]
    np.testing.assert_allclose(product.mean, global_ls, rtol=1e-4, atol=1e-5)


def _server(algo, means, scales, weights, mask=None):
    mask = jnp.ones(len(weights)) if mask is None else mask
    return algo.server_update(None, {"params": means, "scale": scales}, jnp.asarray(weights, jnp.float32), mask, {},
                              jax.random.PRNGKey(0))[0]


def test_hbfl_and_its_baselines_default_to_the_specs_common_setting(tiny_model, small_fed):
    """Spec section 4: E = 5 and B = 128 for HBFL, FML and ABAVG; SGD 0.01 for the conventional nets, Adam
    1e-3 for the meme."""
    validation = (small_fed.x_test[:10], small_fed.y_test[:10])
    built = {"hbfl": bf.algorithms.hbfl(tiny_model, input_shape=(8, 8, 1)),
             "fml": bf.algorithms.fml(tiny_model, input_shape=(8, 8, 1)),
             "abavg": bf.algorithms.abavg(tiny_model, validation=validation)}
    for name, algo in built.items():
        assert (algo.local_epochs, algo.batch_size, algo.hparams["lr"]) == (5, 128, 0.01), name
    assert built["hbfl"].hparams["meme_lr"] == 1e-3


def test_hbfl_server_limits_and_invariances(tiny_model):
    algo = bf.algorithms.hbfl(tiny_model, input_shape=(8, 8, 1))
    equal = bf.algorithms.hbfl(tiny_model, input_shape=(8, 8, 1), weighting="equal")
    rng = np.random.default_rng(2)
    means = {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)}
    scales = {"w": jnp.asarray(rng.uniform(0.01, 0.1, size=(4, 6)), jnp.float32)}
    q = np.array([0.1, 0.2, 0.3, 0.4])
    out = _server(algo, means, scales, q)
    # identity 3: equal sigma -> the q-weighted mean (FedAvg); with equal q the plain mean
    same = {"w": jnp.full((4, 6), 0.05)}
    np.testing.assert_allclose(_server(algo, means, same, q)["params"]["w"], q @ means["w"], rtol=1e-5)
    np.testing.assert_allclose(_server(equal, means, same, q)["params"]["w"], means["w"].mean(0), rtol=1e-5)
    # identity 4: precisions times c (T changed), q times c, client order: mu_g unchanged
    np.testing.assert_allclose(_server(algo, means, {"w": 3.0 * scales["w"]}, q)["params"]["w"], out["params"]["w"],
                               rtol=1e-5)
    np.testing.assert_allclose(_server(algo, means, scales, 5.0 * q)["params"]["w"], out["params"]["w"], rtol=1e-5)
    order = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(_server(algo, {"w": means["w"][order]}, {"w": scales["w"][order]}, q[order])
                               ["params"]["w"], out["params"]["w"], rtol=1e-5)
    # identity 5: convex combination; one client alone returns its mean; a dominant precision decides
    assert np.all(out["params"]["w"] >= means["w"].min(0) - 1e-6) and np.all(out["params"]["w"] <= means["w"].max(0) + 1e-6)
    alone = jnp.array([0., 1., 0., 0.])
    np.testing.assert_allclose(_server(algo, means, scales, alone, mask=alone)["params"]["w"], means["w"][1], rtol=1e-5)
    sharp = {"w": scales["w"].at[3, 0].set(1e-6)}
    np.testing.assert_allclose(_server(algo, means, sharp, q)["params"]["w"][0], means["w"][3, 0], rtol=1e-4)
    # identity 6: Sigma_g = 1 / sum q_k lambda_k; equal sigma and q summing to 1 -> sigma^2
    np.testing.assert_allclose(out["scale"]["w"] ** 2, 1.0 / (q @ (1.0 / scales["w"] ** 2)), rtol=1e-5)
    np.testing.assert_allclose(_server(algo, means, same, q)["scale"]["w"], 0.05, rtol=1e-5)
    # ... and with q_k = 1 (weighting="equal", Decision 9) sigma^2 / N
    np.testing.assert_allclose(_server(equal, means, same, q)["scale"]["w"], 0.05 / np.sqrt(4), rtol=1e-5)


def test_meme_stationary_variance_is_t_over_h():
    """Identity 7: for NLL = h/2 (theta - m)^2, E_q[NLL] - T sum log sigma is minimised at mu = m, sigma^2 = T/h."""
    h, m, temperature = 400.0, 0.7, 1e-4
    def loss(p):
        sigma = jax.nn.softplus(p["rho"])
        return 0.5 * h * ((p["mu"] - m) ** 2 + sigma ** 2) + entropy_penalty(p["rho"], temperature)
    opt = optax.adam(1e-2)

    def step(_, carry):
        params, state = carry
        updates, state = opt.update(jax.grad(loss)(params), state)
        return optax.apply_updates(params, updates), state

    params = {"mu": jnp.float32(0.0), "rho": jnp.float32(-5.0)}
    params, _ = jax.jit(lambda p: jax.lax.fori_loop(0, 3000, step, (p, opt.init(p))))(params)
    assert abs(float(params["mu"]) - m) < 1e-3
    np.testing.assert_allclose(float(jax.nn.softplus(params["rho"])) ** 2, temperature / h, rtol=0.05)


def test_meme_forward_and_entropy_gradient(tiny_model, tiny_params, digits):
    """Identity 8: sigma -> 0 gives the deterministic net; d(-T sum log sigma)/d rho = -T sigmoid(rho)/softplus(rho)."""
    meme = {"mu": tiny_params, "rho": jax.tree.map(lambda p: jnp.full_like(p, -40.0), tiny_params)}
    apply_fn = bf.models.apply_fn_of(tiny_model)
    np.testing.assert_allclose(apply_fn(sample_weights(meme, jax.random.PRNGKey(0)), digits.x_test[:20]),
                               apply_fn(tiny_params, digits.x_test[:20]), rtol=1e-6, atol=1e-6)
    rho = jnp.array([-5.0, -1.0, 2.0])
    np.testing.assert_allclose(jax.grad(lambda r: entropy_penalty(r, 1e-4))(rho),
                               -1e-4 * jax.nn.sigmoid(rho) / jax.nn.softplus(rho), rtol=1e-5)


def test_distillation_limits():
    """Identity 9: alpha = 1 is CE; KL(q||q) = 0; the teacher gets no gradient."""
    rng = np.random.default_rng(3)
    student, teacher = (jnp.asarray(rng.normal(size=(6, 4)), jnp.float32) for _ in range(2))
    y, mask = jnp.array([0, 1, 2, 3, 0, 1]), jnp.array([1., 1., 1., 1., 1., 0.])
    np.testing.assert_allclose(distillation(student, teacher, y, mask, 1.0), masked_mean(cross_entropy(student, y), mask),
                               rtol=1e-6)
    np.testing.assert_allclose(distillation(student, student, y, mask, 0.0), 0.0, atol=1e-6)
    assert float(distillation(student, teacher, y, mask, 0.0)) > 0
    assert float(jnp.abs(jax.grad(lambda t: distillation(student, t, y, mask, 0.5))(teacher)).max()) == 0.0
    # temperature T: the KL part scales by T^2 of the softened distributions
    t2 = distillation(student, teacher, y, mask, 0.0, temperature=2.0)
    soft = distillation(student / 2.0, teacher / 2.0, y, mask, 0.0)
    np.testing.assert_allclose(t2, 4.0 * soft, rtol=1e-5)


def test_fml_memes_are_averaged_and_abavg_weights_by_validation_accuracy(tiny_model, local_models, fed_with_tests,
                                                                         tiny_params, digits):
    fml = bf.algorithms.fml(tiny_model, input_shape=(8, 8, 1), local_models=local_models, batch_size=32,
                            local_epochs=1)
    means = {"w": jnp.arange(12.0).reshape(3, 4)}
    server, _ = fml.server_update(None, {"params": means}, jnp.array([0.7, 0.3, 0.0]), jnp.array([1., 1., 0.]), {},
                                  jax.random.PRNGKey(0))
    np.testing.assert_allclose(server["params"]["w"], means["w"][:2].mean(0))  # FML: plain mean of the memes
    _, metrics = _one_round(fml, fed_with_tests, tiny_params, RoundConfig(5, 5, client_groups=GROUPS))
    assert metrics["client_test_accuracy"] >= metrics["client_test_meme_accuracy"] - 1e-6

    x_val, y_val = digits.x_test[:200], digits.y_test[:200]
    abavg = bf.algorithms.abavg(tiny_model, validation=(x_val, y_val), batch_size=32)
    good = tiny_params
    bad = jax.tree.map(jnp.zeros_like, tiny_params)  # predicts class 0 everywhere
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), good, bad)
    server, metrics = abavg.server_update(None, {"params": stacked}, jnp.array([0.5, 0.5]), jnp.ones(2), {},
                                          jax.random.PRNGKey(0))
    task = bf.tasks.classification(tiny_model)
    acc = np.array([float(task.evaluate(p, x_val, y_val)["accuracy"]) for p in (good, bad)])
    share = acc / acc.sum()
    chex.assert_trees_all_close(server["params"], jax.tree.map(lambda a, b: share[0] * a + share[1] * b, good, bad),
                                rtol=1e-5, atol=1e-6)


def test_abavg_client_reported_accuracy_weights_by_size_times_accuracy(tiny_model, tiny_params, fed_with_tests,
                                                                        small_fed):
    """Spec Decision 15's option: each client reports its model's accuracy on its own test split; the server
    weights by n_k acc_k. Every backend hands the client its split."""
    algo = bf.algorithms.abavg(tiny_model, accuracy_source="client_test", weighting="accuracy_by_size", lr=0.1,
                               batch_size=32, local_epochs=1)
    task = bf.tasks.classification(tiny_model)
    k = 2
    data = ClientData(*(jnp.asarray(a) for a in (fed_with_tests.x[k], fed_with_tests.y[k], fed_with_tests.counts[k])))
    m = int(fed_with_tests.test_counts[k])
    test = ClientData(jnp.asarray(fed_with_tests.x_test_clients[k]), jnp.asarray(fed_with_tests.y_test_clients[k]),
                      jnp.int32(m))
    ctx = ClientContext({"params": tiny_params}, (), data, traced_hparams(algo, 1), 0, test)
    message, _, _ = local_training(algo, ctx, jax.random.PRNGKey(0))
    own = task.evaluate(message["params"], fed_with_tests.x_test_clients[k, :m], fed_with_tests.y_test_clients[k, :m])
    np.testing.assert_allclose(message["reported_accuracy"], own["accuracy"], rtol=1e-6)

    good, bad = tiny_params, jax.tree.map(jnp.zeros_like, tiny_params)
    stacked = {"params": jax.tree.map(lambda a, b: jnp.stack([a, b]), good, bad),
               "reported_accuracy": jnp.array([0.8, 0.2])}
    server, metrics = algo.server_update(None, stacked, jnp.array([0.25, 0.75]), jnp.ones(2), {},
                                         jax.random.PRNGKey(0))
    share = np.array([0.25 * 0.8, 0.75 * 0.2]) / (0.25 * 0.8 + 0.75 * 0.2)
    chex.assert_trees_all_close(server["params"], jax.tree.map(lambda a, b: share[0] * a + share[1] * b, good, bad),
                                rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["mean_validation_accuracy"], 0.5, rtol=1e-6)

    config = RoundConfig(5, 5)
    state, metrics = _one_round(algo, fed_with_tests, tiny_params, config)
    chex.assert_trees_all_close((state, metrics), _one_round(algo, fed_with_tests, tiny_params, config,
                                                             backend="sequential"), rtol=2e-5, atol=2e-6)
    assert 0 < float(metrics["mean_validation_accuracy"]) <= 1
    with pytest.raises(ValueError, match="own test split"):
        _one_round(algo, small_fed, tiny_params, config)
    with pytest.raises(ValueError, match="validation"):
        bf.algorithms.abavg(tiny_model)


@pytest.mark.parametrize("method", ["hbfl", "fml"])
def test_objective_heterogeneity_shares_the_trunk_and_keeps_each_tasks_head(digits, method):
    """Two tasks with different label spaces (digits: 10 labels; their parity: 2) federate a trunk (HBFL:
    Bayesian; FML: its baseline); each group keeps its own head; HBFL's grouped round equals one call per client."""
    x, y = digits.x_train, digits.y_train
    halves = [np.arange(60), np.arange(60, 120)]
    digit_task = bf.data.stack_clients(x[:120], y[:120], halves, x_test=digits.x_test[:100],
                                       y_test=digits.y_test[:100], num_classes=10)
    parity_task = bf.data.stack_clients(x[120:240], y[120:240] % 2, halves, x_test=digits.x_test[100:200],
                                        y_test=digits.y_test[100:200] % 2, num_classes=2)
    fed, tasks = bf.data.join_tasks([digit_task, parity_task])
    np.testing.assert_array_equal(tasks, [0, 0, 1, 1])
    assert fed.test_counts.tolist() == [100, 100, 100, 100] and fed.y_test_clients[2].max() == 1
    trunk = bf.models.get_model("mlp", 8, hidden=(16,))  # x -> 8 features
    heads = (bf.models.Logistic(num_classes=10), bf.models.Logistic(num_classes=2))
    if method == "hbfl":
        algo = bf.algorithms.hbfl(trunk, input_shape=(8, 8, 1), local_models=(), head_models=heads, batch_size=20,
                                  meme_lr=1e-2, lr=0.1, local_epochs=1)
        head_kernel = lambda persistent: persistent["head"]["params"]["Dense_0"]["kernel"]
    else:
        local = (bf.models.Logistic(num_classes=10), bf.models.Logistic(num_classes=2))
        algo = bf.algorithms.fml(trunk, input_shape=(8, 8, 1), local_models=local, head_models=heads, batch_size=20,
                                 lr=0.1, local_epochs=1)
        head_kernel = lambda persistent: persistent["head"]["Dense_0"]["kernel"]
    params = algo.init_params(jax.random.PRNGKey(0), (8, 8, 1))
    config = RoundConfig(4, 4, client_groups=tuple(tasks))
    grouped = _one_round(algo, fed, params, config)
    if method == "hbfl":  # the engine's grouping against one call per client (FML's heads ride the same path)
        chex.assert_trees_all_close(grouped, _one_round(algo, fed, params, config, backend="sequential"),
                                    rtol=2e-5, atol=2e-6)
    state, metrics = grouped
    assert "global_accuracy" not in metrics and 0 <= metrics["client_test_accuracy"] <= 1
    assert head_kernel(state.persistent[0]).shape == (2, 8, 10)
    assert head_kernel(state.persistent[1]).shape == (2, 8, 2)
    assert bf.models.num_params(state.server["params"]) == bf.models.num_params(params)  # the trunk only
    start = init_state(algo, params, config, jax.random.PRNGKey(9))
    assert float(jnp.abs(head_kernel(state.persistent[1]) - head_kernel(start.persistent[1])).max()) > 0  # heads train
    assert float(jnp.abs(state.server["params"]["Dense_0"]["kernel"] - params["Dense_0"]["kernel"]).max()) > 0