"""Mean-field VI clients on NumPyro and the Fischer et al. algorithm in the round engine."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest

import bfedjax as bf
from bfedjax.core import ClientContext, ClientData, RoundConfig, init_state, make_round_step
from bfedjax.core.simulate import round_arrays, traced_hparams
from bfedjax.metrics import uncertainty
from bfedjax.algorithms.bfl import kl_weight
from bfedjax.vi import MeanFieldVI


@pytest.fixture(scope="module")
def vi_model():
    return bf.models.get_model("mlp", 10, hidden=(8,))


def test_posterior_svi_param_round_trip(vi_model):
    vi = MeanFieldVI(vi_model, (8, 8, 1))
    assert vi.variational == {"Dense_0.kernel", "Dense_1.kernel"}
    post = vi.init_posterior(jax.random.PRNGKey(0))
    chex.assert_trees_all_close(vi.posterior(vi.svi_params(post)), post)
    biases = MeanFieldVI(vi_model, (8, 8, 1), bf.vi.MeanFieldConfig(variational_biases=True))
    assert "Dense_0.bias" in biases.variational
    probs = vi.predict_proba(post, jnp.zeros((5, 8, 8, 1)), jax.random.PRNGKey(1), num_samples=3)
    assert probs.shape == (3, 5, 10)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_initial_posterior_mean_follows_the_spec_default_and_its_options():
    model = bf.models.get_model("mlp", 10, hidden=(200,))
    key = jax.random.PRNGKey(3)
    zoo = bf.models.init_params(model, (8, 8, 1), jax.random.split(key)[0])
    stds = {}
    for init_loc in bf.vi.INIT_LOCS:
        vi = MeanFieldVI(model, (8, 8, 1), bf.vi.MeanFieldConfig(init_loc=init_loc))
        params = vi.init_params(key)
        if init_loc == "model":  # the zoo's init from the key itself: the runs before spec D4 was followed
            zoo = bf.models.init_params(model, (8, 8, 1), key)
        chex.assert_trees_all_equal(params["Dense_0"]["bias"], zoo["Dense_0"]["bias"])  # deterministic: the zoo's
        stds[init_loc] = float(jnp.std(params["Dense_0"]["kernel"]))  # [64, 200]
        assert abs(float(jnp.mean(params["Dense_0"]["kernel"]))) < 0.01
        if init_loc == "model":
            chex.assert_trees_all_equal(params, zoo)
        post = vi.init_posterior(key)
        chex.assert_trees_all_equal(post["params"], params)
        np.testing.assert_allclose(post["scale"]["Dense_0"]["kernel"], jax.nn.softplus(-3.0), rtol=1e-6)
    assert stds["normal"] == pytest.approx(0.1, rel=0.03)  # spec D4: loc ~ N(0, 0.1^2)
    assert stds["he_normal"] == pytest.approx(np.sqrt(2 / 64), rel=0.05)  # fan_in 64 (8x8x1 flattened)
    assert stds["model"] == pytest.approx(float(jnp.std(zoo["Dense_0"]["kernel"])))
    wide = MeanFieldVI(model, (8, 8, 1), bf.vi.MeanFieldConfig(init_loc_std=0.5)).init_params(key)
    assert float(jnp.std(wide["Dense_0"]["kernel"])) == pytest.approx(0.5, rel=0.03)
    algo = bf.algorithms.bfl(model, (8, 8, 1))
    chex.assert_trees_all_equal(algo.init_params(key, (8, 8, 1)), MeanFieldVI(model, (8, 8, 1)).init_params(key))
    with pytest.raises(ValueError, match="fix: bfl"):
        algo.init_params(key, (28, 28, 1))
    with pytest.raises(ValueError, match="init_loc"):
        bf.vi.MeanFieldConfig(init_loc="xavier")
    he_biases = MeanFieldVI(model, (8, 8, 1), bf.vi.MeanFieldConfig(init_loc="he_normal", variational_biases=True))
    drawn = he_biases.init_params(key)  # variational biases have no fan-in: they start at 0
    chex.assert_trees_all_equal(drawn["Dense_0"]["bias"], jnp.zeros(200))
    assert float(jnp.std(drawn["Dense_0"]["kernel"])) == pytest.approx(np.sqrt(2 / 64), rel=0.05)


@pytest.mark.parametrize("rule,weighting", [("wc", "by_size"), ("lp", "max_discrepancy"),
                                          ("raw_param_fedavg", "max_discrepancy_symmetric"),
                                          ("nwa", "distance_reversed")])
def test_variational_round_vmap_matches_sequential(rule, weighting, small_fed, vi_model):
    algo = bf.algorithms.bfl(vi_model, small_fed.input_shape, rule=rule, weighting=weighting, lr=1e-2,
                             batch_size=16)
    params = vi_model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    config = RoundConfig(num_clients=5, clients_per_round=3, clients_per_chunk=2)
    out = {}
    for backend in ("vmap", "sequential"):
        state = init_state(algo, params, config)
        out[backend] = make_round_step(algo, config, backend)(state, round_arrays(small_fed), jax.random.PRNGKey(2),
                                                              traced_hparams(algo, 1))
    chex.assert_trees_all_close(out["vmap"], out["sequential"], rtol=2e-4, atol=2e-6)


def test_bfl_learns_and_reports_posterior_scale(digits, vi_model):
    fed = bf.data.from_partition(digits, bf.data.partition(digits.y_train, "iid", 4, seed=0))
    runs = {rule: bf.simulate(bf.algorithms.bfl(vi_model, fed.input_shape, rule=rule, lr=1e-2, batch_size=32),
                              fed, rounds=2, key=jax.random.PRNGKey(0), evaluate_local=False)
            for rule in ("nwa", "conflation")}
    for res in runs.values():
        assert res.metrics["global_accuracy"][-1] > 0.3
    # Conflation divides the variance by about K per round; NWA keeps it.
    assert runs["conflation"].metrics["mean_posterior_scale"][-1] < 0.5 * runs["nwa"].metrics["mean_posterior_scale"][-1]
    vi = MeanFieldVI(vi_model, fed.input_shape)
    probs = vi.predict_proba(runs["nwa"].state.server, jnp.asarray(fed.x_test), jax.random.PRNGKey(0), num_samples=4)
    summary = uncertainty.summary(probs, jnp.asarray(fed.y_test))
    assert 0 < float(summary["nll"]) < 5 and 0 <= float(summary["ece"]) <= 1


def test_ga_and_la_score_the_mc_predictive(small_fed, digits, vi_model):
    """Per-round GA / loss are the accuracy and NLL of the global posterior's eval_samples-sample predictive (the
    quantities the final summary reports); eval_samples=0 scores the posterior mean."""
    x, y = jnp.asarray(small_fed.x_test), jnp.asarray(small_fed.y_test)
    runs = {m: bf.simulate(bf.algorithms.bfl(vi_model, small_fed.input_shape, rule="nwa", lr=1e-2, eval_samples=m,
                                             init_scale=0.3), small_fed, rounds=2, key=jax.random.PRNGKey(0))
            for m in (8, 0)}
    for run in runs.values():  # the same training: evaluation draws from its own key
        chex.assert_trees_all_close(run.state.server, runs[0].state.server)
    server = runs[8].state.server
    vi = MeanFieldVI(vi_model, small_fed.input_shape)
    summary = uncertainty.summary(vi.predict_proba(server, x, jax.random.PRNGKey(bf.metrics.classification.MC_EVAL_SEED), num_samples=8), y)
    np.testing.assert_allclose(runs[8].metrics["global_accuracy"][-1], summary["accuracy"], atol=1e-6)
    np.testing.assert_allclose(runs[8].metrics["global_loss"][-1], summary["nll"], rtol=1e-5)
    mean_scores = bf.metrics.evaluate(bf.models.apply_fn_of(vi_model), server["params"], x, y)
    np.testing.assert_allclose(runs[0].metrics["global_loss"][-1], mean_scores["loss"], rtol=1e-5)
    assert abs(runs[8].metrics["global_loss"][-1] - runs[0].metrics["global_loss"][-1]) > 1e-3  # sampling shows
    # LA: the weighted MC scores of the local posteriors, which differ from their means' too
    assert abs(runs[8].metrics["local_loss"][-1] - runs[0].metrics["local_loss"][-1]) > 1e-3
    # one client: the global posterior is its posterior (to rounding: WC divides and multiplies by the precision),
    # so LA, its MC score, equals GA
    one = bf.data.from_partition(digits, [np.arange(150)])
    run = bf.simulate(bf.algorithms.bfl(vi_model, one.input_shape, rule="wc", lr=1e-2, eval_samples=8,
                                        init_scale=0.3), one, rounds=1, key=jax.random.PRNGKey(1))
    assert run.metrics["local_loss"][0] == pytest.approx(run.metrics["global_loss"][0], rel=1e-4)
    with pytest.raises(ValueError, match="eval_samples=-1 must be >= 0"):
        bf.algorithms.bfl(vi_model, small_fed.input_shape, eval_samples=-1)


def test_bad_rule_and_weighting(vi_model):
    with pytest.raises(ValueError, match="rule"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), rule="median")
    with pytest.raises(ValueError, match="weighting"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), weighting="loss")


def test_guide_is_numpyros_autonormal_written_out(vi_model):
    """``MeanFieldVI.guide`` samples, scores and constrains as NumPyro's ``AutoNormal`` over the same model: the
    same ELBO and gradient under the same key and params (order of the sites, event dims, softplus scales)."""
    from numpyro.infer import SVI
    from numpyro.infer.autoguide import AutoNormal
    config = bf.vi.MeanFieldConfig(variational_biases=True, gradient_estimator="reparameterization")
    vi = MeanFieldVI(vi_model, (8, 8, 1), config)  # reparameterisation: the model reads no guide params
    key = jax.random.PRNGKey(0)
    x, y, mask, count = jax.random.uniform(key, (6, 8, 8, 1)), jnp.arange(6) % 10, jnp.ones(6), jnp.float32(6)
    posterior = vi.init_posterior(key)
    posterior["scale"] = jax.tree.map(lambda s: s * jnp.linspace(0.5, 2.0, s.size).reshape(s.shape), posterior["scale"])
    state = jax.jit(lambda p: vi.init_svi_state(key, x, y, count, p))(posterior)
    params = vi.svi.get_params(state)
    sites = {f"net/{name}" for name in vi.variational}
    assert {k for k in params if k.endswith(("_loc", "_scale"))} == {f"{s}_{p}" for s in sites for p in ("loc", "scale")}
    auto = AutoNormal(vi.numpyro_model, init_scale=config.init_scale)
    numpyro.handlers.seed(auto, 0)(x, y, mask, count)  # its prototype, set up outside the loss (it draws a key)
    renamed = {renamed_name(k, sites): v for k, v in params.items()}

    def loss(guide, p, k):
        return vi.svi.loss.loss(k, p, vi.numpyro_model, guide, x, y, mask, count)

    value, grad = jax.jit(loss, static_argnums=0), jax.jit(jax.grad(loss, 1), static_argnums=0)
    for k in jax.random.split(key, 3):
        np.testing.assert_allclose(value(vi.guide, params, k), value(auto, renamed, k), rtol=1e-6)
    ours, theirs = grad(vi.guide, params, key), grad(auto, renamed, key)
    chex.assert_trees_all_close({renamed_name(k, sites): g for k, g in ours.items()}, theirs, rtol=1e-5, atol=1e-7)
    # an SVI step moves the unconstrained params: the same scales only through the same (softplus) constraint
    auto_svi = SVI(vi.numpyro_model, auto, vi.svi.optim, vi.svi.loss)
    auto_state = jax.jit(lambda p: auto_svi.init(key, x, y, mask, count, init_params=p))(renamed)
    stepped = vi.svi.get_params(jax.jit(vi.svi.update)(state, x, y, mask, count)[0])
    chex.assert_trees_all_close({renamed_name(k, sites): v for k, v in stepped.items()},
                                auto_svi.get_params(jax.jit(auto_svi.update)(auto_state, x, y, mask, count)[0]),
                                rtol=1e-5)


def test_guide_samples_the_models_latent_sites_in_its_order():
    """On a model with BatchNorm (the Flax params one level down, ``_prefix``), kernels and variational biases:
    the guide's sample sites are the model's latent sites, in the model's order, with the same event shapes."""
    from numpyro import handlers
    model = bf.models.get_model("resnet20", 10)
    vi = MeanFieldVI(model, (8, 8, 1), bf.vi.MeanFieldConfig(variational_biases=True))
    key = jax.random.PRNGKey(0)
    x, y, mask, count = jax.random.uniform(key, (2, 8, 8, 1)), jnp.arange(2), jnp.ones(2), jnp.float32(2)
    def latent(trace):
        return [(name, site["fn"].batch_shape, site["fn"].event_shape) for name, site in trace.items()
                if site["type"] == "sample" and not site["is_observed"]]

    traces = {}

    def record(key):  # traced only (jax.eval_shape): the sites are Python-level facts
        state = vi.init_svi_state(key, x, y, count, vi.init_posterior(key))
        params = {**vi.svi.get_params(state), **state.mutable_state}
        guide = handlers.trace(handlers.seed(handlers.substitute(vi.guide, params), 0))
        guide_trace = guide.get_trace(x, y, mask, count)
        model = handlers.replay(handlers.substitute(vi.numpyro_model, params), guide_trace)
        traces["guide"] = latent(guide_trace)
        traces["model"] = latent(handlers.trace(handlers.seed(model, 1)).get_trace(x, y, mask, count))
        return jnp.zeros(())

    jax.eval_shape(record, key)
    assert traces["guide"] == traces["model"] and len(traces["guide"]) == len(vi.variational)
    # wire paths: a BatchNorm model's Flax params sit under "params"
    assert {"params." + name.removeprefix("net/") for name, *_ in traces["guide"]} == vi.variational
    assert any(name.endswith(".bias") for name, *_ in traces["guide"])


