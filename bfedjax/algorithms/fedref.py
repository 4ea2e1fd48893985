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
(``"broadcast"``). Clients report their loss after training as the code does
(``loss_report="code"``: the mean over their own minibatches of the batch-mean
loss of the trained model) or as the paper says (``"last_batch"``: the loss of
their last training batch). ``p`` is static; ``lam`` and ``eta`` are traced
(``hparams["ref_lambda"]``, ``hparams["ref_lr"]``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from bfedjax.algorithms.fedavg import fedavg
from bfedjax.core.types import Algorithm, Batch
from bfedjax.metrics.classification import padded_batches
from bfedjax.tasks import classification

VARIANTS = ("code", "l2", "map_step", "map_prox")
REFERENCES = ("mean", "p_plus_one", "broadcast")
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


def code_shift(agg, prev_agg, ref, prev_ref, s, lam, eta, p: int, fix_ref_delta: bool):
    """The authors' per-tensor scalar shift: ``A_l - eta (s + lam ||dA_l|| + lam ||dR_l||)`` for every leaf."""
    def leaf(a, a_prev, r, r_prev):
        d_ref = r - r_prev if fix_ref_delta else r - jnp.sum(r_prev, axis=-1, keepdims=True) / p
        return a - eta * (s + lam * jnp.linalg.norm((a - a_prev).ravel()) + lam * jnp.linalg.norm(d_ref.ravel()))
    return jax.tree.map(leaf, agg, prev_agg, ref, prev_ref)


def corrected(variant: str, agg, prev_agg, ref, prev_ref, s, lam, eta, p: int, fix_ref_delta: bool,
              ref_through_A: bool):
    """``theta_r`` of one variant from ``A_r``, ``A_{r-1}``, ``R_r``, ``R_{r-1}`` (pytrees) and scalars."""
    rho = 2.0 * eta * lam
    if variant == "code":
        return code_shift(agg, prev_agg, ref, prev_ref, s, lam, eta, p, fix_ref_delta)
    if variant == "l2":
        extra = (lambda r, rp: (r - rp) / p) if ref_through_A else (lambda r, rp: 0.0)
        return jax.tree.map(lambda a, ap, r, rp: a - rho * ((a - ap) + extra(r, rp)), agg, prev_agg, ref, prev_ref)
    if variant == "map_step":
        return jax.tree.map(lambda a, r: a - rho * (a - r), agg, ref)
    return jax.tree.map(lambda a, r: (a + rho * r) / (1.0 + rho), agg, ref)


def with_reference_model(algorithm: Algorithm, *, loss_fn, variant: str = "code", lam: float = 0.01, p: int = 5,
                         server_lr: float | None = None, fix_ref_delta: bool = True, ref_through_A: bool = False,
                         reference: str = "mean", warmup: int | None = None, loss_report: str = "code",
                         loss_term: str = "code") -> Algorithm:
    """FedRef's server update on top of any algorithm whose server state holds ``"params"``.

    Args:
      algorithm: the local trainer and its aggregation (``A_r`` is its new ``server["params"]``).
      loss_fn: ``(params, Batch) -> scalar`` masked mean training loss (``loss_report="code"``).
      variant: one of ``VARIANTS`` (module docstring).
      lam: lambda of Eq. 12 (traced ``ref_lambda``).
      p: reference window (static; the paper: 3 to 5).
      server_lr: eta (traced ``ref_lr``); ``None`` uses the client ``lr`` as the code does.
      fix_ref_delta: ``code`` variant: False reproduces the code's Delta-R bug.
      ref_through_A: ``l2`` variant: differentiate R_r through A_r too.
      reference: ``"mean"`` (Eq. 14), ``"p_plus_one"`` (Eq. 13) or ``"broadcast"`` (the corrected models).
      warmup: rounds that broadcast ``A_r`` (default ``p + 1``; 0 corrects from round 1 with
        the partial buffer).
      loss_report: ``"code"`` or ``"last_batch"`` (needs a ``local_sgd`` trainer), used by ``code``.
      loss_term: ``"code"`` (``s`` above) or ``"weighted_sum"`` (``s = 0``; ``sum_k w_k F_k`` only logged).
    Returns:
      The algorithm with ``server["fedref"]`` (ring buffer ``[P, ...]``, previous aggregate,
      reference and loss sum). Metrics: ``fedref_correction`` ``||theta_r - A_r|| / ||A_r - A_{r-1}||``
      and, for ``code``, ``fedref_shift`` (``s``) and ``weighted_loss``. The aggregation is not streamed.
    """
    for name, value, valid in (("variant", variant, VARIANTS), ("reference", reference, REFERENCES),
                               ("loss_report", loss_report, LOSS_REPORTS), ("loss_term", loss_term, LOSS_TERMS)):
        if value not in valid:
            raise ValueError(f"fedref {name}={value!r}; choose one of {', '.join(valid)}")
    if int(p) < 1:
        raise ValueError(f"fedref p={p} must be >= 1 (the paper uses 3 to 5)")
    if lam < 0 or (server_lr is not None and server_lr < 0):
        raise ValueError(f"fedref needs lam >= 0 and server_lr >= 0, got {lam}, {server_lr}")
    if server_lr is None and "lr" not in algorithm.hparams:
        raise ValueError(f"FedRef's server step size defaults to the client lr, but {algorithm.name} has none; "
                         "fix: pass server_lr")
    p = int(p)
    slots = p + 1 if reference == "p_plus_one" else p
    warmup = p + 1 if warmup is None else int(warmup)
    needs_losses = variant == "code"
    hparams = {**algorithm.hparams, "ref_lambda": lam, **({} if server_lr is None else {"ref_lr": server_lr})}
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
        extra = {}
        s = jnp.zeros((), jnp.float32)
        loss_sum = state["prev_loss"]
        if needs_losses:
            losses = jnp.where(mask > 0, messages["loss"], 0.0)
            loss_sum = jnp.sum(losses)
            if loss_term == "code":
                s = (loss_sum - state["prev_loss"]) / jnp.maximum(jnp.sum(mask), 1.0)
            extra = {"fedref_shift": jnp.where(pushed <= warmup, 0.0, s), "weighted_loss": jnp.sum(weights * losses)}
        theta = corrected(variant, agg, state["prev_agg"], ref, state["prev_ref"], s, lam_, eta, p, fix_ref_delta,
                          ref_through_A)
        warm = pushed <= warmup
        theta = jax.tree.map(lambda a, t: jnp.where(warm, a, t), agg, theta)
        if reference == "broadcast":  # the buffer holds what was broadcast
            ring = push(state["ring"], state["pushed"], theta)
            ref = mean_of(ring, filled)
        step_size = optax.tree.norm(jax.tree.map(jnp.subtract, agg, state["prev_agg"]))
        change = optax.tree.norm(jax.tree.map(jnp.subtract, theta, agg))
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
           warmup: int | None = None, loss_report: str = "code", loss_term: str = "code", lr: float = 0.01,
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
                                warmup=warmup, loss_report=loss_report, loss_term=loss_term)
