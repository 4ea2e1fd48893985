"""FedRef's server update, the server optimisers (FedOpt) and the nested round subsets (FedRef spec section 8)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bfedjax as bf
from bfedjax.algorithms.fedref import mean_batch_loss, ref_lambda_at
from bfedjax.core.sampling import with_round_subsets
from bfedjax.core.round_config import RoundArrays, RoundConfig

MODEL = bf.models.get_model("logistic", 3)
SHAPE = (2, 2, 1)
C = 3


def _params(seed):
    return bf.models.init_params(MODEL, SHAPE, jax.random.PRNGKey(seed))


def _run_server(algo, aggregates, losses=None, lr=0.1, init=None):
    """Feeds the server one cohort per round whose weighted mean is ``aggregates[r]``; returns the broadcasts."""
    server = algo.server_init(_params(100) if init is None else init)
    weights, mask = jnp.full((C,), 1.0 / C), jnp.ones(C)
    out = []
    for r, agg in enumerate(aggregates):
        # three clients at agg + d, agg, agg - d: their mean is agg
        d = jax.tree.map(lambda a: 0.1 * jnp.ones_like(a), agg)
        stacked = jax.tree.map(lambda a, e: jnp.stack([a + e, a, a - e]), agg, d)
        message = {"params": stacked, "loss": jnp.asarray(losses[r] if losses else np.zeros(C), jnp.float32)}
        hparams = {**{k: jnp.asarray(v, jnp.float32) for k, v in algo.hparams.items()}, "round": jnp.int32(r + 1)}
        hparams["lr"] = jnp.float32(lr)
        server, metrics = algo.server_update(server, message, weights, mask, hparams, jax.random.PRNGKey(r))
        out.append((server, metrics))
    return out


def _fedref(**kw):
    return bf.algorithms.fedref(MODEL, **kw)


AGGS = [_params(i) for i in range(8)]


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("p", [1, 3])
def test_reference_is_the_mean_of_the_last_p_aggregates(p):
    out = _run_server(_fedref(variant="map_prox", lam=0.0, p=p), AGGS)
    for r in range(p, len(AGGS)):
        expected = jax.tree.map(lambda *a: np.mean(a, axis=0), *AGGS[r - p + 1: r + 1])
        chex.assert_trees_all_close(out[r][0]["fedref"]["prev_ref"], expected, atol=1e-6)
    constant = _run_server(_fedref(variant="map_prox", lam=0.0, p=p), [AGGS[0]] * 5)
    chex.assert_trees_all_close(constant[-1][0]["fedref"]["prev_ref"], AGGS[0], atol=1e-6)


@pytest.mark.parametrize("variant", ["code", "l2", "map_step", "map_prox"])
def test_rounds_up_to_p_plus_one_broadcast_the_aggregate(variant):
    p = 2
    out = _run_server(_fedref(variant=variant, lam=5.0, p=p), AGGS[:5], losses=[[r, 1.0, 2.0] for r in range(5)])
    for r in range(p + 1):
        chex.assert_trees_all_close(out[r][0]["params"], AGGS[r], atol=1e-6)
    assert not np.allclose(_flat(out[p + 1][0]["params"]), _flat(AGGS[p + 1]), atol=1e-4)


def _weighted_ref(p, r, reference="mean", aggs=AGGS):
    """R after 0-based round ``r``: the buffer's aggregates (rounds ``r-p+1..r``, 1-based ``j``) weighted
    uniformly or, ``"weighted"``, by the FedRef code's slot weights ``1 + (j mod p)``."""
    js = range(r - p + 2, r + 2)
    w = np.array([1.0 + j % p if reference == "weighted" else 1.0 for j in js])
    return jax.tree.map(lambda *a: sum(wi * ai for wi, ai in zip(w / w.sum(), a)), *aggs[r - p + 1: r + 1])