def renamed_name(name: str, sites: set) -> str:
    """``AutoNormal``'s name of a guide param: ``<site>_auto_loc`` for ``<site>_loc``."""
    stem, _, kind = name.rpartition("_")
    return f"{stem}_auto_{kind}" if stem in sites else name


def test_kl_weight_multiplies_the_elbo_kl_by_the_analytic_kl(vi_model):
    """Spec D5: the guide's scale multiplies TraceMeanField_ELBO's analytic KL and nothing else."""
    vi = MeanFieldVI(vi_model, (8, 8, 1))
    key = jax.random.PRNGKey(0)
    x, y = jax.random.uniform(key, (6, 8, 8, 1)), jnp.arange(6) % 10
    posterior = vi.init_posterior(key)
    state = vi.init_svi_state(key, x, y, jnp.float32(6), posterior)
    params = vi.svi.get_params(state)

    def loss(weight):
        return float(vi.svi.loss.loss(key, params, vi.svi.model, vi.svi.guide, x, y, jnp.ones(6), jnp.float32(6),
                                      kl_weight=weight))

    # KL[N(loc, scale) || N(0, 10^2)], summed over the variational kernels, computed here by hand.
    kl = sum(float(jnp.sum(jnp.log(10.0 / s) + (s ** 2 + m ** 2) / 200.0 - 0.5))
             for m, s in ((posterior["params"][layer]["kernel"], posterior["scale"][layer]["kernel"])
                          for layer in ("Dense_0", "Dense_1")))
    assert loss(None) == loss(1.0)
    np.testing.assert_allclose(loss(3.0) - loss(1.0), 2.0 * kl, rtol=1e-4)
    np.testing.assert_allclose(loss(0.25) - loss(1.0), -0.75 * kl, rtol=1e-4)


