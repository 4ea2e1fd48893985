"""Closed-form identities of the Gaussian product and the moment-matched mixture (FOLA spec section 8)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from bfedjax.posteriors import DiagGaussian, gaussian_product, log_density, moment_matched_mixture, weighted_mean


def _clients(seed, c=4, d=6):
    rng = np.random.default_rng(seed)
    mean = {"w": rng.normal(size=(c, d)), "b": rng.normal(size=(c, 2))}
    prec = {"w": rng.uniform(0.1, 5.0, size=(c, d)), "b": rng.uniform(0.1, 5.0, size=(c, 2))}
    pi = rng.dirichlet(np.ones(c))
    return jax.tree.map(jnp.asarray, DiagGaussian(mean, prec)), jnp.asarray(pi)


def test_product_is_the_stationary_point_with_the_right_curvature():
    with enable_x64(True):
        post, pi = _clients(0)
        agg = gaussian_product(post, pi)
        f = lambda th: sum(pi[c] * log_density(jax.tree.map(lambda x: x[c], post), th) for c in range(4))
        grad = jax.grad(f)(agg.mean)
        chex.assert_trees_all_close(grad, jax.tree.map(jnp.zeros_like, grad), atol=1e-10)
        flat = lambda th: f({"w": th[:6], "b": th[6:]})
        hess = jax.hessian(flat)(jnp.concatenate([agg.mean["w"], agg.mean["b"]]))
        np.testing.assert_allclose(-hess, np.diag(np.concatenate([agg.precision["w"], agg.precision["b"]])),
                                   atol=1e-10)


def test_product_matches_a_brute_force_grid():
    with enable_x64(True):
        post, pi = _clients(1, c=3, d=1)
        agg = gaussian_product(post, pi)
        grid = np.linspace(-15, 15, 200001)
        logp = sum(float(pi[c]) * (-0.5 * post.precision["w"][c, 0] * (grid - post.mean["w"][c, 0]) ** 2)
                   for c in range(3))
        p = np.exp(logp - logp.max()); p /= p.sum()
        mean = np.sum(p * grid)
        var = np.sum(p * (grid - mean) ** 2)
        np.testing.assert_allclose(mean, agg.mean["w"][0], rtol=1e-6)
        np.testing.assert_allclose(var, 1.0 / agg.precision["w"][0], rtol=1e-5)


def test_equal_precisions_give_fedavg_and_one_client_is_identity():
    with enable_x64(True):
        post, pi = _clients(2)
        equal = DiagGaussian(post.mean, jax.tree.map(lambda p: jnp.full_like(p, 3.0), post.precision))
        agg = gaussian_product(equal, pi)
        chex.assert_trees_all_close(agg.mean, weighted_mean(post.mean, pi), rtol=1e-12)
        chex.assert_trees_all_close(agg.precision, jax.tree.map(lambda p: jnp.full(p.shape[1:], 3.0), post.precision))
        one = jax.tree.map(lambda x: x[:1], post)
        agg1 = gaussian_product(one, jnp.ones(1))
        chex.assert_trees_all_close(agg1, jax.tree.map(lambda x: x[0], post), rtol=1e-12)


def test_scale_invariance_convex_hull_and_eps():
    with enable_x64(True):
        post, pi = _clients(3)
        agg = gaussian_product(post, pi)
        scaled = gaussian_product(DiagGaussian(post.mean, jax.tree.map(lambda p: 7.0 * p, post.precision)), pi)
        chex.assert_trees_all_close(scaled.mean, agg.mean, rtol=1e-12)
        chex.assert_trees_all_close(scaled.precision, jax.tree.map(lambda p: 7.0 * p, agg.precision), rtol=1e-12)
        for k in agg.mean:
            assert np.all(agg.mean[k] <= post.mean[k].max(0) + 1e-12)
            assert np.all(agg.mean[k] >= post.mean[k].min(0) - 1e-12)
        eps = 1e-3
        guarded = gaussian_product(post, pi, eps)
        chex.assert_trees_all_close(
            guarded.mean, jax.tree.map(lambda m, p: m * p / (p + eps), agg.mean, agg.precision), rtol=1e-12)


def test_zero_precision_client_drops_out():
    with enable_x64(True):
        post, pi = _clients(4)
        prec = jax.tree.map(lambda p: p.at[1].set(0.0), post.precision)
        agg = gaussian_product(DiagGaussian(post.mean, prec), pi)
        keep = jnp.array([0, 2, 3])
        rest = gaussian_product(jax.tree.map(lambda x: x[keep], DiagGaussian(post.mean, prec)), pi[keep])
        chex.assert_trees_all_close(agg, rest, rtol=1e-12)
        zero = gaussian_product(DiagGaussian(post.mean, jax.tree.map(jnp.zeros_like, prec)), pi, eps=1e-5)
        chex.assert_trees_all_close(zero.mean, jax.tree.map(jnp.zeros_like, agg.mean))


def test_two_client_ridgeline_endpoints_and_monotonicity():
    with enable_x64(True):
        post, _ = _clients(5, c=2)
        curve = [gaussian_product(post, jnp.array([a, 1 - a])).mean["w"] for a in np.linspace(0, 1, 21)]
        np.testing.assert_allclose(curve[0], post.mean["w"][1], rtol=1e-12)
        np.testing.assert_allclose(curve[-1], post.mean["w"][0], rtol=1e-12)
        diffs = np.diff(np.stack(curve), axis=0)
        direction = np.sign(post.mean["w"][0] - post.mean["w"][1])
        assert np.all(diffs * direction >= -1e-12)


def test_moment_matched_mixture_matches_monte_carlo():
    with enable_x64(True):
        post, pi = _clients(6, c=3, d=2)
        mm = moment_matched_mixture(post, pi)
        rng = np.random.default_rng(0)
        comp = rng.choice(3, size=400000, p=np.asarray(pi))
        mu, sd = np.asarray(post.mean["w"])[comp], 1 / np.sqrt(np.asarray(post.precision["w"])[comp])
        samples = mu + sd * rng.normal(size=mu.shape)
        np.testing.assert_allclose(samples.mean(0), mm.mean["w"], atol=0.02)
        np.testing.assert_allclose(samples.var(0), 1 / mm.precision["w"], rtol=0.02)
        # FedAvg mean (Eq. 6) is the mixture mean.
        chex.assert_trees_all_close(mm.mean, weighted_mean(post.mean, pi))


def test_fola_running_average_is_eq25():
    """FOLA's clients (Eq. 24) and product (Eq. 12) give Lambda_S,R = (1/R) sum_r sum_n pi_n F_n,r (gamma = 0)."""
    import bfedjax as bf
    from bfedjax.algorithms.local_sgd import LocalState
    from bfedjax.core import ClientContext, ClientData
    algo = bf.algorithms.fola(bf.models.get_model("logistic", 2), precision_mode="running_average", eps=0.0)
    rng = np.random.default_rng(7)
    pi = rng.dirichlet(np.ones(3))
    fishers = rng.uniform(0, 2, size=(6, 3, 5)).astype(np.float32)
    data = ClientData(jnp.zeros((1, 2)), jnp.zeros(1, jnp.int32), jnp.int32(1))
    server = algo.server_init({"w": jnp.zeros(5)})
    for r in range(1, 7):
        hp = {"round": jnp.int32(r), "lr": jnp.float32(0.0), "lam": jnp.float32(0.0)}
        ctx = ClientContext(server, (), data, hp)
        messages = [algo.client_final(LocalState({"w": jnp.ones(5)}, (), {"w": jnp.asarray(f)}, jnp.int32(1), jnp.float32(0)), ctx)[0]
                    for f in fishers[r - 1]]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *messages)
        server, _ = algo.aggregate(server, stacked, jnp.asarray(pi, jnp.float32), jnp.ones(3), hp, jax.random.PRNGKey(r))
        np.testing.assert_allclose(server["precision"]["w"], np.einsum("n,rnd->rd", pi, fishers[:r]).mean(0),
                                   rtol=1e-5)


