"""FedAvg / FedProx / FedCurv / FOLA identities (FOLA spec section 8, items 10-14)."""
import dataclasses
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bfedjax as bf
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, local_training, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.laplace import offline_fisher
from bfedjax.posteriors import quadratic_penalty


def _one_round(algo, fed, params, key=0, r=1, state=None):
    state = state or init_state(algo, params, RoundConfig(fed.num_clients, fed.num_clients))
    step = make_round_step(algo, RoundConfig(fed.num_clients, fed.num_clients), "vmap")
    return step(state, round_arrays(fed), jax.random.PRNGKey(key), traced_hparams(algo, r))


def _client(fed, n):
    return ClientData(jnp.asarray(fed.x[n]), jnp.asarray(fed.y[n]), jnp.int32(fed.counts[n]))


def test_fedprox_with_mu_zero_is_fedavg(small_fed, tiny_model, tiny_params):
    avg = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, clip_norm=None)
    prox = bf.algorithms.fedprox(tiny_model, mu=0.0, lr=0.1, batch_size=16)
    chex.assert_trees_all_close(_one_round(avg, small_fed, tiny_params), _one_round(prox, small_fed, tiny_params),
                                rtol=1e-6, atol=1e-7)


def test_fola_with_equal_precisions_is_fedavg(small_fed, tiny_model, tiny_params):
    """lam = 0 makes FOLA's clients FedAvg's; equal precisions make the product FedAvg's mean."""
    avg = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    fola = bf.algorithms.fola(tiny_model, lr=0.1, lam=0.0, batch_size=16, eps=0.0)
    server = avg.server_init(tiny_params)
    avg_msgs, fola_msgs = [], []
    for n in range(small_fed.num_clients):
        key = jax.random.PRNGKey(n)
        avg_msgs.append(local_training(avg, ClientContext(server, (), _client(small_fed, n),
                                                          traced_hparams(avg, 1)), key)[0])
        fola_msgs.append(local_training(fola, ClientContext(fola.server_init(tiny_params), (), _client(small_fed, n),
                                                            traced_hparams(fola, 1)), key)[0])
    stack = lambda ms: jax.tree.map(lambda *xs: jnp.stack(xs), *ms)
    avg_msgs, fola_msgs = stack(avg_msgs), stack(fola_msgs)
    chex.assert_trees_all_close(avg_msgs["params"], fola_msgs["params"], rtol=1e-6)
    fola_msgs["precision"] = jax.tree.map(lambda p: jnp.full_like(p, 2.5), fola_msgs["precision"])
    w, mask, key = jnp.asarray(small_fed.weights), jnp.ones(small_fed.num_clients), jax.random.PRNGKey(0)
    chex.assert_trees_all_close(
        fola.aggregate(fola.server_init(tiny_params), fola_msgs, w, mask, traced_hparams(fola, 1), key)[0]["params"],
        avg.aggregate(server, avg_msgs, w, mask, traced_hparams(avg, 1), key)[0]["params"], rtol=1e-5, atol=1e-7)


def test_fola_round_one_differs_from_fedavg_only_through_aggregation(small_fed, tiny_model, tiny_params):
    avg_state, avg_m = _one_round(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16), small_fed, tiny_params)
    fola_state, fola_m = _one_round(bf.algorithms.fola(tiny_model, lr=0.1, lam=1e3, batch_size=16), small_fed,
                                    tiny_params)
    # Prior precision is zero in round 1, so the local models (LA) agree; the aggregates do not.
    np.testing.assert_allclose(avg_m["local_accuracy"], fola_m["local_accuracy"], rtol=1e-6)
    assert not np.allclose(avg_state.server["params"]["Dense_0"]["kernel"],
                           fola_state.server["params"]["Dense_0"]["kernel"])


def test_detached_prior_equals_lambda_zero(small_fed, tiny_model, tiny_params):
    detached = bf.algorithms.fola(tiny_model, lr=0.1, lam=1e3, batch_size=16, profile="authors_code")
    zero = bf.algorithms.fola(tiny_model, lr=0.1, lam=0.0, batch_size=16)
    s1, _ = _one_round(detached, small_fed, tiny_params)
    s2, _ = _one_round(zero, small_fed, tiny_params)
    chex.assert_trees_all_equal(_one_round(detached, small_fed, tiny_params, r=2, state=s1)[0],
                                _one_round(zero, small_fed, tiny_params, r=2, state=s2)[0])