def test_kl_weight_options():
    count = jnp.float32(50.0)
    assert float(kl_weight(count, 3)) == 1.0
    assert float(kl_weight(count, 3, divisor="federation", total_size=1000)) == pytest.approx(0.05)
    assert float(kl_weight(count, 3, beta=2.0, anneal_rounds=4)) == pytest.approx(1.5)
    assert float(kl_weight(count, 9, beta=2.0, anneal_rounds=4)) == 2.0


def test_kl_options_change_the_round_as_specified(digits, vi_model):
    fed = bf.data.stack_clients(digits.x_train[:200], digits.y_train[:200], np.split(np.arange(200), 5),
                                x_test=digits.x_test, y_test=digits.y_test, num_classes=10, name="digits")
    params = vi_model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    config = RoundConfig(num_clients=5, clients_per_round=5)

    def servers(*runs, **options):
        """The server after one round of ``bfl`` built with ``options``, for each ``(round_index, kl_beta override
        or None)`` in ``runs``: one program (kl_beta is a traced hyper-parameter)."""
        algo = bf.algorithms.build("bfl", vi_model, fed, lr=0.1, local_epochs=2, batch_size=20, **options)
        step, state = make_round_step(algo, config, "vmap"), init_state(algo, params, config)
        return [step(state, round_arrays(fed), jax.random.PRNGKey(2),
                     traced_hparams(algo, r, None if beta is None else {"kl_beta": beta}))[0].server for r, beta in runs]

    # build's kl_beta is the round's traced hyper-parameter, which the runs below override
    assert bf.algorithms.build("bfl", vi_model, fed, kl_beta=1e4).hparams["kl_beta"] == 1e4
    default, strong, fifth, quarter, default_round_5 = servers((1, None), (1, 1e4), (1, 0.2), (1, 0.25), (5, None))
    # A strong KL pulls the clients' means toward the prior's (0).
    mean_abs = lambda s: float(jnp.mean(jnp.abs(s["params"]["Dense_0"]["kernel"])))
    assert mean_abs(strong) < 0.8 * mean_abs(default)
    # |D_k| / |D| = 1/5 on equal clients: the same round as an explicit beta of 1/5 (build fills |D|).
    chex.assert_trees_all_close(servers((1, None), kl_divisor="federation")[0], fifth, rtol=1e-4, atol=1e-6)
    # Annealed over 4 rounds: round 1 uses beta/4, round 4 and later the full beta.
    annealed_1, annealed_5 = servers((1, None), (5, None), kl_anneal_rounds=4)
    chex.assert_trees_all_close(annealed_1, quarter, rtol=1e-4, atol=1e-6)
    # two programs (beta * min(r / 4, 1) against beta): equal up to the compiler's rounding
    chex.assert_trees_all_close(annealed_5, default_round_5, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="total_size"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), kl_divisor="federation")
    with pytest.raises(ValueError, match="kl_beta"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), kl_beta=0.0)


