"""FedReg's baselines (spec §8.11-14): SGD, FedProx scaling, FedCurv (previous round), SCAFFOLD, FedNova, DP-SGD."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bfedjax as bf
from bfedjax.core import RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.core.types import Batch
from bfedjax.models.apply import apply_fn_of


def _run(algo, fed, params, config, rounds=1, backend="vmap", weights=None):
    state = init_state(algo, params, RoundConfig(fed.num_clients, fed.num_clients))
    step = make_round_step(algo, config, backend)
    arrays = round_arrays(fed, weights)
    for r in range(1, rounds + 1):
        state, metrics = step(state, arrays, jax.random.PRNGKey(r), traced_hparams(algo, r))
    return state, metrics


def _client_grad(apply_fn, params, fed, i):
    n = int(fed.counts[i])
    return _mean_loss_grad(apply_fn, params, jnp.asarray(fed.x[i, :n]), jnp.asarray(fed.y[i, :n]))


@functools.partial(jax.jit, static_argnums=0)  # one compile per client size, not one per operation
def _mean_loss_grad(apply_fn, params, x, y):
    return jax.grad(lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y)))(params)


def test_fedsgd_is_one_step_along_the_mean_client_gradient(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fedsgd(tiny_model, lr=0.3, client_size=small_fed.max_n)
    state, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 5), weights="uniform")
    apply_fn = apply_fn_of(tiny_model)
    grads = [_client_grad(apply_fn, tiny_params, small_fed, i) for i in range(5)]
    expected = jax.tree.map(lambda p, *g: p - 0.3 * sum(g) / 5, tiny_params, *grads)
    chex.assert_trees_all_close(state.server["params"], expected, rtol=1e-5, atol=1e-6)


def test_uniform_weights_ignore_client_sizes(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16)
    uniform, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 5), weights="uniform")
    explicit, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 5), weights=np.full(5, 7.0))
    by_size, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 5))
    chex.assert_trees_all_close(uniform.server, explicit.server, rtol=1e-6)
    assert not np.allclose(uniform.server["params"]["Dense_0"]["kernel"], by_size.server["params"]["Dense_0"]["kernel"])
    with pytest.raises(ValueError, match="uniform"):
        round_arrays(small_fed, "equal")


@pytest.mark.parametrize("make", [
    lambda m: bf.algorithms.fedprox(m, mu=0.0, lr=0.1, batch_size=16, clip_norm=10.0, scaling="full"),
    lambda m: bf.algorithms.fedcurv(m, lam=0.0, lr=0.1, batch_size=16, variant="previous_round", clip_norm=10.0),
    lambda m: bf.algorithms.scaffold(m, num_clients=5, lr=0.1, batch_size=16, clip_norm=10.0),
    lambda m: bf.algorithms.fednova(m, lr=0.1, batch_size=16, clip_norm=10.0),
])
def test_baselines_reduce_to_fedavg(make, small_fed, digits, tiny_model, tiny_params):
    """FedProx mu=0, FedCurv lam=0 and SCAFFOLD's first round equal FedAvg; FedNova does for equal step counts."""
    fed = small_fed
    if make(tiny_model).name == "fednova":  # equal sizes -> equal tau
        fed = bf.data.stack_clients(digits.x_train[:200], digits.y_train[:200],
                                    [np.arange(i * 40, (i + 1) * 40) for i in range(5)], x_test=digits.x_test,
                                    y_test=digits.y_test, num_classes=10)
    avg, _ = _run(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16), fed, tiny_params, RoundConfig(5, 5))
    other, _ = _run(make(tiny_model), fed, tiny_params, RoundConfig(5, 5))
    chex.assert_trees_all_close(other.server["params"], avg.server["params"], rtol=1e-5, atol=1e-6)


def test_fedprox_full_scaling_doubles_the_proximal_pull(small_fed, tiny_model, tiny_params):
    half = bf.algorithms.fedprox(tiny_model, mu=0.2, lr=0.1, batch_size=16, scaling="half")
    full = bf.algorithms.fedprox(tiny_model, mu=0.1, lr=0.1, batch_size=16, scaling="full")
    a, _ = _run(half, small_fed, tiny_params, RoundConfig(5, 5))
    b, _ = _run(full, small_fed, tiny_params, RoundConfig(5, 5))
    chex.assert_trees_all_close(a.server, b.server, rtol=1e-5, atol=1e-7)


