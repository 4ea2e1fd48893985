"""FedRef (Yoon and Choi, 2025): FedAvg plus one server-side step toward a reference model.

The server aggregates the clients into ``A_r`` (FedAvg, Eq. 1), keeps the last
``p`` aggregates in a ring buffer and forms the reference model
``R_r = (1/p) sum_{j<p} A_{r-j}`` (Eq. 14), then corrects ``A_r`` with one step
on the MAP objective of Eq. 12 and broadcasts the result. Eq. 12's data term
is a sum of reported scalars (no gradient) and the authors' code applies a
per-tensor scalar shift instead, so the correction has variants (spec 2.4;
``eta`` is ``server_lr``, by default the client learning rate as in the code):

* ``code`` (the authors' code): per tensor l,
  ``theta_l = A_l - eta * (s + lam ||A_l - A_{r-1,l}||_2 + lam ||dR_l||_2)`` with
  ``s = (sum_k F_k,r - sum_k F_k,r-1) / K`` from the clients' reported losses and
  ``dR_l = R_l - R_{r-1,l}``; ``fix_ref_delta=False`` keeps the code's bug
  ``dR_l = R_l - sum_axis0(R_{r-1,l}) / p`` (PyTorch's axis 0 is the output axis,
  Flax's last axis, which is what is summed here).
* ``l2`` (the literal gradient of Eq. 12 with theta1_0 = A_{r-1}, theta2_0 = R_{r-1}):
  ``theta = A - 2 eta lam (A - A_{r-1})``; ``ref_through_A`` adds ``(1/p)(R - R_{r-1})``.
* ``map_step`` / ``map_prox`` (Eq. 11 with the prior ``-lam ||theta - R||^2`` and the
  clients summarised by ``(1/2eta)||theta - A||^2``): one gradient step
  ``A - 2 eta lam (A - R)``, or the exact minimiser ``(A + 2 eta lam R) / (1 + 2 eta lam)``.

Rounds ``1..warmup`` (default ``p + 1``, as the code) broadcast ``A_r``. The
ring buffer holds the uncorrected aggregates (``reference="mean"``), or the last
``p + 1`` of them (``"p_plus_one"``, Eq. 13), or the corrected broadcasts
(``"broadcast"``); ``"weighted"`` is the authors' later commits: the aggregates in
the buffer weighted by static weights ``1..p`` over the buffer's slots, so the
aggregate of round ``j`` weighs ``1 + (j mod p)`` (``reference_weights``).

The later commits also split lambda: ``lam`` (lambda_1) weighs the aggregate's own
change and ``lam_ref`` (lambda_2, default ``lam``) the reference term of every variant
(``code``'s ``||dR||``, ``l2``'s ``ref_through_A`` term, the ``map`` pull), and grow
lambda_2 by ``lam_ref_growth`` every ``lam_ref_every`` rounds up to ``lam_ref_cap``
(``ref_lambda_at``; the authors: 10, 10 and 0.005). Clients report their loss after training as the code does
(``loss_report="code"``: the mean over their own minibatches of the batch-mean
loss of the trained model) or as the paper says (``"last_batch"``: the loss of
their last training batch). ``p`` is static; ``lam`` and ``eta`` are traced
(``hparams["ref_lambda"]``, ``hparams["ref_lr"]``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from bfedjax.algorithms.fedavg import fedavg
from bfedjax.core.types import Algorithm, Batch
from bfedjax.metrics.classification import padded_batches
from bfedjax.tasks import classification

VARIANTS = ("code", "l2", "map_step", "map_prox")
REFERENCES = ("mean", "p_plus_one", "broadcast", "weighted")
LOSS_REPORTS = ("code", "last_batch")
LOSS_TERMS = ("code", "weighted_sum")
STATE_KEY = "fedref"


def mean_batch_loss(loss_fn, params, x, y, count, batch_size: int) -> jax.Array:
    """Mean over a client's minibatches of the batch-mean loss (the FedRef code's reported loss).

    ``x [max_n, ...]``, ``y [max_n, ...]``, rows ``< count`` real, taken in order in
    batches of ``batch_size``; ``loss_fn(params, Batch) -> scalar`` is the masked mean.
    """
    xb, yb, mb = padded_batches(x, y, batch_size)
    mb = mb * (jnp.arange(mb.size).reshape(mb.shape) < count)
    losses = jax.lax.map(lambda b: loss_fn(params, Batch(*b)), (xb, yb, mb))
    real = jnp.sum(mb, axis=1) > 0
    return jnp.sum(jnp.where(real, losses, 0.0)) / jnp.maximum(jnp.sum(real), 1)


def code_shift(agg, prev_agg, ref, prev_ref, s, lam, lam_ref, eta, bug_divisor: float, fix_ref_delta: bool):
    """The authors' per-tensor scalar shift: ``A_l - eta (s + lam ||dA_l|| + lam_ref ||dR_l||)`` for every leaf.

    ``fix_ref_delta=False`` takes the code's ``dR_l = R_l - sum_axis(R_{r-1,l}) / bug_divisor``
    (``p`` for the uniform reference; 1 for the later commits' weighted one).
    """
    def leaf(a, a_prev, r, r_prev):
        d_ref = r - r_prev if fix_ref_delta else r - jnp.sum(r_prev, axis=-1, keepdims=True) / bug_divisor
        return a - eta * (s + lam * jnp.linalg.norm((a - a_prev).ravel())
                          + lam_ref * jnp.linalg.norm(d_ref.ravel()))
    return jax.tree.map(leaf, agg, prev_agg, ref, prev_ref)


def layer_shifts(correction, step):
    """``(largest, relative)`` from the pytrees ``correction = theta_r - A_r`` and ``step = A_r - A_{r-1}``: the
    largest per-tensor shift ``max_l mean|correction_l|`` (the ``code`` variant's scalar
    ``eta (s + lam ||dA_l|| + lam_ref ||dR_l||)`` of each tensor, whose entries all move alike) and, over the
    tensors, the largest ratio of a tensor's shift to the RMS entry of its ``step_l`` (``fedref_correction``'s
    denominator, tensor by tensor; it holds the round's FedAvg step plus the previous round's shift; a tensor
    that did not change counts 0)."""
    shift = [jnp.mean(jnp.abs(c)) for c in jax.tree.leaves(correction)]
    rms = [jnp.sqrt(jnp.mean(jnp.square(d))) for d in jax.tree.leaves(step)]
    relative = [jnp.where(d > 0, m / jnp.where(d > 0, d, 1.0), 0.0) for m, d in zip(shift, rms)]
    return jnp.max(jnp.stack(shift)), jnp.max(jnp.stack(relative))


def corrected(variant: str, agg, prev_agg, ref, prev_ref, s, lam, lam_ref, eta, ref_share, bug_divisor: float,
              fix_ref_delta: bool, ref_through_A: bool):
    """``theta_r`` of one variant from ``A_r``, ``A_{r-1}``, ``R_r``, ``R_{r-1}`` (pytrees) and scalars.

    ``lam`` weighs the aggregate's change, ``lam_ref`` the reference term; ``ref_share`` is ``A_r``'s
    weight in ``R_r`` (``dR_r / dA_r``, ``1/p`` for a full uniform buffer: ``l2`` with ``ref_through_A``).
    """
    rho, rho_ref = 2.0 * eta * lam, 2.0 * eta * lam_ref
    if variant == "code":
        return code_shift(agg, prev_agg, ref, prev_ref, s, lam, lam_ref, eta, bug_divisor, fix_ref_delta)
    if variant == "l2":
        extra = (lambda r, rp: rho_ref * ref_share * (r - rp)) if ref_through_A else (lambda r, rp: 0.0)
        return jax.tree.map(lambda a, ap, r, rp: a - rho * (a - ap) - extra(r, rp), agg, prev_agg, ref, prev_ref)
    if variant == "map_step":
        return jax.tree.map(lambda a, r: a - rho_ref * (a - r), agg, ref)
    return jax.tree.map(lambda a, r: (a + rho_ref * r) / (1.0 + rho_ref), agg, ref)


def reference_weights(reference: str, slots: int, filled) -> jax.Array:
    """``[slots]`` weights of the ring buffer's slots in ``R_r`` (summing to 1 over the ``filled`` ones).

    Uniform, except ``"weighted"`` (the authors' later commits): slot ``q`` weighs ``1 + ((q + 1) mod slots)``,
    the code's static weights ``1..p`` over its queue's slots (its first push lands in slot 1 and
    ours in slot 0), so round ``j``'s aggregate weighs ``1 + (j mod p)``.
    """
    slot = jnp.arange(slots)
    raw = 1.0 + (slot + 1) % slots if reference == "weighted" else jnp.ones(slots)
    raw = jnp.where(slot < filled, raw, 0.0).astype(jnp.float32)
    return raw / jnp.sum(raw)


def ref_lambda_at(lam_ref, round_, growth: float, every: int, cap: float | None):
    """lambda_2 in 1-based round ``round_``, as the authors' code updates it in place: at the start of every
    ``every``-th round ``lambda_2 <- min(lambda_2 * growth, cap)``. After ``k = floor(round_ / every)`` steps
    that is ``min(lam_ref * growth^k, cap * min(1, growth^(k-1)))`` (``lam_ref`` for ``k = 0``), so a
    ``lam_ref`` above the cap holds until round ``every``. The power is clipped below float32's overflow."""
    if growth == 1.0:
        return lam_ref
    k = (round_ // every).astype(jnp.float32)
    limit = math.floor(math.log(float(jnp.finfo(jnp.float32).max)) / abs(math.log(growth))) - 1.0
    power = lambda e: jnp.float32(growth) ** jnp.clip(e, -limit, limit)
    grown = lam_ref * power(k)
    if cap is not None:
        grown = jnp.minimum(grown, cap * jnp.minimum(1.0, power(k - 1.0)))
    return jnp.where(k < 1, lam_ref, grown)


def with_reference_model(algorithm: Algorithm, *, loss_fn, variant: str = "code", lam: float = 0.01, p: int = 5,
                         server_lr: float | None = None, fix_ref_delta: bool = True, ref_through_A: bool = False,
                         reference: str = "mean", warmup: int | None = None, loss_report: str = "code",
                         loss_term: str = "code", lam_ref: float | None = None, lam_ref_growth: float = 1.0,
                         lam_ref_every: int = 10, lam_ref_cap: float | None = None) -> Algorithm:
    """FedRef's server update on top of any algorithm whose server state holds ``"params"``.

    Args:
      algorithm: the local trainer and its aggregation (``A_r`` is its new ``server["params"]``).
      loss_fn: ``(params, Batch) -> scalar`` masked mean training loss (``loss_report="code"``).
      variant: one of ``VARIANTS`` (module docstring).
      lam: lambda of Eq. 12 (traced ``ref_lambda``); with ``lam_ref``, lambda_1 (the aggregate's change).
      p: reference window (static; the paper: 3 to 5).
      server_lr: eta (traced ``ref_lr``); ``None`` uses the client ``lr`` as the code does.
      fix_ref_delta: ``code`` variant: False reproduces the code's Delta-R bug.
      ref_through_A: ``l2`` variant: differentiate R_r through A_r too.
      reference: ``"mean"`` (Eq. 14), ``"p_plus_one"`` (Eq. 13), ``"broadcast"`` (the corrected models)
        or ``"weighted"`` (the later commits' static slot weights, ``reference_weights``).
      warmup: rounds that broadcast ``A_r`` (default ``p + 1``; 0 corrects from round 1 with
        the partial buffer).
      loss_report: ``"code"`` or ``"last_batch"`` (needs a ``local_sgd`` trainer), used by ``code``.
      loss_term: ``"code"`` (``s`` above) or ``"weighted_sum"`` (``s = 0``; ``sum_k w_k F_k`` only logged).
      lam_ref: lambda_2 of the later commits, the reference term's weight (traced ``ref_lambda_ref``;
        ``None``: ``lam``).
      lam_ref_growth, lam_ref_every, lam_ref_cap: lambda_2's schedule (``ref_lambda_at``; growth 1: constant).
    Returns:
      The algorithm with ``server["fedref"]`` (ring buffer ``[P, ...]``, previous aggregate,
      reference and loss sum). Metrics: ``fedref_correction`` ``||theta_r - A_r|| / ||A_r - A_{r-1}||``
      and, for ``code``, ``fedref_shift`` (``s``), ``weighted_loss`` and the per-tensor shifts'
      ``fedref_layer_shift`` and ``fedref_layer_shift_ratio`` (``layer_shifts``); ``fedref_lambda_ref``
      (lambda_2 this round) when it has a schedule. The aggregation is not streamed.
    """
    for name, value, valid in (("variant", variant, VARIANTS), ("reference", reference, REFERENCES),
                               ("loss_report", loss_report, LOSS_REPORTS), ("loss_term", loss_term, LOSS_TERMS)):
        if value not in valid:
            raise ValueError(f"fedref {name}={value!r}; choose one of {', '.join(valid)}")
    if int(p) < 1:
        raise ValueError(f"fedref p={p} must be >= 1 (the paper uses 3 to 5)")
    if lam < 0 or (server_lr is not None and server_lr < 0) or (lam_ref is not None and lam_ref < 0):
        raise ValueError(f"fedref needs lam, lam_ref and server_lr >= 0, got {lam}, {lam_ref}, {server_lr}")
    if lam_ref_growth <= 0 or int(lam_ref_every) < 1 or (lam_ref_cap is not None and lam_ref_cap < 0):
        raise ValueError(f"fedref's lambda_2 schedule needs lam_ref_growth > 0, lam_ref_every >= 1 and lam_ref_cap "
                         f">= 0, got {lam_ref_growth}, {lam_ref_every}, {lam_ref_cap} (the authors: 10, 10, 0.005)")
    if server_lr is None and "lr" not in algorithm.hparams:
        raise ValueError(f"FedRef's server step size defaults to the client lr, but {algorithm.name} has none; "
                         "fix: pass server_lr")
    p = int(p)
    slots = p + 1 if reference == "p_plus_one" else p
    warmup = p + 1 if warmup is None else int(warmup)
    needs_losses = variant == "code"
    hparams = {**algorithm.hparams, "ref_lambda": lam, **({} if server_lr is None else {"ref_lr": server_lr}),
               **({} if lam_ref is None else {"ref_lambda_ref": lam_ref})}
    scheduled = float(lam_ref_growth) != 1.0
    bug_divisor = 1.0 if reference == "weighted" else float(p)
    inner = algorithm

    def server_init(params):
        server = inner.server_init(params)
        if not isinstance(server, dict) or "params" not in server:
            raise ValueError(f"FedRef needs a server state with 'params'; {inner.name}'s has none")
        model = server["params"]
        ring = jax.tree.map(lambda a: jnp.zeros((slots,) + a.shape, a.dtype), model)
        return {**server, STATE_KEY: {"ring": ring, "pushed": jnp.zeros((), jnp.int32), "prev_agg": model,
                                      "prev_ref": model, "prev_loss": jnp.zeros((), jnp.float32)}}

    def push(ring, pushed, model):
        return jax.tree.map(lambda buf, a: buf.at[pushed % slots].set(a), ring, model)

    def mean_of(ring, filled):
        if reference == "weighted":
            weights = reference_weights(reference, slots, filled)
            return jax.tree.map(lambda buf: jnp.tensordot(weights.astype(buf.dtype), buf, axes=1), ring)
        # the uniform mean as a sum over the filled slots divided by their number: reference_weights' 1/filled
        # weights would round differently and move results/fedref.md in its last digits
        valid = (jnp.arange(slots) < filled).astype(jnp.float32)
        return jax.tree.map(lambda buf: jnp.tensordot(valid, buf, axes=1) / filled.astype(buf.dtype), ring)

    def step(server, new, metrics, hparams_, messages, weights, mask):
        state = server[STATE_KEY]
        agg = new["params"]
        pushed = state["pushed"] + 1
        filled = jnp.minimum(pushed, slots)
        ring = push(state["ring"], state["pushed"], agg)
        ref = mean_of(ring, filled)
        lam_, eta = hparams_["ref_lambda"], hparams_["ref_lr" if server_lr is not None else "lr"]
        lam_ref_ = ref_lambda_at(hparams_["ref_lambda_ref" if lam_ref is not None else "ref_lambda"], pushed,
                                 float(lam_ref_growth), int(lam_ref_every), lam_ref_cap)
        ref_share = reference_weights(reference, slots, filled)[state["pushed"] % slots]
        extra = {"fedref_lambda_ref": lam_ref_} if scheduled else {}
        s = jnp.zeros((), jnp.float32)
        loss_sum = state["prev_loss"]
        if needs_losses:
            losses = jnp.where(mask > 0, messages["loss"], 0.0)
            loss_sum = jnp.sum(losses)
            if loss_term == "code":
                s = (loss_sum - state["prev_loss"]) / jnp.maximum(jnp.sum(mask), 1.0)
            extra = {**extra, "fedref_shift": jnp.where(pushed <= warmup, 0.0, s),
                     "weighted_loss": jnp.sum(weights * losses)}
        theta = corrected(variant, agg, state["prev_agg"], ref, state["prev_ref"], s, lam_, lam_ref_, eta, ref_share,
                          bug_divisor, fix_ref_delta, ref_through_A)
        warm = pushed <= warmup
        theta = jax.tree.map(lambda a, t: jnp.where(warm, a, t), agg, theta)
        if isinstance(agg, dict) and "batch_stats" in agg:  # the authors shift trainable tensors only (spec 2.3)
            theta = {**theta, "batch_stats": agg["batch_stats"]}
        if reference == "broadcast":  # the buffer holds what was broadcast
            ring = push(state["ring"], state["pushed"], theta)
            ref = mean_of(ring, filled)
        step = jax.tree.map(jnp.subtract, agg, state["prev_agg"])
        correction = jax.tree.map(jnp.subtract, theta, agg)
        step_size, change = optax.tree.norm(step), optax.tree.norm(correction)
        if variant == "code":
            largest, relative = layer_shifts(correction, step)
            extra = {**extra, "fedref_layer_shift": largest, "fedref_layer_shift_ratio": relative}
        metrics = {**metrics, **extra, "fedref_correction": jnp.where(step_size > 0, change / step_size, 0.0)}
        fedref = {"ring": ring, "pushed": pushed, "prev_agg": agg, "prev_ref": ref, "prev_loss": loss_sum}
        return {**new, "params": theta, STATE_KEY: fedref}, metrics

    def server_update(server, messages, weights, mask, hparams_, key):
        new, metrics = inner.aggregate(server, messages, weights, mask, hparams_, key)
        return step(server, new, metrics, hparams_, messages, weights, mask)

    def client_final(local, ctx):
        message, persistent, metrics = inner.client_final(local, ctx)
        if not needs_losses:
            return message, persistent, metrics
        if loss_report == "last_batch":
            if not hasattr(local, "loss"):
                raise ValueError(f"loss_report='last_batch' reads the last batch loss a local_sgd trainer records; "
                                 f"{inner.name}'s local state has none (fix: loss_report='code')")
            loss = local.loss
        else:
            loss = mean_batch_loss(loss_fn, message["params"], ctx.data.x, ctx.data.y, ctx.data.count,
                                   inner.batch_size)
        return {**message, "loss": loss}, persistent, {**metrics, "reported_loss": loss}

    # FedRef reads the messages (the clients' losses), so it replaces the aggregation whole (not streamed).
    return algorithm.replace(name="fedref", server_init=server_init, server_update=server_update,
                             client_stats=None, server_from_stats=None, client_final=client_final, hparams=hparams)


def fedref(model, *, variant: str = "code", lam: float = 0.01, p: int = 5, server_lr: float | None = None,
           fix_ref_delta: bool = True, ref_through_A: bool = False, reference: str = "mean",
           warmup: int | None = None, loss_report: str = "code", loss_term: str = "code", lam_ref: float | None = None,
           lam_ref_growth: float = 1.0, lam_ref_every: int = 10, lam_ref_cap: float | None = None, lr: float = 0.01,
           local_epochs: int = 1, batch_size: int = 64, clip_norm: float | None = None, momentum: float = 0.0,
           task=None) -> Algorithm:
    """FedRef as the paper ran it: plain local SGD clients (no clipping, no momentum), then the server step.

    ``task``: a ``tasks.Task`` (default ``classification(model)``; ``tasks.segmentation(model)``
    trains with its BCE + soft-Dice loss). The rest: ``with_reference_model``.
    """
    base = fedavg(model, lr=lr, local_epochs=local_epochs, batch_size=batch_size, clip_norm=clip_norm,
                  momentum=momentum, task=task)
    loss_fn = (task or classification(model)).loss
    return with_reference_model(base, loss_fn=loss_fn, variant=variant, lam=lam, p=p, server_lr=server_lr,
                                fix_ref_delta=fix_ref_delta, ref_through_A=ref_through_A, reference=reference,
                                warmup=warmup, loss_report=loss_report, loss_term=loss_term, lam_ref=lam_ref,
                                lam_ref_growth=lam_ref_growth, lam_ref_every=lam_ref_every, lam_ref_cap=lam_ref_cap)