@pytest.mark.parametrize("p", [2, 3])
def test_weighted_reference_uses_the_codes_static_slot_weights(p):
    out = _run_server(_fedref(variant="map_prox", lam=0.0, p=p, reference="weighted"), AGGS)
    for r in range(p, len(AGGS)):
        chex.assert_trees_all_close(out[r][0]["fedref"]["prev_ref"], _weighted_ref(p, r, "weighted"), atol=1e-6)
    # the weights are not uniform, so the reference differs from Eq. 14's mean
    assert not np.allclose(_flat(out[-1][0]["fedref"]["prev_ref"]), _flat(_weighted_ref(p, len(AGGS) - 1)), atol=1e-4)


def test_lambda_2_schedule_follows_the_codes_in_place_update():
    def authors(lam2, rounds, growth=10.0, every=10, cap=0.005):  # the code mutates lambda_2 each round
        seen = []
        for r in range(1, rounds + 1):
            if r % every == 0:
                lam2 = min(lam2 * growth, cap)
            seen.append(lam2)
        return seen
    rounds = jnp.arange(1, 46)
    for lam2 in (1e-6, 1e-4, 0.1):  # the README example, one that reaches the cap, one above it
        got = jax.vmap(lambda r: ref_lambda_at(jnp.float32(lam2), r, 10.0, 10, 0.005))(rounds)
        np.testing.assert_allclose(got, authors(lam2, 45), rtol=1e-5)
    for lam2 in (0.1, 0.001):  # a shrinking lambda_2 from above and below the cap
        got = jax.vmap(lambda r: ref_lambda_at(jnp.float32(lam2), r, 0.5, 3, 0.005))(rounds)
        np.testing.assert_allclose(got, authors(lam2, 45, growth=0.5, every=3), rtol=1e-5)
    far = ref_lambda_at(jnp.float32(0.0), jnp.int32(5000), 10.0, 10, 0.005)  # 10^500 overflows float32
    assert float(far) == 0.0
    assert float(ref_lambda_at(jnp.float32(1e-6), jnp.int32(5000), 10.0, 10, None)) == pytest.approx(
        1e-6 * 10.0 ** 37, rel=1e-3)  # uncapped: held below float32's overflow, never inf
    assert ref_lambda_at(0.3, jnp.int32(40), 1.0, 10, 0.005) == 0.3  # growth 1: constant, the cap unused


@pytest.mark.parametrize("fix_ref_delta,reference,lam_ref", [(True, "mean", None), (False, "mean", None),
                                                              (True, "mean", 0.05), (False, "weighted", 0.05)])