def test_sgd_clients_step_along_the_elbo_gradient(vi_model):
    """Spec D7's option: plain SGD moves each posterior mean by -lr times the ELBO loss gradient."""
    vi = MeanFieldVI(vi_model, (8, 8, 1), bf.vi.MeanFieldConfig(optimizer="sgd"))
    key = jax.random.PRNGKey(0)
    x, y = jax.random.uniform(key, (6, 8, 8, 1)), jnp.arange(6) % 10
    state = MeanFieldVI.with_learning_rate(vi.init_svi_state(key, x, y, jnp.float32(6), vi.init_posterior(key)), 0.05)
    params, name = vi.svi.get_params(state), "net/Dense_1.kernel_loc"
    step_key = jax.random.split(state.rng_key)[1]  # the key SVI.update evaluates the loss with
    grad = jax.grad(lambda loc: vi.svi.loss.loss(step_key, {**params, name: loc}, vi.svi.model, vi.svi.guide, x, y,
                                                 jnp.ones(6), jnp.float32(6)))(params[name])
    new, _ = vi.svi.update(state, x, y, jnp.ones(6), jnp.float32(6))
    np.testing.assert_allclose(vi.svi.get_params(new)[name], params[name] - 0.05 * grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="optimizer"):
        bf.vi.MeanFieldConfig(optimizer="rmsprop")


