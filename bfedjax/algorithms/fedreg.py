"""FedReg (Xu et al., ICLR 2022): local training regularised against forgetting.

FedAvg's server (a mean of the cohort's weights) with a different local step.
Each sampled client first builds, from its data and the received global model
``theta_g`` only (spec Eqs. 2-3),

* pseudo data: ``E`` sign-gradient *ascent* steps of size ``eta_s`` on the
  true-label cross-entropy, labelled with ``theta_g``'s softmax;
* perturbed data: the same with ``eta_p`` (default ``0.01 eta_s``), true labels;

then every local step (Eq. 11) is

    g      = grad CE(batch) at theta_gamma = gamma theta + (1 - gamma) theta_g
    theta -= lr * g                         (MG: g minus its projection on the
                                             uniform-label pseudo-data gradient, Eq. 12)
    g_s, g_p = gradients on the pseudo / perturbed batch at (theta + theta_g) / 2
    w_s = max(<d, g_s> / <g_s, g_s>, 0),  d = theta - theta_g
    w_p = max((<d, g_p> - w_s <g_s, g_p>) / <g_p, g_p>, 0)
    theta -= w_s g_s + w_p g_p              (Eq. 10: two half-space projections)

with every dot product over all parameters flattened together. Pseudo data
are generated once per round per client inside the round step
(``granularity="per_batch"``: one pseudo and one perturbed batch per
mini-batch of a shuffled pass, used cyclically by step index, as the
authors' code; ``"full_set"``: one batch of the whole client;
``"per_step"``: regenerated from each real batch).

Client metrics (averaged over the cohort's real clients each round):
``ws_active`` and ``wp_active``, the share of a client's local steps whose
first / second projection was active (w_s > 0, w_p > 0).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from bfedjax.algorithms.fedavg import mean_from_stats, params_server_init, params_stats
from bfedjax.core.batching import epoch_permutation, steps_per_epoch, take_batch
from bfedjax.core.types import Algorithm, Batch, ClientContext
from bfedjax.losses import cross_entropy, masked_mean_cross_entropy, soft_cross_entropy
from bfedjax.models.apply import apply_fn_of, needs_train_mode
from bfedjax.tasks import classification
from bfedjax.tree import tree_dot

GRANULARITIES = ("per_batch", "full_set", "per_step")
CLAMPS = ("batch_range", "valid_range", "none")
DENOMINATOR_GUARD = 1e-30  # authors' code: added to every projection denominator


def clamp_bounds(x, mask, clamp: str, valid_range=(0.0, 1.0)):
    """``(lo, hi)`` of the generation clamp for one batch ``x [B, ...]`` (``None`` for ``"none"``).

    ``"batch_range"``: the scalar [min, max] of the batch's real rows (authors'
    paper-era code); ``"valid_range"``: ``valid_range``.
    """
    if clamp not in CLAMPS:
        raise ValueError(f"clamp={clamp!r}; choose one of {CLAMPS}")
    if clamp == "none":
        return None
    if clamp == "valid_range":
        return jnp.asarray(valid_range[0], x.dtype), jnp.asarray(valid_range[1], x.dtype)
    real = mask.reshape((-1,) + (1,) * (x.ndim - 1)) > 0
    return jnp.min(jnp.where(real, x, jnp.inf)), jnp.max(jnp.where(real, x, -jnp.inf))


def sign_ascent(apply_fn, params, x, y, *, eta, steps: int, bounds=None) -> jax.Array:
    """``steps`` iterations of ``x <- clip(x + eta * sign(grad_x CE(params; x, y)), *bounds)`` (I-FGSM ascent).

    Args:
      x: ``[B, ...]`` inputs; y: ``[B]`` int labels.
      eta: scalar or per-row ``[B]`` step sizes.
      bounds: ``(lo, hi)`` scalars or arrays broadcastable to ``x`` (``clamp_bounds``), or None.
    Returns:
      ``[B, ...]`` generated inputs (``eta = 0`` returns ``x``). Each row's loss
      depends on that row only, so the sign of the batch-mean gradient is the
      sign of each row's own gradient and rows of different batches can share
      one call.
    """
    eta = jnp.asarray(eta, x.dtype)
    eta = eta.reshape(eta.shape + (1,) * (x.ndim - eta.ndim)) if eta.ndim else eta
    total_loss = lambda inputs: jnp.sum(cross_entropy(apply_fn(params, inputs), y))

    def step(_, inputs):
        inputs = inputs + eta * jnp.sign(jax.grad(total_loss)(inputs))
        return inputs if bounds is None else jnp.clip(inputs, *bounds)

    return jax.lax.fori_loop(0, steps, step, x)


def project_update(params, theta_g, g_s, g_p, *, equality: bool = False, per_layer: bool = False):
    """Eq. 10: the two half-space projections of the local weights.

    With ``d = params - theta_g``: ``w_s = max(<d, g_s> / <g_s, g_s>, 0)``,
    ``w_p = max((<d, g_p> - w_s <g_s, g_p>) / <g_p, g_p>, 0)`` (no ``max`` with
    ``equality``), dot products over all leaves flattened together (``per_layer``:
    within each leaf, one ``w_s``, ``w_p`` per leaf; the spec's ablation, not in the
    paper), and the authors' 1e-30 in each denominator.
    Returns ``(params - w_s g_s - w_p g_p, w_s, w_p)``; ``per_layer`` returns the largest
    ``w_s``, ``w_p`` over the leaves.
    """
    clip = (lambda value: value) if equality else (lambda value: jnp.maximum(value, 0.0))

    def weights(d, s, p, dot):
        ws = clip(dot(d, s) / (dot(s, s) + DENOMINATOR_GUARD))
        return ws, clip((dot(d, p) - ws * dot(s, p)) / (dot(p, p) + DENOMINATOR_GUARD))

    d = jax.tree.map(jnp.subtract, params, theta_g)
    if not per_layer:
        ws, wp = weights(d, g_s, g_p, tree_dot)
        return jax.tree.map(lambda t, s, p: t - ws * s - wp * p, params, g_s, g_p), ws, wp
    leaf_dot = lambda a, b: jnp.vdot(a, b)
    ws_tree = jax.tree.map(lambda dl, s, p: weights(dl, s, p, leaf_dot)[0], d, g_s, g_p)
    wp_tree = jax.tree.map(lambda dl, s, p: weights(dl, s, p, leaf_dot)[1], d, g_s, g_p)
    out = jax.tree.map(lambda t, s, p, ws, wp: t - ws * s - wp * p, params, g_s, g_p, ws_tree, wp_tree)
    largest = lambda tree: jnp.max(jnp.stack(jax.tree.leaves(tree)))
    return out, largest(ws_tree), largest(wp_tree)


def remove_component(grad, direction):
    """Eq. 12: ``grad - v direction`` with ``v = <grad, direction> / <direction, direction>`` (unclamped)."""
    v = tree_dot(grad, direction) / (tree_dot(direction, direction) + DENOMINATOR_GUARD)
    return jax.tree.map(lambda g, u: g - v * u, grad, direction)


class RegularisationData(NamedTuple):
    """Per-client pseudo and perturbed batches ``[nb, B, ...]`` (``nb`` batch slots).

    pseudo_x, perturbed_x: inputs; pseudo_y: ``[nb, B, K]`` soft labels;
    perturbed_y: ``[nb, B]`` true labels; mask: ``[nb, B]``; num_batches: ``[]``
    real batches, used cyclically by step index.
    """

    pseudo_x: jax.Array
    pseudo_y: jax.Array
    perturbed_x: jax.Array
    perturbed_y: jax.Array
    mask: jax.Array
    num_batches: jax.Array


class FedRegState(NamedTuple):
    """params: local weights; reg: ``RegularisationData`` (``()`` for ``per_step``);
    steps: ``[]`` real steps; ws_active, wp_active: ``[]`` steps where w_s, w_p > 0."""

    params: object
    reg: object
    steps: jax.Array
    ws_active: jax.Array
    wp_active: jax.Array


def fedreg(model, *, lr: float = 0.1, gamma: float = 0.5, eta_s: float = 0.05, eta_p: float | None = None,
           generation_steps: int = 10, local_epochs: int = 1, batch_size: int = 32,
           granularity: str = "per_batch", clamp: str = "batch_range", valid_range=(0.0, 1.0),
           projections: bool = True, equality: bool = False, hard_pseudo: bool = False,
           pseudo_temperature: float = 1.0, per_layer: bool = False, mg: bool = False) -> Algorithm:
    """FedReg (and FedReg with MG, ``mg=True``) as an ``Algorithm``.

    Args:
      model: a Flax module without BatchNorm or dropout (the paper's models use
        GroupNorm or no normalisation).
      lr, gamma, eta_s, eta_p: traced hyper-parameters (``eta_p`` defaults to
        ``0.01 * eta_s``); ``gamma = 1`` with ``projections=False`` is FedAvg.
      generation_steps: E (the paper fixes 10).
      granularity: what one pseudo / perturbed batch is generated from (``GRANULARITIES``).
      clamp: the range generated inputs are clipped to (``CLAMPS``, ``clamp_bounds``).
      projections: False skips Eq. 10 (ablation / the FedAvg identity).
      equality: constraints as equalities (w_s, w_p may be negative).
      hard_pseudo: argmax pseudo labels instead of the softmax.
      pseudo_temperature: tau of the pseudo labels ``softmax(logits / tau)`` (the paper: 1).
      per_layer: Eq. 10 within each parameter leaf (``project_update``; an ablation, not the paper's).
      mg: FedReg with MG (Eq. 12): each step's gradient loses its component
        along the gradient of this batch's pseudo inputs with uniform labels
        (regenerated from the real batch every step; v unclamped).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; choose one of {GRANULARITIES}")
    if clamp not in CLAMPS:
        raise ValueError(f"clamp={clamp!r}; choose one of {CLAMPS}")
    if not pseudo_temperature > 0:
        raise ValueError(f"pseudo_temperature={pseudo_temperature} must be > 0 (1: the paper's softmax)")
    if needs_train_mode(model):
        raise ValueError("fedreg needs a model without BatchNorm or dropout (the paper's use GroupNorm or "
                         "none); fix: pick e.g. --model=fedreg_cnn or mlp with dropout_rate=0")
    apply_fn = apply_fn_of(model)

    def eta_p_of(hp):
        return hp["eta_p"] if eta_p is not None else 0.01 * hp["eta_s"]

    def generate(params, x, y, bounds, hp):
        """(pseudo x, soft labels, perturbed x) of real rows ``x [R, ...]`` from the global model.

        Both ascents run as one batch of ``2R`` rows with per-row step sizes.
        """
        rows = x.shape[0]
        eta = jnp.concatenate([jnp.full((rows,), hp["eta_s"]), jnp.full((rows,), eta_p_of(hp))])
        both_bounds = None if bounds is None else tuple(jnp.concatenate([b, b]) if jnp.ndim(b) else b
                                                         for b in bounds)
        both = sign_ascent(apply_fn, params, jnp.concatenate([x, x]), jnp.concatenate([y, y]), eta=eta,
                           steps=generation_steps, bounds=both_bounds)
        pseudo_x, perturbed_x = both[:rows], both[rows:]
        probs = jax.nn.softmax(apply_fn(params, pseudo_x) / pseudo_temperature)
        if hard_pseudo:
            probs = jax.nn.one_hot(jnp.argmax(probs, -1), probs.shape[-1])
        return pseudo_x, jax.lax.stop_gradient(probs), perturbed_x

    def row_bounds(batches: Batch):
        """Per-row clamp bounds ``[nb*B, 1, ...]`` of batches ``[nb, B, ...]`` (or scalars / None)."""
        if clamp != "batch_range":
            return clamp_bounds(batches.x[0], batches.mask[0], clamp, valid_range)
        per_batch = jax.vmap(lambda x, m: clamp_bounds(x, m, clamp, valid_range))(batches.x, batches.mask)
        b = batches.x.shape[1]
        shape = (-1,) + (1,) * (batches.x.ndim - 2)
        return tuple(jnp.repeat(v, b).reshape(shape) for v in per_batch)

    def client_init(ctx: ClientContext, key) -> FedRegState:
        zero = jnp.zeros((), jnp.int32)
        if granularity == "per_step":
            return FedRegState(ctx.server["params"], (), zero, zero, zero)
        data, max_n = ctx.data, ctx.data.y.shape[0]
        gen_batch = max_n if granularity == "full_set" else batch_size
        order = epoch_permutation(key, data.count, max_n, 0)
        slots = jnp.arange(steps_per_epoch(max_n, gen_batch))
        batches = jax.vmap(lambda j: take_batch(data, order, j, gen_batch))(slots)  # leaves [nb, B, ...]
        flat = lambda a: a.reshape((-1,) + a.shape[2:])
        unflat = lambda a: a.reshape(batches.y.shape + a.shape[1:])
        pseudo_x, pseudo_y, perturbed_x = map(unflat, generate(ctx.server["params"], flat(batches.x),
                                                               flat(batches.y), row_bounds(batches), ctx.hparams))
        num_batches = jnp.maximum((data.count + gen_batch - 1) // gen_batch, 1)
        reg = RegularisationData(pseudo_x, pseudo_y, perturbed_x, batches.y, batches.mask, num_batches)
        return FedRegState(ctx.server["params"], reg, zero, zero, zero)

    def regularisation_batches(local: FedRegState, batch: Batch, ctx):
        """(pseudo Batch with soft labels, perturbed Batch) for this step."""
        if granularity == "per_step":
            bounds = clamp_bounds(batch.x, batch.mask, clamp, valid_range)
            pseudo_x, pseudo_y, perturbed_x = generate(ctx.server["params"], batch.x, batch.y, bounds, ctx.hparams)
            return (pseudo_x, pseudo_y, batch.mask), Batch(perturbed_x, batch.y, batch.mask)
        reg = local.reg
        k = local.steps % reg.num_batches
        return (reg.pseudo_x[k], reg.pseudo_y[k], reg.mask[k]), Batch(reg.perturbed_x[k], reg.perturbed_y[k], reg.mask[k])

    def ce_grad(params, batch: Batch):
        """Hard-label batch-mean cross-entropy gradient (the same loss as FedAvg's step)."""
        return jax.grad(masked_mean_cross_entropy, argnums=1)(apply_fn, params, batch)

    def soft_grad(params, x, targets, mask):
        return jax.grad(lambda p: soft_cross_entropy(apply_fn(p, x), targets, mask))(params)

    def mg_gradient(grad, theta_gamma, batch: Batch, ctx):
        """Eq. 12: ``g - v g'`` with ``g'`` the uniform-label pseudo-data gradient at theta_gamma."""
        pseudo_x = sign_ascent(apply_fn, ctx.server["params"], batch.x, batch.y, eta=ctx.hparams["eta_s"],
                               steps=generation_steps, bounds=clamp_bounds(batch.x, batch.mask, clamp, valid_range))
        k = jax.eval_shape(apply_fn, theta_gamma, batch.x[:1]).shape[-1]  # number of classes
        uniform = jnp.full((batch.y.shape[0], k), 1.0 / k)
        return remove_component(grad, soft_grad(theta_gamma, pseudo_x, uniform, batch.mask))

    def client_step(local: FedRegState, batch: Batch, ctx: ClientContext, key) -> FedRegState:
        del key
        theta_g, hp = ctx.server["params"], ctx.hparams
        gamma_ = hp["gamma"]
        theta_gamma = jax.tree.map(lambda t, g: gamma_ * t + (1.0 - gamma_) * g, local.params, theta_g)
        grad = ce_grad(theta_gamma, batch)
        if mg:
            grad = mg_gradient(grad, theta_gamma, batch, ctx)
        params = jax.tree.map(lambda t, g: t - hp["lr"] * g, local.params, grad)
        ws_on, wp_on = local.ws_active, local.wp_active
        if projections:
            params, ws, wp = project(params, theta_g, *regularisation_batches(local, batch, ctx))
            ws_on, wp_on = ws_on + (ws > 0), wp_on + (wp > 0)
        return FedRegState(params, local.reg, local.steps + 1, ws_on.astype(jnp.int32), wp_on.astype(jnp.int32))

    def project(params, theta_g, pseudo, perturbed: Batch):
        """Eq. 10 with both gradients at the midpoint; returns ``(theta*, w_s, w_p)``."""
        midpoint = jax.tree.map(lambda t, g: 0.5 * (t + g), params, theta_g)
        return project_update(params, theta_g, soft_grad(midpoint, *pseudo), ce_grad(midpoint, perturbed),
                              equality=equality, per_layer=per_layer)

    def client_final(local: FedRegState, ctx):
        del ctx
        steps = jnp.maximum(local.steps, 1).astype(jnp.float32)
        return {"params": local.params}, (), {"ws_active": local.ws_active / steps, "wp_active": local.wp_active / steps}

    hparams = {"lr": lr, "gamma": gamma, "eta_s": eta_s}
    if eta_p is not None:
        hparams["eta_p"] = eta_p
    return Algorithm(
        name="fedreg_mg" if mg else "fedreg", server_init=params_server_init, client_init=client_init,
        client_step=client_step, client_final=client_final, client_stats=params_stats,
        server_from_stats=mean_from_stats, hparams=hparams, local_epochs=local_epochs, batch_size=batch_size,
        **classification(model).hooks())
