"""Mean-field Gaussian variational inference over any Flax model, through NumPyro.

The NumPyro model places a Normal prior on every variational leaf of a Flax
module (``random_flax_module``); an ``AutoNormal`` guide holds one
N(loc, scale) per weight (scale stored as softplus^-1, the paper's rho);
``TraceMeanField_ELBO`` uses the analytic Gaussian KL. The likelihood of a
masked mini-batch is scaled by ``count / n_batch``, so one SVI step minimises
``|D_k| * (mean-batch CE) + KL`` = ``|D_k| * (CE + KL / |D_k|)`` (spec D5; with
Adam the constant factor does not change the steps).

Posteriors cross the wire as a pair of parameter pytrees ``{"params": loc,
"scale": scale}``; deterministic leaves (biases by default, spec D3) carry
their value in ``params`` and scale 0.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
import optax
from flax import traverse_util
from numpyro.contrib.module import random_flax_module
from numpyro.infer import SVI, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoNormal

NET = "net"


def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class MeanFieldConfig:
    """prior_scale: std of the N(0, prior_scale^2) prior (spec D6: variance 100 -> 10).
    init_scale: initial posterior std (softplus(-3) ~ 0.0486, spec D4).
    variational_biases: put a prior and a posterior on biases too (default: point estimates).
    train_samples / test_samples: MC samples of the ELBO and of the predictive.
    learning_rate: Adam step (spec D7: 1e-3, fresh state every round).
    """

    prior_scale: float = 10.0
    init_scale: float = float(jax.nn.softplus(-3.0))
    variational_biases: bool = False
    train_samples: int = 1
    test_samples: int = 10
    learning_rate: float = 1e-3


class MeanFieldVI:
    """Builds the NumPyro model/guide/SVI for a Flax classifier and converts its state."""

    def __init__(self, module, input_shape: tuple[int, ...], config: MeanFieldConfig = MeanFieldConfig()):
        self.module = module
        self.input_shape = tuple(input_shape)
        self.config = config
        params = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1,) + self.input_shape)))["params"]
        flat = traverse_util.flatten_dict(params)
        self.variational = frozenset(
            _path_name(path) for path in flat if config.variational_biases or path[-1] != "bias")
        self.guide = AutoNormal(self.numpyro_model, init_scale=config.init_scale)
        self.svi = SVI(self.numpyro_model, self.guide, optax.adam(config.learning_rate),
                       TraceMeanField_ELBO(num_particles=config.train_samples))

    # -- the probabilistic model ------------------------------------------------------------

    def numpyro_model(self, x, y, mask, count, prior_loc=None, prior_scale=None):
        """x ``[B, ...]``, y ``[B]``, mask ``[B]``, count ``[]``; optional prior pytrees (global posterior)."""

        if prior_loc is None:
            prior = {name: dist.Normal(0.0, self.config.prior_scale) for name in self.variational}
        else:
            flat_loc, flat_scale = traverse_util.flatten_dict(prior_loc), traverse_util.flatten_dict(prior_scale)
            prior = {name: dist.Normal(flat_loc[tuple(name.split("."))], flat_scale[tuple(name.split("."))])
                     for name in self.variational}
        net = random_flax_module(NET, self.module, prior=prior, input_shape=(1,) + self.input_shape)
        logits = net(x)
        n_batch = jnp.maximum(jnp.sum(mask), 1.0)
        with numpyro.handlers.scale(scale=count / n_batch), numpyro.handlers.mask(mask=mask > 0):
            numpyro.sample("y", dist.Categorical(logits=logits), obs=y)

    # -- conversions between SVI params and wire posteriors -----------------------------------

    def svi_params(self, posterior: dict) -> dict:
        """Constrained SVI params (guide locs/scales and deterministic leaves) from ``{"params", "scale"}``."""
        flat_loc = traverse_util.flatten_dict(posterior["params"])
        flat_scale = traverse_util.flatten_dict(posterior["scale"])
        # a fresh container: random_flax_module rewrites the entries of the params dict it is given
        out = {f"{NET}$params": jax.tree.map(lambda v: v, posterior["params"])}
        for path, loc in flat_loc.items():
            name = _path_name(path)
            if name in self.variational:
                out[f"{NET}/{name}_auto_loc"] = loc
                out[f"{NET}/{name}_auto_scale"] = flat_scale[path]
        return out

    def posterior(self, svi_params: dict) -> dict:
        """``{"params": loc tree, "scale": scale tree}`` from constrained SVI params."""
        flat = traverse_util.flatten_dict(svi_params[f"{NET}$params"])
        loc, scale = {}, {}
        for path, value in flat.items():
            name = _path_name(path)
            if name in self.variational:
                loc[path] = svi_params[f"{NET}/{name}_auto_loc"]
                scale[path] = svi_params[f"{NET}/{name}_auto_scale"]
            else:
                loc[path], scale[path] = value, jnp.zeros_like(value)
        return {"params": traverse_util.unflatten_dict(loc), "scale": traverse_util.unflatten_dict(scale)}

    def init_posterior(self, key) -> dict:
        """Initial global posterior: loc from the Flax init (Glorot kernels), scale ``init_scale``."""
        params = self.module.init(key, jnp.zeros((1,) + self.input_shape))["params"]
        flat = traverse_util.flatten_dict(params)
        scale = {p: (jnp.full_like(v, self.config.init_scale) if _path_name(p) in self.variational
                     else jnp.zeros_like(v)) for p, v in flat.items()}
        return {"params": params, "scale": traverse_util.unflatten_dict(scale)}

    def predict_proba(self, posterior: dict, x, key, num_samples: int | None = None):
        """MC class probabilities ``[M, T, C]`` of inputs ``x [T, ...]`` under the posterior."""
        m = num_samples or self.config.test_samples
        flat_loc = traverse_util.flatten_dict(posterior["params"])
        flat_scale = traverse_util.flatten_dict(posterior["scale"])

        def one(k):
            keys = jax.random.split(k, len(flat_loc))
            sample = {p: loc + flat_scale[p] * jax.random.normal(kk, loc.shape)
                      for (p, loc), kk in zip(flat_loc.items(), keys)}
            return jax.nn.softmax(self.module.apply({"params": traverse_util.unflatten_dict(sample)}, x), -1)

        return jax.lax.map(one, jax.random.split(key, m))