def _paper_cosine(a, b):
    """FOLA Fig. 10a/11a by the letter: subtract each matrix's minimum, divide by its maximum, vectorise, cosine."""
    a, b = ((m - m.min()) / (m - m.min()).max() for m in (a, b))
    return float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))


def test_precision_cosines_follow_the_papers_normalised_matrices():
    from bfedjax.posteriors.similarity import mean_pairwise_precision_cosine, precision_cosines
    rng = np.random.default_rng(0)
    # diagonal: three clients' pytrees of 5 + 2 entries; client 1 has a negative entry, so its zero
    # off-diagonals move with the shift
    diag = {"w": rng.uniform(0.1, 3.0, size=(3, 5)), "b": rng.uniform(0.1, 3.0, size=(3, 2))}
    diag["w"][1, 2] = -0.7
    got = np.asarray(precision_cosines(jax.tree.map(jnp.asarray, diag), 7))
    flat = np.concatenate([diag["w"], diag["b"]], axis=1)
    want = np.array([[_paper_cosine(np.diag(flat[i]), np.diag(flat[j])) for j in range(3)] for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert abs(got[0, 1] - float(flat[0] @ flat[1] / np.linalg.norm(flat[0]) / np.linalg.norm(flat[1]))) > 1e-3
    # full: symmetric matrices with negative off-diagonals
    dense = rng.normal(size=(3, 4, 4))
    dense = dense + dense.transpose(0, 2, 1)
    got = np.asarray(precision_cosines(jnp.asarray(dense), 4))
    want = np.array([[_paper_cosine(dense[i], dense[j]) for j in range(3)] for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the mean over pairs of real clients: client 2 is padding
    mean = mean_pairwise_precision_cosine(jnp.asarray(dense), 4, jnp.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(float(mean), want[0, 1], rtol=1e-5)
    assert np.isnan(float(mean_pairwise_precision_cosine(jnp.asarray(dense), 4, jnp.array([1.0, 0.0, 0.0]))))
    with pytest.raises(ValueError, match="7 .diagonal"):
        precision_cosines(jnp.asarray(dense), 7)
