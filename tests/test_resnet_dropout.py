"""ResNet-20 (BatchNorm state in the engine), MC dropout, and the variational ResNet."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import bfedjax as bf
from bfedjax.metrics import uncertainty
from bfedjax.models import apply as model_apply
from bfedjax.models.resnet import ResNet20, resnet20_param_count

SMALL = ResNet20(num_classes=10, blocks_per_stage=1)  # 8 convs: the same code paths, a fraction of the compile


def _abstract(model, shape):
    return jax.eval_shape(functools.partial(bf.models.init_params, model, shape), jax.random.PRNGKey(0))


@pytest.mark.parametrize("shortcut,expected", [("projection", 272_474), ("pad", 269_722)])
def test_resnet20_parameter_count(shortcut, expected):
    params = _abstract(ResNet20(shortcut=shortcut), (32, 32, 3))
    assert set(params) == {"params", "batch_stats"}
    assert bf.models.num_params(params["params"]) == expected == resnet20_param_count(shortcut=shortcut)
    convs = [p for p in traverse_util.flatten_dict(params["params"]) if p[-1] == "kernel"]
    assert len(convs) == 20 + (2 if shortcut == "projection" else 0)  # 19 convs + Dense (+ 2 projections)


def test_batchnorm_statistics_ignore_padded_rows():
    params = bf.models.init_params(SMALL, (8, 8, 1), jax.random.PRNGKey(0))
    train = jax.jit(model_apply.train_apply_fn_of(SMALL))  # one compile per batch shape, not one per operation
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 8, 8, 1))
    poisoned = jnp.concatenate([x, jnp.full((4, 8, 8, 1), 1e6)])
    mask = jnp.concatenate([jnp.ones(6), jnp.zeros(4)])
    logits, new = train(params, x, jnp.ones(6), None)
    logits_p, new_p = train(params, poisoned, mask, None)
    chex.assert_trees_all_close(logits_p[:6], logits, atol=1e-4)
    chex.assert_trees_all_close(new_p["batch_stats"], new["batch_stats"], atol=1e-4)
    assert not np.allclose(new["batch_stats"]["_Unit_0"]["BatchNorm_0"]["mean"],
                           params["batch_stats"]["_Unit_0"]["BatchNorm_0"]["mean"])
    chex.assert_trees_all_equal(new["params"], params["params"])


def test_mc_dropout_samples_differ_and_inference_is_deterministic():
    model = bf.models.get_model("mlp", 10, hidden=(32,), dropout_rate=0.2)
    params = bf.models.init_params(model, (8, 8, 1), jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 8, 8, 1))
    probs = bf.models.mc_predict_proba(model, params, x, jax.random.PRNGKey(2), num_samples=4)
    chex.assert_shape(probs, (4, 5, 10))
    assert float(jnp.max(jnp.abs(probs[0] - probs[1]))) > 1e-4
    apply = bf.models.apply_fn_of(model)
    chex.assert_trees_all_equal(apply(params, x), apply(params, x))
    with pytest.raises(ValueError, match="no dropout layers"):
        bf.models.get_model("lenet", 10, dropout_rate=0.2)
    with pytest.raises(ValueError, match="MC dropout"):
        bf.models.mc_predict_proba(bf.models.get_model("mlp", 10), params, x, jax.random.PRNGKey(0), 2)


def test_an_mc_dropout_model_is_scored_by_its_mc_predictive():
    """The classification task scores a dropout model by the accuracy and NLL of its eval_samples-pass MC
    predictive (dropout on at test time, spec D20), with the padding mask honoured; eval_samples=0: dropout off."""
    model = bf.models.get_model("mlp", 10, hidden=(32,), dropout_rate=0.5)
    params = bf.models.init_params(model, (8, 8, 1), jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (30, 8, 8, 1))
    y = jax.random.randint(jax.random.PRNGKey(2), (30,), 0, 10)
    probs = bf.models.mc_predict_proba(model, params, x, jax.random.PRNGKey(bf.metrics.classification.MC_EVAL_SEED), 6)
    p_bar = uncertainty.predictive(probs)
    scores = bf.tasks.classification(model, eval_samples=6).evaluate(params, x, y)
    np.testing.assert_allclose([scores["accuracy"], scores["loss"]],
                               [uncertainty.accuracy(p_bar, y), uncertainty.nll(p_bar, y)], rtol=1e-5)
    mask = (jnp.arange(30) < 20).astype(jnp.float32)
    masked = bf.tasks.classification(model, eval_samples=6).evaluate(params, x, y, mask)
    np.testing.assert_allclose(masked["loss"], uncertainty.nll(p_bar[:20], y[:20]), rtol=1e-5)
    off = bf.tasks.classification(model, eval_samples=0).evaluate(params, x, y)
    np.testing.assert_allclose(off["loss"], bf.metrics.evaluate(bf.models.apply_fn_of(model), params, x, y)["loss"])
    assert abs(float(off["loss"]) - float(scores["loss"])) > 1e-4


@pytest.fixture(scope="module")
def tiny_fed():
    data = bf.data.load("digits")
    parts = bf.data.partition(data.y_train[:240], "iid", 3, seed=0)
    return bf.data.from_partition(data, parts)


def _both_backends(algo, fed):
    # training only (no evaluation hook to compile in either backend): the tests compare the server states
    algo = algo.replace(evaluate=None)
    runs = [bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(0), evaluate_local=False, backend=b)
            for b in ("vmap", "sequential")]
    return [r.state.server for r in runs]


# The ResNet's tolerance: under the suite's compile flags (conftest.FAST_COMPILE_FLAGS: -O0 with the elemental
# emitters) on an AVX-512 machine, the batched and the per-client convolutions sum in different orders, and
# BatchNorm over 32-sample batches amplifies that to 2.1e-4 in the conv kernels after one round (0 under XLA's
# default flags; /tmp script, session 27). A lost BatchNorm update would leave running means 0.14-0.57 off.
@pytest.mark.parametrize("model,atol", [(SMALL, 1e-3), (bf.models.MLP(hidden=(32,), dropout_rate=0.2), 2e-5)],
                         ids=["resnet", "mc_dropout"])
def test_fedavg_train_mode_models_vmap_matches_sequential(model, atol, tiny_fed):
    algo = bf.algorithms.fedavg(model, lr=0.05, batch_size=32)
    vmapped, sequential = _both_backends(algo, tiny_fed)
    chex.assert_trees_all_close(vmapped, sequential, atol=atol, rtol=1e-4)
    init = bf.models.init_params(model, tiny_fed.input_shape, jax.random.fold_in(jax.random.PRNGKey(0), 0))
    if model_apply.has_batch_stats(model):  # the running statistics moved and were averaged like any leaf
        assert not np.allclose(vmapped["params"]["batch_stats"]["_Unit_0"]["BatchNorm_0"]["var"],
                               init["batch_stats"]["_Unit_0"]["BatchNorm_0"]["var"])


def test_variational_resnet_kernels_only_and_parity(tiny_fed):
    lr = 1e-3
    # plain reparameterisation: the parity and the kernels-only posterior do not depend on the estimator
    # (test_layer_noise covers Flipout and local reparameterisation), and it compiles in a fraction of Flipout's time
    algo = bf.algorithms.bfl(SMALL, tiny_fed.input_shape, rule="wc", lr=lr, batch_size=32,
                             gradient_estimator="reparameterization")
    vi = bf.vi.MeanFieldVI(SMALL, tiny_fed.input_shape)
    assert vi.variational and all(name.endswith(".kernel") and name.startswith("params.") for name in vi.variational)
    vmapped, sequential = _both_backends(algo, tiny_fed)
    # Adam's first steps are ~lr * sign(g): float rounding (batched vs single convolutions) flips the
    # sign of a few near-zero gradients. A real mismatch (wrong data, keys or prior) moves almost all.
    flat = lambda server: np.concatenate([np.ravel(v) for v in jax.tree.leaves(server["params"]["params"])])
    init = bf.models.init_params(SMALL, tiny_fed.input_shape, jax.random.fold_in(jax.random.PRNGKey(0), 0))
    moved = np.abs(flat(sequential) - flat({"params": init}))
    mismatch = np.abs(flat(vmapped) - flat(sequential))
    assert np.mean(moved > 0.1 * lr) > 0.5 and np.mean(mismatch > 0.1 * lr) < 0.01
    chex.assert_trees_all_close(vmapped["scale"], sequential["scale"], atol=1e-5)
    scale = traverse_util.flatten_dict(vmapped["scale"])
    for path, s in scale.items():  # BatchNorm leaves and statistics stay deterministic
        assert (float(np.max(s)) > 0) == (".".join(path) in vi.variational), path  # numpy: no compile per shape
    stats = vmapped["params"]["batch_stats"]["_Unit_0"]["BatchNorm_0"]
    assert np.all(np.isfinite(stats["var"])) and not np.allclose(stats["var"], 1.0)
    probs = vi.predict_proba(vmapped, jnp.asarray(tiny_fed.x_test[:7]), jax.random.PRNGKey(3), 3)
    chex.assert_shape(probs, (3, 7, 10))
    chex.assert_tree_all_finite(probs)