def test_fedcurv_previous_round_penalty_gradient(small_fed, tiny_model, tiny_params):
    """The local step's prior (precision 2A, centre B/A) pulls like grad lam * sum_i F_i (theta - theta_i)^2."""
    rng = np.random.default_rng(0)
    fishers = [jax.tree.map(lambda p: jnp.asarray(rng.uniform(0, 2, p.shape), jnp.float32), tiny_params)
               for _ in range(3)]
    thetas = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), tiny_params)
              for _ in range(3)]
    server = {"params": tiny_params,
              "fisher_sum": jax.tree.map(lambda *f: sum(f), *fishers),
              "weighted_sum": jax.tree.map(lambda *ft: sum(f * t for f, t in zip(ft[:3], ft[3:])), *fishers, *thetas)}
    algo = bf.algorithms.fedcurv(tiny_model, lr=0.1, batch_size=16, variant="previous_round", clip_norm=None)
    data = bf.core.ClientData(jnp.asarray(small_fed.x[0]), jnp.asarray(small_fed.y[0]), jnp.int32(small_fed.counts[0]))
    batch = Batch(data.x[:16], data.y[:16], jnp.ones(16))

    def step(lam):
        ctx = bf.core.ClientContext(server, (), data, traced_hparams(algo, 2, {"lam": lam}))
        return algo.client_step(algo.client_init(ctx, jax.random.PRNGKey(0)), batch, ctx, jax.random.PRNGKey(1)).params

    pull = jax.tree.map(lambda a, b: (b - a) / 0.1, step(0.7), step(0.0))

    def penalty(theta):  # lam * sum_i F_i (theta - theta_i)^2, summed over every coordinate
        terms = [jax.tree.map(lambda f, t, c: jnp.sum(f * (t - c) ** 2), fishers[i], theta, thetas[i])
                 for i in range(3)]
        return 0.7 * sum(sum(jax.tree.leaves(term)) for term in terms)

    chex.assert_trees_all_close(pull, jax.grad(penalty)(tiny_params), rtol=2e-3, atol=2e-4)


def test_fedcurv_previous_round_sums_the_last_cohorts_fishers(small_fed, tiny_model, tiny_params):
    """With lr = 0 every theta_i is theta, so A is a sum of per-sample Fishers at theta over the cohort."""
    algo = bf.algorithms.fedcurv(tiny_model, lam=1e-3, lr=0.0, batch_size=16, variant="previous_round",
                                 fisher="per_sample_sq", clip_norm=None)
    apply_fn = apply_fn_of(tiny_model)
    fishers = [bf.laplace.offline_fisher(apply_fn, tiny_params, bf.core.ClientData(
        jnp.asarray(small_fed.x[i]), jnp.asarray(small_fed.y[i]), jnp.asarray(small_fed.counts[i])), 16,
        "per_sample_sq") for i in range(5)]
    state, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 2), rounds=2)
    got = state.server["fisher_sum"]["Dense_0"]["kernel"]
    pair_sums = [fishers[i]["Dense_0"]["kernel"] + fishers[j]["Dense_0"]["kernel"]
                 for i in range(5) for j in range(i + 1, 5)]
    assert min(float(jnp.max(jnp.abs(got - s))) for s in pair_sums) < 1e-6 * float(jnp.max(got))
    chex.assert_trees_all_close(state.server["weighted_sum"],
                                jax.tree.map(jnp.multiply, state.server["fisher_sum"], tiny_params), rtol=1e-5,
                                atol=1e-9)