def _one_sgd_step(small_fed, tiny_model, tiny_params, **client_options):
    """Weights after one local SGD step (lr 0.1, lam 7) on client 0's first 16 samples, with the prior
    ``(center = theta + 0.3, precision = |theta| + 0.5)`` when ``prior=True``; also returns that prior."""
    from bfedjax.algorithms.local_sgd import make_sgd_client
    center = jax.tree.map(lambda p: p + 0.3, tiny_params)
    precision = jax.tree.map(lambda p: jnp.abs(p) + 0.5, tiny_params)
    prior_fn = (lambda ctx: (center, precision)) if client_options.pop("prior") else None
    init, step = make_sgd_client(tiny_model, prior_fn=prior_fn, **client_options)
    data = _client(small_fed, 0)
    batch = bf.core.Batch(data.x[:16], data.y[:16], jnp.ones(16))
    ctx = ClientContext({"params": tiny_params}, (), data, {"lr": jnp.float32(0.1), "lam": jnp.float32(7.0)})
    return step(init(ctx, None), batch, ctx, jax.random.PRNGKey(0)).params, center, precision


def test_the_local_step_adds_lambda_precision_times_offset(small_fed, tiny_model, tiny_params):
    """One local SGD step with a prior moves theta by -lr * (g + lam * precision * (theta - center))."""
    with_prior, center, precision = _one_sgd_step(small_fed, tiny_model, tiny_params, prior=True, clip_norm=None)
    without, _, _ = _one_sgd_step(small_fed, tiny_model, tiny_params, prior=False, clip_norm=None)
    pull = jax.tree.map(lambda p, c, t: 7.0 * p * (t - c), precision, center, tiny_params)
    chex.assert_trees_all_close(jax.tree.map(lambda a, b: (b - a) / 0.1, with_prior, without), pull, rtol=1e-4,
                                atol=1e-6)
    # the same pull is the gradient of lam * quadratic_penalty, the prior's loss (FOLA Eq. 15)
    chex.assert_trees_all_close(jax.grad(lambda t: 7.0 * quadratic_penalty(t, center, precision))(tiny_params), pull,
                                rtol=1e-6)


