"""Mean-field Gaussian variational inference over any Flax model, through NumPyro.

The NumPyro model places a Normal prior on every variational leaf of a Flax
module (``random_flax_module``); the guide (``MeanFieldVI.guide``) holds one
N(loc, scale) per weight (scale stored as softplus^-1, the paper's rho);
``TraceMeanField_ELBO`` uses the analytic Gaussian KL. Gradients of the
expected log-likelihood come from Flipout on every variational dense/conv
kernel by default (``vi.layer_noise``; the spec's recommendation, as Fischer et
al.'s TFP layers), from local reparameterisation (each output unit sampled from
its Gaussian given the input; ``gradient_estimator="local_reparameterization"``)
or from plain reparameterisation (one weight sample shared by the batch) with
``gradient_estimator="reparameterization"``. The likelihood of a
masked mini-batch is scaled by ``count / n_batch``, so one SVI step minimises
``|D_k| * (mean-batch CE) + KL`` = ``|D_k| * (CE + KL / |D_k|)`` (the KL scaled
by 1/|D_k| as the paper's loss; with Adam the constant factor does not change
the steps).

Posteriors cross the wire as a pair of parameter pytrees ``{"params": loc,
"scale": scale}``; deterministic leaves (biases and normalisation layers by
default) carry their value in ``params`` and scale 0. Only
``kernel`` leaves are variational unless ``variational_biases``.

Models with BatchNorm (``models.apply``, e.g. ResNet-20): ``params`` is the
variables dict ``{"params", "batch_stats"}`` as everywhere in the engine; the
running statistics are NumPyro mutable state (``random_flax_module(...,
mutable=["batch_stats"])``) during SVI and deterministic leaves on the wire.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from flax import traverse_util
from numpyro.contrib.module import random_flax_module
from numpyro.distributions import constraints
from numpyro.infer import SVI, TraceMeanField_ELBO

from bfedjax import flat_random
from bfedjax.models.apply import apply_fn_of, has_batch_stats, needs_train_mode
from bfedjax.models.zoo import init_params
from bfedjax.vi.flat_normal import FlatDrawNormal
from bfedjax.vi.layer_noise import flipout_apply, local_reparameterization_apply

NET = "net"
STATE = f"{NET}$state"
GRADIENT_ESTIMATORS = ("flipout", "local_reparameterization", "reparameterization")
INIT_LOCS = ("normal", "he_normal", "model")  # the initial posterior mean of the variational leaves
OPTIMIZERS = ("adam", "sgd")


def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _guide_param(name: str, kind: str) -> str:
    """The guide's param of site ``net/<name>``: ``kind`` ``"loc"`` or ``"scale"``."""
    return f"{NET}/{name}_{kind}"


def _is_variational(path: tuple, variational_biases: bool) -> bool:
    """Kernels always; biases only on option and never those of normalisation layers."""
    if path[-1] == "kernel":
        return True
    return variational_biases and path[-1] == "bias" and not any("Norm" in str(p) for p in path[:-1])


@dataclasses.dataclass(frozen=True)
class MeanFieldConfig:
    """Options of the mean-field variational clients.

    Attributes:
      prior_scale: std of the N(0, prior_scale^2) prior (the paper's variance 100: std 10).
      init_scale: initial posterior std (softplus(-3) ~ 0.0486, TFP's default rho of -3; the spec's
        rho ~ N(-3, 0.1^2) is drawn without its 0.1 jitter: the server state is a function of the initial
        model, without a key).
      init_loc: initial posterior mean of the variational leaves: ``"normal"`` (default, the spec's
        N(0, init_loc_std^2)), ``"he_normal"`` (kernels N(0, 2 / fan_in), truncated as Flax's; variational
        biases 0) or ``"model"`` (the zoo module's own initialiser). Deterministic leaves always keep the
        module's.
      init_loc_std: the std of ``"normal"`` (0.1).
      variational_biases: put a prior and a posterior on dense/conv biases too (default: point
        estimates); normalisation layers stay deterministic.
      train_samples: MC samples of the ELBO (``test_samples``: of the predictive).
      learning_rate: the optimiser's step (the paper's 1e-3, fresh state every round).
      optimizer: ``"adam"`` (default, the spec's D7 reading of "a variant of SGD") or ``"sgd"``, with
        heavy-ball ``momentum`` (0: plain SGD; SGD only).
      gradient_estimator: of the expected log-likelihood: ``"flipout"`` (default: per-example
        sign-flipped kernel noise in every dense and conv layer; variational biases are sampled
        once per pass), ``"local_reparameterization"`` (every dense and conv output unit drawn
        from its Gaussian given the input, per example; no kernel-sized noise; variational biases
        sampled once per pass) or ``"reparameterization"`` (one weight sample shared by the whole
        batch).
    """

    prior_scale: float = 10.0
    init_scale: float = float(np.float32(math.log1p(math.exp(-3.0))))  # softplus(-3) in float32, JAX not started
    init_loc: str = "normal"
    init_loc_std: float = 0.1
    variational_biases: bool = False
    train_samples: int = 1
    test_samples: int = 50  # Fischer et al. spec D9
    learning_rate: float = 1e-3
    gradient_estimator: str = "flipout"
    optimizer: str = "adam"
    momentum: float = 0.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}; choose one of {OPTIMIZERS}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum} must be in [0, 1), e.g. 0.9")
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(f"momentum={self.momentum} is SGD's; fix: optimizer='sgd', or momentum=0 with Adam")
        if self.gradient_estimator not in GRADIENT_ESTIMATORS:
            raise ValueError(f"gradient_estimator={self.gradient_estimator!r}; choose one of {GRADIENT_ESTIMATORS}")
        if self.init_loc not in INIT_LOCS:
            raise ValueError(f"init_loc={self.init_loc!r}; choose one of {INIT_LOCS}")
        if not self.init_loc_std > 0:
            raise ValueError(f"init_loc_std={self.init_loc_std} must be > 0, e.g. 0.1")