def test_code_variant_is_a_per_tensor_scalar_shift(fix_ref_delta, reference, lam_ref):
    p, lam, lr = 2, 0.3, 0.1
    losses = [[1.0, 2.0, 3.0], [0.5, 1.0, 2.0], [0.4, 0.4, 0.4], [0.9, 0.1, 0.2], [0.3, 0.3, 0.3]]
    algo = _fedref(variant="code", lam=lam, p=p, fix_ref_delta=fix_ref_delta, reference=reference, lam_ref=lam_ref)
    out = _run_server(algo, AGGS[:5], losses, lr=lr)
    r = 4  # a corrected round: A_r = AGGS[4], A_{r-1} = AGGS[3], R_r over AGGS[3:5], R_{r-1} over AGGS[2:4]
    s = (sum(losses[r]) - sum(losses[r - 1])) / C
    ref, prev_ref = _weighted_ref(p, r, reference), _weighted_ref(p, r - 1, reference)
    lam2 = lam if lam_ref is None else lam_ref
    shifts, ratios = [], []
    for path, theta in jax.tree_util.tree_leaves_with_path(out[r][0]["params"]):
        get = lambda tree: np.asarray(dict(jax.tree_util.tree_leaves_with_path(tree))[path])
        a, a_prev, rr, rr_prev = get(AGGS[4]), get(AGGS[3]), get(ref), get(prev_ref)
        # PyTorch's axis 0 (output units) is the last axis of a Flax kernel; the later commits' weighted
        # reference is already normalised, so their bug sums without dividing by p
        d_ref = rr - rr_prev if fix_ref_delta else rr - rr_prev.sum(axis=-1, keepdims=True) / (
            1 if reference == "weighted" else p)
        shift = np.asarray(theta) - a
        np.testing.assert_allclose(shift, np.full_like(a, shift.flat[0]), atol=1e-6)
        expected = -lr * (s + lam * np.linalg.norm(a - a_prev) + lam2 * np.linalg.norm(d_ref))
        np.testing.assert_allclose(shift.flat[0], expected, rtol=1e-4, atol=1e-6)
        shifts.append(abs(expected))
        rms_step = np.sqrt(np.mean(np.square(a - a_prev)))  # 0 for the zero-initialised biases here
        ratios.append(abs(expected) / rms_step if rms_step > 0 else 0.0)
    assert out[r][1]["fedref_shift"] == pytest.approx(s, rel=1e-5)
    # the per-tensor shift metrics: the largest |shift| and, over the tensors, the largest shift / RMS of A_r - A_{r-1}
    assert out[r][1]["fedref_layer_shift"] == pytest.approx(max(shifts), rel=1e-4)
    assert out[r][1]["fedref_layer_shift_ratio"] == pytest.approx(max(ratios), rel=1e-4) and max(ratios) > 0
    assert out[p][1]["fedref_layer_shift"] == 0.0  # the last warm-up round (p + 1) broadcasts A_r unshifted
    assert out[p + 1][1]["fedref_layer_shift"] > 0  # the first corrected round


@pytest.mark.parametrize("variant", ["code", "map_prox"])
def test_the_server_step_leaves_batchnorm_statistics_as_aggregated(variant):
    """Spec 2.3: the shift is per trainable tensor; the authors never shift buffers, and a scalar shift of
    BatchNorm's running variance (MobileNetV3, ResNet-20) could drive it negative."""
    model = bf.models.get_model("resnet20", 10)
    aggs = [bf.models.init_params(model, (8, 8, 3), jax.random.PRNGKey(i)) for i in range(4)]
    aggs = [{**a, "batch_stats": jax.tree.map(lambda x: x + 0.1 * i, a["batch_stats"])} for i, a in enumerate(aggs)]
    algo = bf.algorithms.fedref(model, variant=variant, lam=0.3, p=2)
    (server, _), = _run_server(algo, aggs, [[3.0 - r, 1.0, 2.0] for r in range(4)], init=aggs[0])[-1:]
    chex.assert_trees_all_equal(server["params"]["batch_stats"], aggs[-1]["batch_stats"])
    assert not np.allclose(_flat(server["params"]["params"]), _flat(aggs[-1]["params"]), atol=1e-4)


def test_code_variant_limits():
    losses = [[1.0, 1.0, 1.0]] * 5
    same = _run_server(_fedref(variant="code", lam=0.0, p=2), AGGS[:5], losses)  # lam 0, unchanged losses: FedAvg
    chex.assert_trees_all_close(same[-1][0]["params"], AGGS[4], atol=1e-7)
    falling = [[1.0, 1.0, 1.0]] * 4 + [[0.4, 0.4, 0.4]]  # lam 0: a uniform shift -eta s, s = -0.6
    shifted = _run_server(_fedref(variant="code", lam=0.0, p=2), AGGS[:5], falling, lr=0.1)
    chex.assert_trees_all_close(shifted[-1][0]["params"], jax.tree.map(lambda a: a + 0.06, AGGS[4]), atol=1e-6)
    logged = _run_server(_fedref(variant="code", lam=0.0, p=2, loss_term="weighted_sum"), AGGS[:5], falling)
    chex.assert_trees_all_close(logged[-1][0]["params"], AGGS[4], atol=1e-7)
    assert logged[-1][1]["weighted_loss"] == pytest.approx(0.4)


@pytest.mark.parametrize("through,reference,lam_ref", [(False, "mean", None), (True, "mean", None),
                                                        (True, "p_plus_one", 0.5), (True, "weighted", 0.5)])