def test_global_norm_and_dot_match_float64_sums_on_every_leaf_rank():
    """tree_squared_norm / tree_dot (the clip norm's and FedReg's projections' sums; row_sums takes a matrix-vector
    product on a CPU) against float64 numpy, eagerly, jitted, vmapped, and on a weight gradient (whose layout
    XLA transposes)."""
    from bfedjax.tree import row_sums, tree_dot, tree_squared_norm
    rng = np.random.default_rng(0)
    shapes = {"s": (), "b": (7,), "k": (33, 20), "c": (3, 3, 4, 5)}
    a = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    b = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    f64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
    norm2, dot = sum(np.sum(x * x) for x in f64(a)), sum(np.sum(x * y) for x, y in zip(f64(a), f64(b)))
    for fn in (lambda t, u: (tree_squared_norm(t), tree_dot(t, u)),
               jax.jit(lambda t, u: (tree_squared_norm(t), tree_dot(t, u)))):
        got_norm2, got_dot = fn(a, b)
        np.testing.assert_allclose([float(got_norm2), float(got_dot)], [norm2, dot], rtol=1e-5)
    stacked = jax.tree.map(lambda x: jnp.stack([x, 3 * x]), a)
    np.testing.assert_allclose(jax.vmap(tree_squared_norm)(stacked), [norm2, 9 * norm2], rtol=1e-5)
    x = jnp.asarray(rng.normal(size=(6, 33)), jnp.float32)
    grad = jax.jit(jax.grad(lambda k: tree_squared_norm(jnp.tanh(x @ k))))(a["k"])  # the norm under autodiff too
    h = np.tanh(np.asarray(x, np.float64) @ np.asarray(a["k"], np.float64))
    np.testing.assert_allclose(grad, np.asarray(x, np.float64).T @ (2 * h * (1 - h * h)), rtol=1e-4, atol=1e-5)
    kernel_grad = jax.grad(lambda k: jnp.sum(jnp.tanh(x @ k)))
    np.testing.assert_allclose(float(jax.jit(lambda k: tree_squared_norm(kernel_grad(k)))(a["k"])),
                               np.sum(np.asarray(kernel_grad(a["k"]), np.float64) ** 2), rtol=1e-5)
    np.testing.assert_allclose(row_sums(a["k"]), np.asarray(a["k"], np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert float(tree_squared_norm({**a, "empty": jnp.ones((4, 0, 3))})) == pytest.approx(norm2, rel=1e-5)
    with pytest.raises(ValueError, match="real arrays of one shape"):
        tree_dot(a, {**b, "k": b["k"][:1]})


def test_sum_over_rows_adds_every_rows_terms_of_a_pytree():
    """tree.sum_over_rows (the order statistics' counts, the robust product's sums): a row at a time, every row
    once, the first included, for each leaf of the terms' pytree."""
    from bfedjax.tree import sum_over_rows
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3, 4)), jnp.float32)
    counts, weighted = jax.jit(lambda x: sum_over_rows(lambda c: ((x[c] > 0).astype(jnp.int32), (c + 1) * x[c]),
                                                       x.shape[0]))(x)
    np.testing.assert_array_equal(counts, np.sum(np.asarray(x) > 0, axis=0))
    np.testing.assert_allclose(weighted, np.tensordot(np.arange(1, 6), np.asarray(x, np.float64), axes=1), rtol=1e-5)
    one = sum_over_rows(lambda c: x[c], 1)
    np.testing.assert_array_equal(one, x[0])
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):  # the vmapped form accelerators take
        gpu_form = lambda x: sum_over_rows(lambda c: ((x[c] > 0).astype(jnp.int32), (c + 1) * x[c]), 5)
        program = str(jax.make_jaxpr(gpu_form)(x))
        assert "scan" not in program and "while" not in program  # no loop over the rows
        on_gpu = jax.jit(gpu_form)(x)
    np.testing.assert_array_equal(on_gpu[0], counts)
    np.testing.assert_allclose(on_gpu[1], weighted, rtol=1e-5)


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_clipping_scales_the_gradient_with_the_prior_pull_by_its_norm(small_fed, tiny_model, tiny_params,
                                                                       weight_decay):
    """With a prior and clipping, theta moves by -lr * clip_by_global_norm(g + pull (+ decay)): the norm is the
    total's."""
    from bfedjax.algorithms.local_sgd import add_kernel_decay
    clipped, center, precision = _one_sgd_step(small_fed, tiny_model, tiny_params, prior=True, clip_norm=0.5,
                                               weight_decay=weight_decay)
    plain, _, _ = _one_sgd_step(small_fed, tiny_model, tiny_params, prior=False, clip_norm=None)
    total = jax.tree.map(lambda t, u, p, c: (t - u) / 0.1 + 7.0 * p * (t - c), tiny_params, plain, precision, center)
    total = add_kernel_decay(total, tiny_params, weight_decay) if weight_decay else total
    assert float(optax.tree.norm(total)) > 5.0  # clipping is active
    expected_step, _ = optax.clip_by_global_norm(0.5).update(total, optax.EmptyState())
    chex.assert_trees_all_close(jax.tree.map(lambda t, c: (t - c) / 0.1, tiny_params, clipped), expected_step,
                                rtol=1e-3, atol=1e-6)