class MeanFieldVI:
    """Builds the NumPyro model/guide/SVI for a Flax classifier and converts its state."""

    def __init__(self, module, input_shape: tuple[int, ...], config: MeanFieldConfig = MeanFieldConfig()):
        self.module = module
        self.input_shape = tuple(input_shape)
        self.config = config
        self.stateful = has_batch_stats(module)
        self.train_mode = needs_train_mode(module)
        params = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1,) + self.input_shape)))["params"]
        self._prefix = ("params",) if self.stateful else ()  # where the Flax params sit in the wire tree
        # NumPyro site name (path inside the Flax params) -> path in the wire tree
        flat_params = traverse_util.flatten_dict(params)
        self._sites = {_path_name(path): self._prefix + path for path in flat_params
                       if _is_variational(path, config.variational_biases)}
        # the guide's sites in sorted path order, the model's (JAX flattens dicts by sorted key: eval_shape's params
        # here, and the params SVI hands random_flax_module); the order decides which random key each site draws
        self._site_shapes = {name: flat_params[path[len(self._prefix):]] for name, path in self._sites.items()}
        self.variational = frozenset(_path_name(p) for p in self._sites.values())
        """Dotted paths of the variational leaves in the wire (engine) tree."""
        # the learning rate is a hyper-parameter in the optimiser state, so a round can set it (traced)
        optimizer = (optax.inject_hyperparams(optax.adam)(config.learning_rate) if config.optimizer == "adam" else
                     optax.inject_hyperparams(optax.sgd)(config.learning_rate, momentum=config.momentum or None))
        self.svi = SVI(self.numpyro_model, self.guide, optimizer, TraceMeanField_ELBO(num_particles=config.train_samples))

    # -- the probabilistic model ------------------------------------------------------------

    def guide(self, *args, kl_weight=None, **kwargs):
        """The mean-field Gaussian guide: at the model's sample site of each variational leaf
        (``net/<dotted path>``, one event shaped as the leaf) a ``Normal(loc, scale)`` with params
        ``<site>_loc`` and ``<site>_scale`` (positive through softplus: stored as the paper's rho).

        The same guide as NumPyro's ``AutoNormal`` over this model (whose sites are all unconstrained,
        unplated Normals), written out: ``AutoNormal`` sets itself up on its first call by finding
        initial values valid for the model's potential energy and its gradient (a forward and backward
        pass of the network), 5.7 of the 15.6 s of a first trace of a variational ResNet-20 round under cProfile
        (``results/bench/session15_cpu_trace/profile.txt``),
        for values ``init_svi_state`` always replaces. The model's ``args`` are unused; returns ``None``
        (SVI reads the trace).
        ``kl_weight`` (``[]``, may be traced, > 0) multiplies the ELBO's KL term
        (``TraceMeanField_ELBO`` scales each latent site's analytic KL by the guide site's scale);
        ``None``: the KL as is.
        """
        del args, kwargs
        with contextlib.ExitStack() as stack:
            if kl_weight is not None:
                stack.enter_context(numpyro.handlers.scale(scale=kl_weight))
            for name, leaf in self._site_shapes.items():
                # initial values built only where no params are given (init_svi_state always gives them)
                loc = numpyro.param(_guide_param(name, "loc"), lambda _, leaf=leaf: jnp.zeros(leaf.shape, leaf.dtype))
                scale = numpyro.param(_guide_param(name, "scale"),
                                      lambda _, leaf=leaf: jnp.full(leaf.shape, self.config.init_scale, leaf.dtype),
                                      constraint=constraints.softplus_positive)
                numpyro.sample(f"{NET}/{name}", FlatDrawNormal(loc, scale).to_event(leaf.ndim))  # one event, as the prior

    def numpyro_model(self, x, y, mask, count, prior_loc=None, prior_scale=None, kl_weight=None):
        """x ``[B, ...]``, y ``[B]``, mask ``[B]``, count ``[]``; optional prior pytrees (global posterior).

        ``kl_weight`` is the guide's (``guide``); the model ignores it.
        """
        del kl_weight

        if prior_loc is None:
            prior = {name: dist.Normal(0.0, self.config.prior_scale) for name in self._sites}
        else:
            flat_loc, flat_scale = traverse_util.flatten_dict(prior_loc), traverse_util.flatten_dict(prior_scale)
            prior = {name: dist.Normal(flat_loc[path], flat_scale[path]) for name, path in self._sites.items()}
        net = random_flax_module(NET, self.module, prior=prior, input_shape=(1,) + self.input_shape,
                                 mutable=["batch_stats"] if self.stateful else None)
        if self.config.gradient_estimator != "reparameterization":
            net = self._kernel_noise(net)
        logits = net(x, train=True, mask=mask) if self.train_mode else net(x)
        n_batch = jnp.maximum(jnp.sum(mask), 1.0)
        with numpyro.handlers.scale(scale=count / n_batch), numpyro.handlers.mask(mask=mask > 0):
            numpyro.sample("y", dist.Categorical(logits=logits), obs=y)

    def _kernel_noise(self, net):
        """``net`` (from ``random_flax_module``: one weight sample per variational leaf) with Flipout or
        local reparameterisation on its variational kernels (``vi.layer_noise``).

        The kernels are swapped for their guide means. Flipout: each sampled kernel
        minus its mean is the layer's shared noise ``sigma * eps`` (no gradient to the
        mean through it), applied with per-example sign flips. Local
        reparameterisation: the guide's scale ``sigma`` gives each output unit's
        variance, and the kernel samples go unused (XLA drops them). Biases keep their
        sample. Run without the guide's params (the model alone, outside SVI), ``net`` is
        returned as is.
        """
        flipout = self.config.gradient_estimator == "flipout"
        sampled = traverse_util.flatten_dict(net.args[0])
        per_layer = {}
        for name, wire_path in self._sites.items():
            path = wire_path[len(self._prefix):]  # inside the Flax params
            if path[-1] != "kernel":
                continue
            mean = numpyro.param(_guide_param(name, "loc"))
            if mean is None:
                return net
            per_layer[path[:-1]] = (sampled[path] - mean) if flipout else numpyro.param(_guide_param(name, "scale"))
            sampled[path] = mean
        key = numpyro.prng_key()
        if key is None:
            return net
        means = traverse_util.unflatten_dict(sampled)
        apply = flipout_apply if flipout else local_reparameterization_apply
        return functools.partial(apply, functools.partial(net.func, means, **net.keywords), per_layer, key)

    # -- conversions between SVI params and wire posteriors -----------------------------------

    def svi_params(self, posterior: dict) -> dict:
        """Constrained SVI params (guide locs/scales and deterministic leaves) from ``{"params", "scale"}``.

        For a model with BatchNorm the dict also holds the mutable running
        statistics under ``STATE``; ``SVI.init(..., init_params=...)`` substitutes them.
        """
        flax_params = posterior["params"]["params"] if self.stateful else posterior["params"]
        flat_loc = traverse_util.flatten_dict(posterior["params"])
        flat_scale = traverse_util.flatten_dict(posterior["scale"])
        # a fresh container: random_flax_module rewrites the entries of the params dict it is given
        out = {f"{NET}$params": jax.tree.map(lambda v: v, flax_params)}
        for name, path in self._sites.items():
            out[_guide_param(name, "loc")] = flat_loc[path]
            out[_guide_param(name, "scale")] = flat_scale[path]
        if self.stateful:
            out[STATE] = {"batch_stats": posterior["params"]["batch_stats"]}
        return out

    def posterior(self, svi_params: dict, mutable_state: dict | None = None) -> dict:
        """``{"params": loc tree, "scale": scale tree}`` from constrained SVI params (and SVI mutable state)."""
        flat = traverse_util.flatten_dict(svi_params[f"{NET}$params"])
        loc, scale = {}, {}
        for path, value in flat.items():
            name = _path_name(path)
            if name in self._sites:
                loc[path] = svi_params[_guide_param(name, "loc")]
                scale[path] = svi_params[_guide_param(name, "scale")]
            else:
                loc[path], scale[path] = value, jnp.zeros_like(value)
        loc, scale = traverse_util.unflatten_dict(loc), traverse_util.unflatten_dict(scale)
        if not self.stateful:
            return {"params": loc, "scale": scale}
        stats = (mutable_state or svi_params)[STATE]["batch_stats"]
        return {"params": {"params": loc, "batch_stats": stats},
                "scale": {"params": scale, "batch_stats": jax.tree.map(jnp.zeros_like, stats)}}

    def init_params(self, key) -> dict:
        """Initial model (wire tree): the module's Flax init, with the variational leaves drawn as
        ``config.init_loc`` says (``"model"``: the module's init from ``key`` itself, as before spec D4
        was followed, so its runs repeat the earlier ones)."""
        if self.config.init_loc == "model":
            return init_params(self.module, self.input_shape, key)
        module_key, loc_key = jax.random.split(key)
        params = init_params(self.module, self.input_shape, module_key)
        flat = traverse_util.flatten_dict(params)
        normal, he_normal = jax.nn.initializers.normal(self.config.init_loc_std), jax.nn.initializers.he_normal()
        for i, (path, value) in enumerate(sorted(flat.items())):
            if _path_name(path) not in self.variational:
                continue
            if self.config.init_loc == "normal":
                flat[path] = normal(jax.random.fold_in(loc_key, i), value.shape, value.dtype)
            else:  # he_normal needs a fan-in: kernels; variational biases start at 0, as He et al.'s
                flat[path] = (he_normal(jax.random.fold_in(loc_key, i), value.shape, value.dtype)
                              if value.ndim >= 2 else jnp.zeros_like(value))
        return traverse_util.unflatten_dict(flat)

    def init_posterior(self, key) -> dict:
        """Initial global posterior: loc ``init_params(key)``, scale ``init_scale`` on the variational leaves."""
        return self.posterior_from_params(self.init_params(key))

    def posterior_from_params(self, params) -> dict:
        """A posterior centred on ``params`` (wire tree): ``init_scale`` on variational leaves, 0 elsewhere."""
        flat = traverse_util.flatten_dict(params)
        scale = {p: (jnp.full_like(v, self.config.init_scale) if _path_name(p) in self.variational
                     else jnp.zeros_like(v)) for p, v in flat.items()}
        return {"params": params, "scale": traverse_util.unflatten_dict(scale)}

    def init_svi_state(self, key, x, y, count, posterior: dict, *prior, kl_weight=None):
        """SVI state of a client starting from ``posterior`` (wire form), fitted to batches like ``x [B, ...]``.

        ``x``, ``y`` only fix shapes. BatchNorm statistics start from the
        posterior's (the init trace's own update of them is discarded). ``kl_weight``: as ``guide``'s;
        give it here when the steps (``svi.update``) give it.
        """
        state = self.svi.init(key, x, y, jnp.ones(y.shape[0]), count, *prior, kl_weight=kl_weight,
                              init_params=self.svi_params(posterior))
        if self.stateful:
            state = state._replace(mutable_state={STATE: {"batch_stats": posterior["params"]["batch_stats"]}})
        return state

    @staticmethod
    def with_learning_rate(state, learning_rate):
        """``state`` (an ``SVIState``) with the optimiser's learning rate set to ``learning_rate`` (may be traced)."""
        step, (params, opt) = state.optim_state
        opt = opt._replace(hyperparams={**opt.hyperparams, "learning_rate": jnp.asarray(learning_rate, jnp.float32)})
        return state._replace(optim_state=(step, (params, opt)))

    def predict_proba(self, posterior: dict, x, key, num_samples: int | None = None):
        """MC class probabilities ``[M, T, C]`` of inputs ``x [T, ...]`` under the posterior."""
        m = num_samples or self.config.test_samples
        flat_loc = traverse_util.flatten_dict(posterior["params"])
        flat_scale = traverse_util.flatten_dict(posterior["scale"])
        apply = apply_fn_of(self.module)

        def one(k):
            keys = jax.random.split(k, len(flat_loc))
            sample = {p: loc + flat_scale[p] * flat_random.normal(kk, loc.shape)
                      for (p, loc), kk in zip(flat_loc.items(), keys)}
            return jax.nn.softmax(apply(traverse_util.unflatten_dict(sample), x), -1)

        return jax.lax.map(one, jax.random.split(key, m))