def test_l2_variant_is_one_gradient_step_of_eq12(through, reference, lam_ref):
    p, lam, lr = 3, 0.2, 0.1
    algo = _fedref(variant="l2", lam=lam, p=p, ref_through_A=through, reference=reference, lam_ref=lam_ref)
    out = _run_server(algo, AGGS[:6], lr=lr)
    window = p + 1 if reference == "p_plus_one" else p
    a_prev, older = AGGS[4], AGGS[6 - window:5]
    js = np.arange(7 - window, 7)  # 1-based rounds in the buffer, the current one last
    w = 1.0 + js % p if reference == "weighted" else np.ones(window)
    w = w / w.sum()
    prev_w = 1.0 + (js - 1) % p if reference == "weighted" else np.ones(window)
    prev_ref = jax.tree.map(lambda *a: sum(wi * ai for wi, ai in zip(prev_w / prev_w.sum(), a)),
                            *AGGS[5 - window:5])

    def objective(theta):
        value = lam * optax.tree.norm(jax.tree.map(jnp.subtract, theta, a_prev), squared=True)
        if through:  # R_r depends on A_r = theta with its weight in the reference
            ref = jax.tree.map(lambda t, *o: sum(wi * oi for wi, oi in zip(w, o)) + w[-1] * t, theta, *older)
            value += (lam if lam_ref is None else lam_ref) * optax.tree.norm(
                jax.tree.map(jnp.subtract, ref, prev_ref), squared=True)
        return value

    grad = jax.grad(objective)(AGGS[5])
    chex.assert_trees_all_close(out[5][0]["params"], jax.tree.map(lambda a, g: a - lr * g, AGGS[5], grad), atol=1e-6)
    still = _run_server(algo, [AGGS[0]] * 6)
    chex.assert_trees_all_close(still[-1][0]["params"], AGGS[0], atol=1e-7)


def test_map_variants_pull_toward_the_reference():
    p, lam, lr = 2, 0.5, 0.1
    prox = _run_server(_fedref(variant="map_prox", lam=lam, p=p), AGGS[:5], lr=lr)[-1][0]["params"]
    step = _run_server(_fedref(variant="map_step", lam=lam, p=p), AGGS[:5], lr=lr)[-1][0]["params"]
    agg, ref = AGGS[4], jax.tree.map(lambda a, b: (a + b) / 2, AGGS[3], AGGS[4])
    # the proximal form solves (theta - A)/eta + 2 lam (theta - R) = 0 and lies on the segment [A, R]
    residual = jax.tree.map(lambda t, a, r: (t - a) / lr + 2 * lam * (t - r), prox, agg, ref)
    np.testing.assert_allclose(_flat(residual), 0.0, atol=1e-4)
    moved = np.abs(_flat(ref) - _flat(agg)) > 1e-3  # (the zero-initialised biases never move)
    t = (_flat(prox) - _flat(agg))[moved] / (_flat(ref) - _flat(agg))[moved]
    assert moved.sum() >= 6
    np.testing.assert_allclose(t, 0.1 / 1.1, rtol=1e-3)
    # the gradient form agrees to first order in eta * lam: their gap is (2 eta lam)^2 / (1 + 2 eta lam) |R - A|
    gap = np.abs(_flat(step) - _flat(prox))
    np.testing.assert_allclose(gap, 0.01 / 1.1 * np.abs(_flat(ref) - _flat(agg)), rtol=1e-3, atol=1e-7)
    none = _run_server(_fedref(variant="map_prox", lam=0.0, p=p), AGGS[:5])[-1][0]["params"]
    chex.assert_trees_all_close(none, agg, atol=1e-7)
    strong = _run_server(_fedref(variant="map_prox", lam=1e6, p=p), AGGS[:5])[-1][0]["params"]
    chex.assert_trees_all_close(strong, ref, atol=1e-5)
    # lambda_2 is the prior's weight: with lam_ref given, lam (lambda_1, no A term here) does not matter
    split = _run_server(_fedref(variant="map_prox", lam=0.0, lam_ref=lam, p=p), AGGS[:5], lr=lr)[-1][0]["params"]
    chex.assert_trees_all_close(split, prox, atol=1e-7)


