"""FOLA's Sec. IV-E Laplace variants: the exact Hessian (``laplace.hessian``), the full-matrix product and
prior, and ``fola(laplace="full" | "e_full")`` against float64 numpy oracles (spec D24)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import bfedjax as bf
from bfedjax.core import ClientContext, ClientData, local_training
from bfedjax.core.simulate import traced_hparams
from bfedjax.laplace.hessian import batch_hessian, eigenvalue_diagonal, offline_hessian
from bfedjax.models.apply import apply_fn_of
from bfedjax.posteriors import DensePrecision, gaussian_product_full, quadratic_penalty


def softmax_regression_hessian(params, x, y):
    """float64 oracle: the mean-CE Hessian of softmax regression, ``(1/n) sum_i (diag p_i - p_i p_i^T) kron
    (x~_i x~_i^T)`` with ``x~ = [x, 1]``, in ``ravel_pytree``'s coordinate order."""
    kernel, bias = (np.asarray(params["Dense_0"][k], np.float64) for k in ("kernel", "bias"))
    xt = np.concatenate([np.asarray(x, np.float64).reshape(len(x), -1), np.ones((len(x), 1))], axis=1)
    logits = xt @ np.concatenate([kernel, bias[None]], axis=0)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    a, c = xt.shape[1], kernel.shape[1]
    h = sum(np.kron(np.outer(xi, xi), np.diag(pi) - np.outer(pi, pi)) for xi, pi in zip(xt, p)) / len(x)
    # natural coordinate a * c + k for input a (the last is the bias) and class k; ravel_pytree's order:
    labels = {"Dense_0": {"kernel": np.arange((a - 1) * c, dtype=np.float64).reshape(a - 1, c),
                          "bias": (a - 1) * c + np.arange(c, dtype=np.float64)}}
    order = np.asarray(ravel_pytree(labels)[0]).astype(int)
    return h[np.ix_(order, order)]


def test_batch_and_offline_hessians_are_softmax_regressions_closed_form(halves, logistic):
    """The Hessians equal the closed form (exact for this model: its logits are linear in the parameters);
    padding rows add nothing and the offline Hessian is the mean over the client's real samples only."""
    model, params = logistic
    apply_fn = apply_fn_of(model)
    x, y, n = halves.x[0], halves.y[0], int(halves.counts[0])
    mask = np.zeros(len(y), np.float32)
    mask[:40] = 1.0
    summed = batch_hessian(apply_fn, params, bf.core.Batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)))
    np.testing.assert_allclose(summed / 40, softmax_regression_hessian(params, x[:40], y[:40]), atol=2e-6)
    data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.int32(n))
    offline = offline_hessian(apply_fn, params, data, batch_size=64)
    oracle = softmax_regression_hessian(params, x[:n], y[:n])
    np.testing.assert_allclose(offline, oracle, atol=2e-6)
    assert np.abs(oracle - np.diag(np.diag(oracle))).max() > 0.05  # large off-diagonal structure (Fig. 10a)


def test_eigenvalue_diagonal_keeps_the_spectrum_in_the_diagonals_rank_order():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 6))
    h = a @ a.T + np.diag(np.arange(6.0)[::-1] * 3)
    eigenvalues = np.linalg.eigvalsh(h)
    ranked = np.asarray(eigenvalue_diagonal(jnp.asarray(h, jnp.float32)))
    np.testing.assert_allclose(np.sort(ranked), eigenvalues, rtol=1e-5)
    np.testing.assert_array_equal(np.argsort(ranked), np.argsort(np.diag(h)))  # the k-th largest to the k-th largest
    np.testing.assert_allclose(eigenvalue_diagonal(jnp.asarray(h, jnp.float32), "solver"), eigenvalues, rtol=1e-5)
    indefinite = np.diag([-2.0, 1.0, 3.0]).astype(np.float32)  # a precision is not negative
    np.testing.assert_allclose(eigenvalue_diagonal(jnp.asarray(indefinite), "solver"), [0.0, 1.0, 3.0])
    with pytest.raises(ValueError, match="eigen_order='largest'; choose one of"):
        eigenvalue_diagonal(jnp.asarray(h), "largest")