@pytest.mark.parametrize("optimizer, factor", [("sgd", 1 / 40), ("adam", 1.0)])
def test_bfl_clients_step_on_the_per_sample_loss(vi_model, optimizer, factor):
    """Spec D5: the loss is mean CE + KL / |D_k|, 1 / |D_k| times SVI's negative ELBO; SGD's step (the test above:
    -lr times the gradient of SVI's loss) is lr / |D_k|, Adam's (blind to the factor) lr."""
    algo = bf.algorithms.bfl(vi_model, (8, 8, 1), lr=0.05, optimizer=optimizer)
    x, y = jnp.zeros((64, 8, 8, 1)), jnp.zeros(64, jnp.int32)
    server = algo.server_init(algo.init_params(jax.random.PRNGKey(0), (8, 8, 1)))
    ctx = ClientContext(server, (), ClientData(x, y, jnp.int32(40)), {"lr": jnp.float32(0.05), "round": jnp.int32(1),
                                                                      "kl_beta": jnp.float32(1.0)})
    state = algo.client_init(ctx, jax.random.PRNGKey(1))
    np.testing.assert_allclose(state.optim_state[1][1].hyperparams["learning_rate"], 0.05 * factor, rtol=1e-6)


def test_tempered_prior_is_the_normalised_product():
    """Spec D18's option: q_g^t N(0, s_p^2)^(1-t); its log density minus the tempered sum is constant."""
    from bfedjax.algorithms.bfl import tempered_prior
    loc, scale = {"w": jnp.array([2.0, -0.5])}, {"w": jnp.array([1.0, 0.1])}
    (m,), (s,) = (jax.tree.leaves(t) for t in tempered_prior(loc, scale, 0.5, 10.0))
    z = jnp.linspace(-3.0, 3.0, 7)[:, None]
    log_n = lambda z, mean, std: -0.5 * ((z - mean) / std) ** 2 - jnp.log(std)
    gap = log_n(z, m, s) - (0.5 * log_n(z, loc["w"], scale["w"]) + 0.5 * log_n(z, 0.0, 10.0))
    np.testing.assert_allclose(gap - gap[0], 0.0, atol=1e-4)
    assert float(s[0]) > 1.0  # flatter than q_g where q_g is narrower than the prior
    (m1,), (s1,) = (jax.tree.leaves(t) for t in tempered_prior(loc, scale, 1.0, 10.0))
    np.testing.assert_allclose(m1, loc["w"], rtol=1e-6)
    np.testing.assert_allclose(s1, scale["w"], rtol=1e-6)