def test_lambda_2_schedule_reaches_the_server_step():
    p, lam2 = 2, 0.01
    algo = _fedref(variant="map_prox", lam=0.0, lam_ref=lam2, p=p, lam_ref_growth=10.0, lam_ref_every=5,
                   lam_ref_cap=0.5)
    out = _run_server(algo, AGGS[:7], lr=1.0)
    assert [float(m["fedref_lambda_ref"]) for _, m in out] == pytest.approx([0.01] * 4 + [0.1] * 3)
    for r in (3, 6):  # corrected rounds before and after the step up: theta = (A + 2 eta lam2 R) / (1 + 2 eta lam2)
        rho = 2 * float(out[r][1]["fedref_lambda_ref"])
        ref = _weighted_ref(p, r)
        expected = jax.tree.map(lambda a, b: (a + rho * b) / (1 + rho), AGGS[r], ref)
        chex.assert_trees_all_close(out[r][0]["params"], expected, atol=1e-6)


def test_client_loss_reports():
    data = bf.data.load("digits")
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    fed = bf.data.from_partition(data, bf.data.partition(data.y_train, "iid", 2, seed=0))
    params = bf.models.init_params(model, fed.input_shape, jax.random.PRNGKey(0))
    task = bf.tasks.classification(model)
    x, y, count = jnp.asarray(fed.x[0]), jnp.asarray(fed.y[0]), int(fed.counts[0])
    for real in (count, 70):  # 70 rows real: one full batch and 6 rows, the rows after them masked out
        rows = [slice(i, min(i + 64, real)) for i in range(0, real, 64)]
        by_hand = np.mean([float(task.loss(params, bf.core.types.Batch(x[r], y[r], jnp.ones(r.stop - r.start))))
                           for r in rows])
        assert float(mean_batch_loss(task.loss, params, x, y, real, 64)) == pytest.approx(by_hand, rel=1e-5)
    # last_batch: the loss of the last real batch, before its update
    algo = bf.algorithms.fedref(model, loss_report="last_batch", batch_size=64)
    ctx = bf.core.types.ClientContext({"params": params}, (), bf.core.types.ClientData(x, y, jnp.int32(count)),
                                      {"lr": jnp.float32(0.1), "round": jnp.int32(1)})
    local = algo.client_init(ctx, jax.random.PRNGKey(0))
    batch = bf.core.types.Batch(x[:64], y[:64], jnp.ones(64))
    before = float(task.loss(local.params, batch))
    local = algo.client_step(local, batch, ctx, jax.random.PRNGKey(1))
    message, _, metrics = algo.client_final(local, ctx)
    assert float(message["loss"]) == pytest.approx(before, rel=1e-5) == pytest.approx(metrics["reported_loss"])


def test_nested_round_subsets():
    counts = jnp.asarray([100, 100, 60, 0], jnp.int32)
    arrays = RoundArrays(jnp.zeros((4, 100, 1)), jnp.zeros((4, 100), jnp.int32), counts,
                         jnp.asarray([0.4, 0.4, 0.2, 0.0]), jnp.asarray([1.0, 1.0, 1.0, 0.0]),
                         jnp.zeros((1, 1)), jnp.zeros(1, jnp.int32))
    config = RoundConfig(num_clients=4, clients_per_round=4, round_fractions=(0.5, 0.7, 0.9))
    seen = set()
    for r in range(20):
        sub = with_round_subsets(config, arrays, jax.random.PRNGKey(r))
        f = np.asarray(sub.counts[:2]) / 100
        seen |= set(np.round(f, 2))
        assert set(np.round(f, 2)) <= {0.5, 0.7, 0.9} and int(sub.counts[3]) == 0
        np.testing.assert_allclose(np.asarray(sub.base_weights[:2]), 0.4 * f, rtol=1e-6)
    assert seen == {0.5, 0.7, 0.9}
    # the nested partition: one permutation for every client, so smaller fractions are prefixes of larger ones
    parts = bf.data.partition(np.zeros(50, np.int64), "nested", 3, seed=1)
    assert all(np.array_equal(parts[0], q) for q in parts) and sorted(parts[0]) == list(range(50))
    assert set(parts[0][:25]) < set(parts[0][:40])


