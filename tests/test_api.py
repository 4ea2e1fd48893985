"""The public interface: the Algorithm contract, the registry, light imports and optional extras."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.core.simulate import traced_hparams

HEAVY = ("flax", "numpyro", "optax", "orbax", "matplotlib")


def _parts():
    return dict(server_init=lambda params: {"params": params}, client_init=lambda ctx, key: ctx.server["params"],
                client_step=lambda local, batch, ctx, key: local,
                client_final=lambda local, ctx: ({"params": local}, (), {}))


def test_an_algorithm_needs_one_aggregation_and_its_own_hyperparameters():
    update = lambda server, messages, weights, mask, hparams, key: (server, {})
    stats = dict(client_stats=lambda m: m["params"], server_from_stats=lambda s, t, mask, hp, key: ({"params": t}, {}))
    with pytest.raises(TypeError, match="give server_update or the pair"):
        bf.Algorithm("none", **_parts())
    with pytest.raises(TypeError, match="exactly one"):
        bf.Algorithm("both", server_update=update, **stats, **_parts())
    with pytest.raises(TypeError, match="go together"):
        bf.Algorithm("half", client_stats=stats["client_stats"], **_parts())
    with pytest.raises(ValueError, match="'round' is the engine's"):
        bf.Algorithm("r", server_update=update, hparams={"round": 1}, **_parts())
    algo = bf.Algorithm("ok", server_update=update, **_parts())
    assert algo.global_params({"params": 3}) == 3 and not algo.streams  # the default global_params
    assert bf.Algorithm("stats", **stats, **_parts()).streams
    with pytest.raises(ValueError, match="not ok's; it has"):
        traced_hparams(algo, 1, {"lam": 1.0})


def test_evaluated_model_chooses_what_ga_and_la_score(small_fed, digits):
    """The evaluate hook scores ``evaluated_model`` of the server state (GA) and of every message (LA); without the
    hook it scores ``global_params(server)`` and the messages' ``"params"``."""
    parts = {**_parts(), "server_init": lambda params: {"params": params, "shadow": params - 1.0},
             "client_final": lambda local, ctx: ({"params": local, "shadow": local + 2.0}, (), {})}
    update = lambda server, messages, weights, mask, hparams, key: (
        {"params": server["params"], "shadow": server["params"] - 1.0}, {})
    value = lambda model, x, y, mask=None: {"value": jnp.sum(model)}
    plain = bf.Algorithm("plain", server_update=update, evaluate=value, **parts)
    shadowed = plain.replace(evaluated_model=lambda state: state["shadow"])
    runs = {algo.name: bf.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params=jnp.zeros(3))
            for algo in (plain, shadowed.replace(name="shadowed"))}
    np.testing.assert_allclose([runs["plain"].metrics["global_value"][0], runs["plain"].metrics["local_value"][0]],
                               [0.0, 0.0])
    np.testing.assert_allclose([runs["shadowed"].metrics["global_value"][0],
                                runs["shadowed"].metrics["local_value"][0]], [-3.0, 6.0], rtol=1e-6)
    # a client's own test split scores the same local model (the default of evaluate_client)
    train, test = bf.data.dirichlet_train_test(digits.y_train[:200], digits.y_test, 3, alpha=1.0, seed=0)
    own = bf.data.stack_clients(digits.x_train[:200], digits.y_train[:200], train, x_test=digits.x_test,
                                y_test=digits.y_test, num_classes=10, test_parts=test)
    run = bf.simulate(shadowed, own, rounds=1, key=jax.random.PRNGKey(0), init_params=jnp.zeros(3))
    np.testing.assert_allclose(run.metrics["client_test_value"][0], 6.0, rtol=1e-6)


def test_simulate_says_how_to_initialise_an_algorithm_without_an_init_hook(small_fed):
    algo = bf.Algorithm("bare", server_update=lambda s, m, w, mask, hp, key: (s, {}), **_parts())
    with pytest.raises(ValueError, match="pass simulate\\(..., init_params=...\\)"):
        bf.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0))
    run = bf.simulate(algo, small_fed, rounds=1, key=jax.random.PRNGKey(0), init_params=jnp.zeros(3))
    assert run.metrics["round"] == [1]


def test_registry_builds_every_algorithm_and_checks_options(small_fed, tiny_model):
    server_held = {"abavg": {"validation": (small_fed.x_test[:50], small_fed.y_test[:50])}}
    for name in bf.algorithms.ALGORITHMS:
        algo = bf.algorithms.build(name, tiny_model, small_fed, **server_held.get(name, {}),
                                   **({"lr": 0.05} if "lr" in bf.algorithms.options_of(name) else {}))
        assert isinstance(algo, bf.Algorithm) and algo.evaluate is not None and algo.predict is not None, name
    assert bf.algorithms.build("fedsgd", tiny_model, small_fed).batch_size == small_fed.max_n  # from the data
    assert "lam" in bf.algorithms.options_of("fola") and "eps" in bf.algorithms.options_of("fola")
    with pytest.raises(ValueError, match="unknown algorithm 'fedsdg'; choose one of fedavg, fedsgd"):
        bf.algorithms.build("fedsdg", tiny_model)
    with pytest.raises(ValueError, match="fedavg has no option lam; its options are lr, local_epochs"):
        bf.algorithms.build("fedavg", tiny_model, lam=1.0)
    with pytest.raises(ValueError, match="scaffold needs num_clients"):
        bf.algorithms.build("scaffold", tiny_model)
    assert "lam" not in bf.algorithms.fedavg(tiny_model).hparams  # no prior, no lambda


@pytest.mark.parametrize("module", ["bfedjax.posteriors", "bfedjax.laplace", "bfedjax.core", "bfedjax.tree"])
def test_pieces_import_without_the_heavy_libraries(module):
    code = (f"import {module}, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_missing_optional_dependency_names_its_extra(monkeypatch):
    from bfedjax.optional import require
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'bfedjax\[checkpoint\]'"):
        require("orbax.checkpoint")
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"pip install 'bfedjax\[dp\]'"):
        bf.privacy.dp_epsilon(1.0, 0.1, 10, 1e-5)


def test_the_predict_hook_is_the_final_predictive(small_fed, tiny_model, tiny_params):
    """A deterministic classifier's predictive is its softmax; a dropout model's, MC passes that differ."""
    x = jnp.asarray(small_fed.x_test[:7])
    algo = bf.algorithms.fedavg(tiny_model)
    probs = algo.predict({"params": tiny_params}, x, jax.random.PRNGKey(0), 4)
    np.testing.assert_allclose(probs[0], jax.nn.softmax(tiny_model.apply({"params": tiny_params}, x)), rtol=1e-6)
    assert probs.shape == (1, 7, 10)
    dropout = bf.models.get_model("mlp", 10, hidden=(16,), dropout_rate=0.5)
    mc = bf.algorithms.fedavg(dropout).predict({"params": tiny_params}, x, jax.random.PRNGKey(0), 4)
    assert mc.shape == (4, 7, 10) and not np.allclose(mc[0], mc[1])