def test_prior_temperature_and_scale_floor_reach_the_round(small_fed, vi_model):
    params = vi_model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    config = RoundConfig(num_clients=5, clients_per_round=5)

    def round_out(**options):
        algo = bf.algorithms.bfl(vi_model, small_fed.input_shape, lr=1e-2, batch_size=16, **options)
        state = init_state(algo, params, config)
        return make_round_step(algo, config, "vmap")(state, round_arrays(small_fed), jax.random.PRNGKey(2),
                                                     traced_hparams(algo, 1))

    plain, _ = round_out(prior_update=True)
    tempered, _ = round_out(prior_update=True, prior_temperature=0.5)
    assert not np.allclose(plain.server["params"]["Dense_0"]["kernel"], tempered.server["params"]["Dense_0"]["kernel"])
    # t -> 0 tempers the global posterior all the way to the fixed N(0, 10^2) prior.
    chex.assert_trees_all_close(round_out(prior_update=True, prior_temperature=1e-9)[0], round_out()[0],
                                rtol=1e-3, atol=1e-6)
    # Conflation shrinks the scales K-fold; a floor above them raises every variational scale to it.
    floored, metrics = round_out(rule="conflation", scale_min=0.5)
    np.testing.assert_allclose(floored.server["scale"]["Dense_0"]["kernel"], 0.5)
    assert int(metrics["scale_floor_hits"]) == 64 * 8 + 8 * 10
    with pytest.raises(ValueError, match="prior_update=True"):
        bf.algorithms.bfl(vi_model, (8, 8, 1), prior_temperature=0.5)


def test_dwc_divides_by_the_prior_the_clients_trained_against(small_fed, vi_model, monkeypatch):
    from bfedjax.algorithms.bfl import tempered_prior
    from bfedjax.posteriors import aggregation
    seen = []
    real = aggregation.distributed_weight_consolidation
    key = ("Dense_0", "kernel")

    def recording(stacked, w, prior, *args, **kwargs):
        jax.debug.callback(lambda m, p: seen.append((np.asarray(m), np.asarray(p))), prior.mean[key],
                           prior.precision[key])
        return real(stacked, w, prior, *args, **kwargs)

    monkeypatch.setattr(aggregation, "distributed_weight_consolidation", recording)
    params = vi_model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    config = RoundConfig(num_clients=5, clients_per_round=5)
    algo = bf.algorithms.bfl(vi_model, small_fed.input_shape, rule="dwc", prior_temperature=0.5, scale_min=0.1)
    state = init_state(algo, params, config)
    jax.block_until_ready(make_round_step(algo, config, "vmap")(state, round_arrays(small_fed), jax.random.PRNGKey(2),
                                                                traced_hparams(algo, 1)))
    server = state.server
    floored = jax.tree.map(lambda s: jnp.maximum(jnp.where(s > 0, s, 1.0), 0.1), server["scale"])
    loc, scale = tempered_prior(server["params"], floored, 0.5, 10.0)
    np.testing.assert_allclose(seen[-1][0], loc["Dense_0"]["kernel"], rtol=1e-6)
    np.testing.assert_allclose(seen[-1][1], scale["Dense_0"]["kernel"] ** -2.0, rtol=1e-5)