def _digits_fed():
    data = bf.data.load("digits")
    return bf.data.from_partition(data, bf.data.partition(data.y_train[:300], "iid", 3, seed=0))


def _server_after(algo, fed, rounds=3, **kw):
    result = bf.simulate(algo, fed, rounds=rounds, key=jax.random.PRNGKey(0), evaluate_local=False, **kw)
    return result.state.server["params"]


def test_baselines_reduce_to_fedavg():
    fed = _digits_fed()
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    fedavg = _server_after(bf.algorithms.fedavg(model, lr=0.1, clip_norm=None), fed)
    chex.assert_trees_all_close(_server_after(bf.algorithms.fedprox(model, mu=0.0, lr=0.1), fed), fedavg, atol=1e-6)
    chex.assert_trees_all_close(_server_after(bf.algorithms.fedprox(model, mu=5.0, lr=0.1, detached=True), fed),
                                fedavg, atol=1e-6)
    sgd = bf.algorithms.with_server_optimizer(bf.algorithms.fedavg(model, lr=0.1, clip_norm=None),
                                              bf.algorithms.server_optimizer("sgd", 1.0))
    chex.assert_trees_all_close(_server_after(sgd, fed, clients_per_chunk=2), fedavg, atol=1e-6)
    ref = bf.algorithms.fedref(model, variant="map_prox", lam=0.0, p=1, lr=0.1, batch_size=32)
    chex.assert_trees_all_close(_server_after(ref, fed), fedavg, atol=1e-6)
    live = _server_after(bf.algorithms.fedprox(model, mu=5.0, lr=0.1), fed)
    assert not np.allclose(_flat(live), _flat(fedavg), atol=1e-4)


def test_fedadam_first_step_and_fedyogi_second_moment():
    fed = _digits_fed()
    model = bf.models.get_model("mlp", 10, hidden=(16,))
    init = bf.models.init_params(model, fed.input_shape, jax.random.fold_in(jax.random.PRNGKey(0), 0))
    fedavg = _server_after(bf.algorithms.fedavg(model, lr=0.1, clip_norm=None), fed, rounds=1)
    eta, tau = 0.01, 1e-3
    adam = bf.algorithms.with_server_optimizer(bf.algorithms.fedavg(model, lr=0.1, clip_norm=None),
                                               bf.algorithms.server_optimizer("adam", eta, tau=tau))
    first = _server_after(adam, fed, rounds=1)
    # m_hat_1 = g, v_hat_1 = g^2 with g = theta_0 - A_1, so theta_1 = theta_0 - eta g / (|g| + tau)
    g = _flat(init) - _flat(fedavg)
    np.testing.assert_allclose(_flat(first), _flat(init) - eta * g / (np.abs(g) + tau), rtol=1e-5, atol=1e-7)
    yogi = bf.algorithms.server_optimizer("yogi", eta, tau=tau)
    v0 = {"w": jnp.asarray([4.0, 1e-8])}
    state = yogi.init(v0)
    state = (state[0]._replace(nu={"w": jnp.asarray([4.0, 1e-8])}),) + tuple(state[1:])
    _, new = yogi.update({"w": jnp.asarray([1.0, 1.0])}, state)
    nu = np.asarray(new[0].nu["w"])
    assert nu[0] < 4.0 and nu[1] > 1e-8  # v > g^2 decreases; v < g^2 grows (Eq. 6)