def test_stateful_optimisers_clip_as_optax_does():
    """``local_sgd.clip_by_global_norm`` (the momentum / Adam path's clip, summed by ``tree_squared_norm``) gives
    ``optax.clip_by_global_norm``'s updates above and below the norm, including a weight-gradient-shaped leaf."""
    from bfedjax.algorithms.local_sgd import clip_by_global_norm, direction_transform
    key = jax.random.PRNGKey(3)
    tree = {"kernel": jax.random.normal(key, (64, 32)), "bias": jnp.arange(5.0), "empty": jnp.zeros((0, 3))}
    norm = float(optax.tree.norm(tree))
    for clip in (0.5 * norm, 2.0 * norm):
        got, _ = jax.jit(clip_by_global_norm(clip).update)(tree, optax.EmptyState())
        want, _ = optax.clip_by_global_norm(clip).update(tree, optax.EmptyState())
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    halved, _ = clip_by_global_norm(0.5 * norm).update(tree, optax.EmptyState())
    np.testing.assert_allclose(float(optax.tree.norm(halved)), 0.5 * norm, rtol=1e-5)
    # the Adam chain clips first: a gradient scaled 100x gives the same first Adam step as the clipped one
    tx = direction_transform(1.0, optimizer="adam")
    big, _ = tx.update(jax.tree.map(lambda x: 100.0 * x, tree), tx.init(tree))
    clipped, _ = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam()).update(
        jax.tree.map(lambda x: 100.0 * x, tree), tx.init(tree))
    chex.assert_trees_all_close(big, clipped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("epochs", [1, 3])
def test_fisher_estimators_at_frozen_weights(small_fed, tiny_model, tiny_params, epochs):
    """lr = 0: batch_mean_sq with B = 1 is the per-sample Fisher (Eq. 21), E-fold over E epochs."""
    n = 0
    data = _client(small_fed, n)
    apply_fn = bf.models.apply_fn_of(tiny_model)
    eq21 = offline_fisher(apply_fn, tiny_params, data, 8, "per_sample_sq")

    def fisher_of(**options):
        algo = bf.algorithms.fola(tiny_model, lr=0.0, lam=0.0, local_epochs=epochs, eps=0.0, **options)
        ctx = ClientContext(algo.server_init(tiny_params), (), data, traced_hparams(algo, 1))
        return local_training(algo, ctx, jax.random.PRNGKey(0))[0]["precision"]

    b1 = bf.algorithms.fola(tiny_model, lr=0.0, lam=0.0, local_epochs=epochs, batch_size=1, eps=0.0)
    ctx = ClientContext(b1.server_init(tiny_params), (), data, traced_hparams(b1, 1))
    batch_one = local_training(b1, ctx, jax.random.PRNGKey(0))[0]["precision"]
    chex.assert_trees_all_close(batch_one, jax.tree.map(lambda f: epochs * f, eq21), rtol=2e-4, atol=1e-9)
    chex.assert_trees_all_close(fisher_of(fisher="per_sample_sq", normalisation="mean_over_steps"), eq21,
                                rtol=2e-4, atol=1e-9)
    whole = bf.algorithms.fola(tiny_model, lr=0.0, lam=0.0, local_epochs=1, batch_size=small_fed.max_n, eps=0.0)
    ctx = ClientContext(whole.server_init(tiny_params), (), data, traced_hparams(whole, 1))
    jensen = local_training(whole, ctx, jax.random.PRNGKey(0))[0]["precision"]
    for a, b in zip(jax.tree.leaves(jensen), jax.tree.leaves(eq21)):
        assert np.all(np.asarray(a) <= np.asarray(b) * (1 + 1e-4) + 1e-9)


def test_running_sum_and_running_average_share_the_mean(small_fed, tiny_model, tiny_params):
    """With lam = 0 and eps = 0 both precision modes give the same mu_S; omega_S,R = R * Lambda_S,R."""
    run = lambda mode: bf.simulate(bf.algorithms.fola(tiny_model, lr=0.1, lam=0.0, batch_size=16, eps=0.0,
                                                      precision_mode=mode),
                                   small_fed, rounds=3, key=jax.random.PRNGKey(0), init_params=tiny_params,
                                   evaluate_local=False).state.server
    total, average = run("running_sum"), run("running_average")
    chex.assert_trees_all_close(total["params"], average["params"], rtol=2e-4, atol=1e-6)
    chex.assert_trees_all_close(total["precision"], jax.tree.map(lambda p: 3.0 * p, average["precision"]),
                                rtol=1e-4, atol=1e-12)


def test_fisher_options_at_frozen_weights(small_fed, tiny_model, tiny_params):
    """lr = 0 keeps every client at theta_0, so each option's round-1 precision has a closed form."""
    apply_fn = bf.models.apply_fn_of(tiny_model)
    pi = small_fed.weights

    def precision_after_one_round(batch_size=16, **options):
        algo = bf.algorithms.fola(tiny_model, lr=0.0, lam=1.0, batch_size=batch_size, **options)
        res = bf.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params=tiny_params,
                          evaluate_local=False)
        return res.state.server["precision"]

    def pooled(per_client):
        return jax.tree.map(lambda *fs: sum(w * f for w, f in zip(pi, fs)), *per_client)

    offline = lambda estimator: [offline_fisher(apply_fn, tiny_params, _client(small_fed, n), 16, estimator)
                                 for n in range(small_fed.num_clients)]
    # "offline": one pass at the final (= initial) weights, pooled with the clients' weights
    chex.assert_trees_all_close(precision_after_one_round(fisher="offline"), pooled(offline("batch_mean_sq")),
                                rtol=1e-4, atol=1e-10)
    # the paper's profile (per-sample Fisher, 1/T per epoch, running average): Eq. 21 at theta_0
    chex.assert_trees_all_close(precision_after_one_round(profile="paper"), pooled(offline("per_sample_sq")),
                                rtol=1e-4, atol=1e-10)
    # damping adds delta to every client's Fisher, so delta to the pooled precision (weights sum to 1)
    base = precision_after_one_round()
    chex.assert_trees_all_close(precision_after_one_round(damping=1e-3), jax.tree.map(lambda p: p + 1e-3, base),
                                rtol=1e-5, atol=1e-9)
    # alg1_raw with mean_over_steps and one whole-client batch: the squared full-data gradient
    def squared_gradient(n):
        data = _client(small_fed, n)
        batch = bf.core.Batch(data.x, data.y, (jnp.arange(data.y.shape[0]) < data.count).astype(jnp.float32))
        return jax.tree.map(jnp.square, jax.grad(bf.losses.masked_mean_cross_entropy, argnums=1)(
            apply_fn, tiny_params, batch))
    chex.assert_trees_all_close(
        precision_after_one_round(small_fed.max_n, fisher="alg1_raw", normalisation="mean_over_steps",
                                  clip_norm=None),
        pooled([squared_gradient(n) for n in range(small_fed.num_clients)]), rtol=2e-4, atol=1e-10)