def test_scaffold_control_variates_follow_option_two(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.scaffold(tiny_model, num_clients=5, lr=0.1, batch_size=1000, local_epochs=2)
    config = RoundConfig(5, 2)
    state, _ = _run(algo, small_fed, tiny_params, config)
    apply_fn = apply_fn_of(tiny_model)
    changed = [i for i in range(5) if float(jnp.abs(state.persistent[0]["Dense_0"]["kernel"][i]).sum()) > 0]
    assert len(changed) == 2  # only the cohort's rows of the [N, ...] control variates were scattered
    total = jax.tree.map(jnp.zeros_like, tiny_params)
    for i in changed:
        # c = c_i = 0: two full-batch steps, so c_i+ is the mean of the two gradients actually used
        g1 = _client_grad(apply_fn, tiny_params, small_fed, i)
        y1 = jax.tree.map(lambda p, g: p - 0.1 * g, tiny_params, g1)
        g2 = _client_grad(apply_fn, y1, small_fed, i)
        expected = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
        chex.assert_trees_all_close(jax.tree.map(lambda c: c[i], state.persistent[0]), expected, rtol=1e-4, atol=1e-6)
        total = jax.tree.map(jnp.add, total, expected)
    chex.assert_trees_all_close(state.server["control"], jax.tree.map(lambda t: t / 5, total), rtol=1e-4, atol=1e-7)


def test_scaffold_vmap_matches_sequential_over_two_rounds(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.scaffold(tiny_model, num_clients=5, lr=0.1, batch_size=16)
    config = RoundConfig(5, 3, clients_per_chunk=2)
    vm = _run(algo, small_fed, tiny_params, config, rounds=2)
    seq = _run(algo, small_fed, tiny_params, config, rounds=2, backend="sequential")
    chex.assert_trees_all_close(vm, seq, rtol=2e-5, atol=2e-6)


def test_fednova_normalises_unequal_step_counts(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fednova(tiny_model, lr=0.1, batch_size=16)
    state, _ = _run(algo, small_fed, tiny_params, RoundConfig(5, 5))
    fedavg = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, clip_norm=None)
    local = [_run(fedavg, small_fed, tiny_params, RoundConfig(5, 5), weights=np.eye(5)[i])[0].server["params"]
             for i in range(5)]  # a one-hot weight makes the server model client i's local model
    w = small_fed.counts / small_fed.counts.sum()
    tau = np.ceil(small_fed.counts / 16)
    assert len(set(tau)) > 1
    expected = jax.tree.map(lambda t, *locals_: t - np.sum(w * tau) * sum(
        wi * (t - li) / ti for wi, li, ti in zip(w, locals_, tau)), tiny_params, *local)
    chex.assert_trees_all_close(state.server["params"], expected, rtol=1e-4, atol=1e-6)


def test_dp_clipping_bounds_every_example_and_reduces_to_sgd(digits, tiny_model, tiny_params):
    apply_fn = apply_fn_of(tiny_model)
    batch = Batch(jnp.asarray(digits.x_train[:12]), jnp.asarray(digits.y_train[:12]),
                  jnp.asarray([1.0] * 10 + [0.0] * 2))
    _, grads = bf.laplace.fisher.per_example_grads(apply_fn, tiny_params, batch)
    clipped, norms = bf.privacy.clip_per_example(grads, 0.05)
    assert float(norms.max()) > 0.05
    _, clipped_norms = bf.privacy.clip_per_example(clipped, 1e9)
    assert float(clipped_norms.max()) <= 0.05 * (1 + 1e-5)
    _, plain = bf.laplace.grad_and_fisher(apply_fn, tiny_params, batch, jnp.asarray(10), None)[:2]
    _, private = bf.privacy.private_gradient(apply_fn, tiny_params, batch, jax.random.PRNGKey(0),
                                             clip_norm=float("inf"), noise_multiplier=0.0)
    chex.assert_trees_all_close(private, plain, rtol=1e-5, atol=1e-7)
    _, noisy = bf.privacy.private_gradient(apply_fn, tiny_params, batch, jax.random.PRNGKey(0), clip_norm=1.0,
                                           noise_multiplier=2.0)
    _, clipped_mean = bf.privacy.private_gradient(apply_fn, tiny_params, batch, jax.random.PRNGKey(0),
                                                  clip_norm=1.0, noise_multiplier=0.0)
    residual = jax.tree.map(lambda a, b: (a - b) * 10, noisy, clipped_mean)  # undo /n: noise std sigma*C = 2
    leaves = np.concatenate([np.ravel(x) for x in jax.tree.leaves(residual)])
    assert 1.8 < leaves.std() < 2.2


def test_dp_fedavg_reduces_to_fedavg_matches_the_reference_and_reports_epsilon(small_fed, tiny_model, tiny_params):
    config = RoundConfig(5, 3, clients_per_chunk=2)
    plain, _ = _run(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, clip_norm=None), small_fed, tiny_params,
                    config)
    no_privacy, _ = _run(bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, clip_norm=None, dp_clip=1e9,
                                              dp_noise=0.0), small_fed, tiny_params, config)
    chex.assert_trees_all_close(no_privacy.server, plain.server, rtol=1e-5, atol=1e-7)
    noisy = bf.algorithms.fedavg(tiny_model, lr=0.1, batch_size=16, clip_norm=None, dp_clip=1.0, dp_noise=0.5)
    vmapped = _run(noisy, small_fed, tiny_params, config, rounds=2)
    sequential = _run(noisy, small_fed, tiny_params, config, rounds=2, backend="sequential")
    chex.assert_trees_all_close(vmapped, sequential, rtol=2e-5, atol=2e-6)  # the noise keys follow the clients
    assert not np.allclose(vmapped[0].server["params"]["Dense_0"]["kernel"], plain.server["params"]["Dense_0"]["kernel"])
    eps = bf.privacy.client_epsilon(0.5, batch_size=16, client_size=100, local_epochs=1, participations=2,
                                    delta=1e-5)
    assert 0 < eps < np.inf
    assert bf.privacy.client_epsilon(1.0, batch_size=16, client_size=100, local_epochs=1, participations=2,
                                     delta=1e-5) < eps  # more noise, less privacy spent
    assert bf.privacy.dp_epsilon(0.0, 0.1, 10, 1e-5) == np.inf
    with pytest.raises(ValueError, match="without BatchNorm or dropout"):
        bf.algorithms.fedavg(bf.models.get_model("mlp", 10, hidden=(8,), dropout_rate=0.2), dp_clip=1.0)


def test_fednova_vmap_matches_sequential(small_fed, tiny_model, tiny_params):
    algo = bf.algorithms.fednova(tiny_model, lr=0.1, batch_size=16, momentum=0.5)
    config = RoundConfig(5, 3, clients_per_chunk=2)
    chex.assert_trees_all_close(_run(algo, small_fed, tiny_params, config, rounds=2),
                                _run(algo, small_fed, tiny_params, config, rounds=2, backend="sequential"),
                                rtol=2e-5, atol=2e-6)