def test_dense_prior_pull_is_the_gradient_of_its_penalty(logistic):
    _, params = logistic
    d = ravel_pytree(params)[0].size
    rng = np.random.default_rng(1)
    a = rng.normal(size=(d, 8)).astype(np.float32)
    precision = DensePrecision(jnp.asarray(a @ a.T))
    center = jax.tree.map(lambda p: p + 0.1, params)
    diff = np.asarray(ravel_pytree(params)[0] - ravel_pytree(center)[0], np.float64)
    np.testing.assert_allclose(quadratic_penalty(params, center, precision), 0.5 * diff @ (a @ a.T) @ diff, rtol=1e-5)
    chex.assert_trees_all_close(precision.pull(params, center),
                                jax.grad(quadratic_penalty)(params, center, precision), rtol=1e-4, atol=1e-5)
    scaled = DensePrecision(jnp.asarray(a @ a.T), 1.0 / 3.0, 2.0)  # FOLA's running sum in round 3, gamma 2
    np.testing.assert_allclose(ravel_pytree(scaled.pull(params, center))[0], (a @ a.T / 3.0 + 2.0 * np.eye(d)) @ diff,
                               rtol=1e-4, atol=1e-5)


def test_full_product_guards_unseen_directions_with_eps():
    """``(sum w Lambda + eps I)^{-1} sum w Lambda mu``: a direction no client constrains goes to 0."""
    rng = np.random.default_rng(2)
    vecs = rng.normal(size=(2, 5, 3))
    precisions = np.einsum("kia,kja->kij", vecs, vecs)  # rank 3 each (positive semi-definite)
    precisions[:, :, -1] = precisions[:, -1, :] = 0.0  # both blind to the last coordinate
    means, w = rng.normal(size=(2, 5)), np.array([0.51, 0.49])
    mean, precision = gaussian_product_full(jnp.asarray(means), jnp.asarray(precisions), jnp.asarray(w), eps=1e-3)
    lam = np.einsum("k,kij->ij", w, precisions)
    expected = np.linalg.solve(lam + 1e-3 * np.eye(5), np.einsum("k,kij,kj->i", w, precisions, means))
    np.testing.assert_allclose(mean, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(precision, lam, rtol=1e-6)
    assert float(mean[-1]) == 0.0


def client_message(algo, halves, client, server, round_index=1):
    data = ClientData(jnp.asarray(halves.x[client]), jnp.asarray(halves.y[client]), jnp.int32(halves.counts[client]))
    ctx = ClientContext(server, (), data, traced_hparams(algo, round_index))
    return local_training(algo, ctx, jax.random.PRNGKey(client))[0], data


def mean_ce_gradient(apply_fn, params, x, y):
    return jax.grad(lambda p: jnp.mean(bf.losses.cross_entropy(apply_fn(p, x), y)))(params)


@pytest.mark.parametrize("fisher", ["offline", "per_sample_sq"])
def test_full_fola_sends_the_mean_loss_hessian_and_the_server_solves_the_product(halves, logistic, fisher):
    """Round 1 (no prior yet), one batch per epoch, 2 epochs: offline, the client's precision is the Hessian at
    its trained weights; online, the mean of the Hessians at the two steps' weights (theta_0, theta_1 =
    theta_0 - lr g(theta_0)). The server's mean solves the weighted product with eps (float64 oracles)."""
    model, params = logistic
    apply_fn = apply_fn_of(model)
    algo = bf.algorithms.fola(model, lr=0.5, lam=1.0, batch_size=256, local_epochs=2, laplace="full", fisher=fisher,
                              eps=1e-2, clip_norm=None)
    server = algo.server_init(params)
    assert server["precision"].shape == (650, 650)
    messages = []
    for client in (0, 1):
        message, data = client_message(algo, halves, client, server)
        n = int(data.count)
        x, y = halves.x[client][:n], halves.y[client][:n]
        if fisher == "offline":
            oracle = softmax_regression_hessian(message["params"], x, y)
        else:
            step_1 = jax.tree.map(lambda p, g: p - 0.5 * g, params, mean_ce_gradient(apply_fn, params, x, y))
            oracle = (softmax_regression_hessian(params, x, y) + softmax_regression_hessian(step_1, x, y)) / 2
        np.testing.assert_allclose(message["precision"], oracle, atol=3e-6)
        assert np.abs(oracle - softmax_regression_hessian(params, x, y)).max() > 1e-3  # the weights moved
        messages.append(message)
    w = np.array([0.51, 0.49])
    stats = jax.tree.map(lambda *s: sum(wi * si for wi, si in zip(w, s)), *[algo.client_stats(m) for m in messages])
    new, metrics = algo.server_from_stats(server, stats, jnp.ones(2), {"round": jnp.int32(1)}, None)
    thetas = [np.asarray(ravel_pytree(m["params"])[0], np.float64) for m in messages]
    lams = [np.asarray(m["precision"], np.float64) for m in messages]
    lam = w[0] * lams[0] + w[1] * lams[1]
    expected = np.linalg.solve(lam + 1e-2 * np.eye(650), w[0] * lams[0] @ thetas[0] + w[1] * lams[1] @ thetas[1])
    np.testing.assert_allclose(ravel_pytree(new["params"])[0], expected, rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(new["precision"], lam, atol=1e-6)
    assert float(metrics["precision_below_eps"]) == pytest.approx(np.mean(np.diag(lam) < 1e-2))  # of the diagonal


@pytest.mark.parametrize("options, share, alone", [
    ({}, 1.0, False), ({"precision_mode": "running_average"}, 2.0 / 3.0, False),
    ({"fisher": "offline"}, 1.0, False), ({"fisher": "offline", "offline_accumulates": False}, 0.0, False),
    ({"damping": 0.25}, 1.0, False), ({"laplace": "e_full"}, 1.0, True)])
def test_round_three_combines_the_hessian_with_the_global_precision(halves, logistic, options, share, alone):
    """Round 3, weights frozen (lr 0) at a server with precision S: the message is S + H (running sum; offline
    too, spec D24), H / 3 + 2 / 3 S (Eq. 24), H alone (offline_accumulates=False), S + H + 0.25 I (damping),
    and for e_full S + the eigenvalues of H on the diagonal."""
    model, params = logistic
    algo = bf.algorithms.fola(model, lr=0.0, lam=1.0, batch_size=64, **{"laplace": "full", **options})
    flat, unravel = ravel_pytree(params)
    rng = np.random.default_rng(4)
    a = rng.normal(size=(flat.size, 5)).astype(np.float32)
    s = a @ a.T / 5 if not alone else np.diag(np.linspace(0.5, 2.0, flat.size)).astype(np.float32)
    server_precision = jnp.asarray(s) if not alone else unravel(jnp.asarray(np.diag(s)))
    message, data = client_message(algo, halves, 0, {"params": params, "precision": server_precision}, round_index=3)
    n = int(data.count)
    hessian = softmax_regression_hessian(params, halves.x[0][:n], halves.y[0][:n])
    if alone:  # e_full: the diagonal's ranking of the eigenvalues, as eigenvalue_diagonal places them
        spectrum = np.asarray(eigenvalue_diagonal(jnp.asarray(hessian, jnp.float32)))
        np.testing.assert_allclose(ravel_pytree(message["precision"])[0], np.diag(s) + spectrum, atol=3e-6)
        return
    curvature = hessian / 3 if options.get("precision_mode") == "running_average" else hessian
    expected = curvature + share * s + options.get("damping", 0.0) * np.eye(flat.size)
    np.testing.assert_allclose(message["precision"], expected, atol=3e-6)


def test_full_prior_with_a_diagonal_matrix_trains_as_the_diagonal_prior(halves, logistic):
    """Round 3 with a server precision S on the diagonal: the full prior ``lam S (theta - mu)`` and the e_full
    (diagonal) prior ``lam s * (theta - mu)`` take the same steps, so the local models agree."""
    model, params = logistic
    flat = ravel_pytree(params)[0]
    s = jnp.linspace(0.5, 3.0, flat.size)
    center = ravel_pytree(params)[1](flat + 0.05)
    common = dict(lr=0.1, lam=1.0, batch_size=32, local_epochs=1, clip_norm=None, fisher="offline")
    full = bf.algorithms.fola(model, laplace="full", **common)
    diagonal = bf.algorithms.fola(model, laplace="e_full", **common)
    full_msg, _ = client_message(full, halves, 0, {"params": center, "precision": jnp.diag(s)}, round_index=3)
    diag_msg, _ = client_message(diagonal, halves, 0, {"params": center, "precision": ravel_pytree(params)[1](s)},
                                 round_index=3)
    chex.assert_trees_all_close(full_msg["params"], diag_msg["params"], rtol=1e-5, atol=1e-6)
    no_prior, _ = client_message(bf.algorithms.fola(model, laplace="full", **{**common, "lam": 0.0}), halves, 0,
                                 {"params": center, "precision": jnp.diag(s)}, round_index=3)
    assert np.abs(ravel_pytree(no_prior["params"])[0] - ravel_pytree(full_msg["params"])[0]).max() > 1e-3


def test_e_full_sends_the_hessians_eigenvalues_on_the_diagonal(halves, logistic):
    model, params = logistic
    algo = bf.algorithms.fola(model, lr=0.05, lam=1.0, batch_size=64, laplace="e_full", fisher="offline")
    message, data = client_message(algo, halves, 1, algo.server_init(params))
    n = int(data.count)
    hessian = softmax_regression_hessian(message["params"], halves.x[1][:n], halves.y[1][:n])
    sent = np.asarray(ravel_pytree(message["precision"])[0])
    np.testing.assert_allclose(np.sort(sent), np.linalg.eigvalsh(hessian), atol=3e-6)
    top = np.argsort(np.diag(hessian))[-20:]  # ties among zero-Hessian pixels make the low ranks arbitrary
    np.testing.assert_array_equal(np.argsort(sent)[-20:], top)


def test_full_laplace_rounds_beat_fedavg_on_disjoint_halves(halves, logistic):
    """Two clients with disjoint classes (IV-E): one round of the full-Hessian product reaches an accuracy that
    FedAvg's average of the two one-sided models does not (the paper's Fig. 10: the full product is near its
    final accuracy within rounds, FedAvg far below)."""
    model, _ = logistic
    key = jax.random.PRNGKey(0)
    runs = {}
    common = dict(lr=0.05, batch_size=50, local_epochs=4)
    for name, algo in [("fedavg", bf.algorithms.fedavg(model, **common)),
                       ("full", bf.algorithms.fola(model, lam=1.0, profile="paper", eps=1e-5, laplace="full", **common))]:
        runs[name] = bf.simulate(algo, halves, rounds=2, key=key, clients_per_round=2).metrics["global_accuracy"]
    assert runs["full"][0] > 0.6 > 0.45 > runs["fedavg"][0], runs
    assert runs["full"][1] > runs["fedavg"][1] + 0.1, runs


def test_laplace_options_name_the_fix(logistic):
    model, _ = logistic
    with pytest.raises(ValueError, match="FOLA laplace='fullest'; choose one of"):
        bf.algorithms.fola(model, laplace="fullest")
    with pytest.raises(ValueError, match="fix: drop prune_p with laplace='full'"):
        bf.algorithms.fola(model, laplace="full", prune_p=0.1)
    with pytest.raises(ValueError, match="laplace='full' needs eps > 0.*fix: eps=1e-5"):
        bf.algorithms.fola(model, laplace="full", profile="paper")
    with pytest.raises(ValueError, match="exact Hessian takes a model without BatchNorm or dropout"):
        bf.algorithms.fola(bf.models.get_model("mlp", 10, hidden=(8,), dropout_rate=0.2), laplace="full")