def test_fedcurv_leave_one_out_bookkeeping(small_fed, tiny_model, tiny_params):
    """The server's U equals the sum of every client's latest Fisher."""
    algo = bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16, variant="leave_one_out")
    res = bf.simulate(algo, small_fed, rounds=2, key=jax.random.PRNGKey(0), init_params=tiny_params,
                      clients_per_round=3, evaluate_local=False)
    chex.assert_trees_all_close(res.state.server["u_sum"], jax.tree.map(lambda u: u.sum(0), res.state.persistent[0]["u"]),
                                rtol=1e-5, atol=1e-10)


def test_fola_reports_precision_diagnostics_of_the_global_precision(small_fed, tiny_model, tiny_params):
    """Spec section 7: of Lambda_S, which the default running sum omega_S holds times r after round r."""
    res = bf.simulate(bf.algorithms.fola(tiny_model, lr=0.1, lam=1.0, batch_size=16), small_fed, rounds=2,
                      key=jax.random.PRNGKey(0), init_params=tiny_params, evaluate_local=False)
    global_precision = np.concatenate([np.ravel(p) for p in jax.tree.leaves(res.state.server["precision"])]) / 2
    np.testing.assert_allclose(res.metrics["precision_median"][-1], np.median(global_precision), rtol=1e-5)
    np.testing.assert_allclose(res.metrics["precision_below_eps"][-1], np.mean(global_precision < 1e-5), rtol=1e-5)
    fola = bf.algorithms.fola(tiny_model)
    stats = fola.client_stats({"params": tiny_params, "precision": jax.tree.map(jnp.ones_like, tiny_params)})
    with pytest.raises(ValueError, match=r"hparams\['round'\].*fix: aggregate through the engine"):
        fola.server_from_stats(fola.server_init(tiny_params), stats, jnp.ones(1), {}, None)


def test_fola_paper_profile_defaults_lambda_to_its_grid_and_eps0_keeps_uninformed_means(small_fed, tiny_model,
                                                                                       tiny_params):
    """Spec D9: the per-sample Fisher's lambda grid is {1, 10, 100} (the code's 1e3 diverged: GA 0.10 from round 2);
    D4: with eps = 0 a coordinate no client has curvature for (here the weights of an input pixel set to 0) was
    0 / 0, NaN, and every client was dropped as non-finite from the next round on."""
    assert bf.algorithms.fola(tiny_model, profile="paper").hparams["lam"] == 1.0
    assert bf.algorithms.fola(tiny_model).hparams["lam"] == 1e3
    assert bf.algorithms.fola(tiny_model, profile="paper", lam=10.0).hparams["lam"] == 10.0
    x = np.array(small_fed.x)
    x[:, :, 0, 0, :] = 0.0  # input 0 of the flattened 8x8 image
    fed = dataclasses.replace(small_fed, x=x)
    res = bf.simulate(bf.algorithms.fola(tiny_model, lr=0.1, batch_size=16, profile="paper"), fed, rounds=2,
                      key=jax.random.PRNGKey(0), init_params=tiny_params, evaluate_local=False)
    kernel, precision = res.state.server["params"]["Dense_0"]["kernel"], res.state.server["precision"]["Dense_0"]["kernel"]
    assert np.all(np.asarray(precision[0]) == 0) and np.all(np.asarray(precision[1:]) > 0)
    np.testing.assert_array_equal(kernel[0], tiny_params["Dense_0"]["kernel"][0])
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(res.state.server))
    assert res.metrics["nonfinite_clients"] == [0.0, 0.0]


def test_bad_options_are_rejected(tiny_model):
    with pytest.raises(ValueError, match="fisher"):
        bf.algorithms.fola(tiny_model, fisher="exact")
    with pytest.raises(ValueError, match=r"unknown FOLA options \['lamda'\]; valid: \['lr', 'lam', "):
        bf.algorithms.fola(tiny_model, lamda=1.0)
    with pytest.raises(ValueError, match="variant"):
        bf.algorithms.fedcurv(tiny_model, variant="shoham")
