"""The PyTorch references for experiments/bench.py: a loop over clients, and a torch.func round.

This mirrors the papers' released PyTorch code (the FOLA authors' ``cnn_*.py``):
per client, copy the global weights, run SGD over shuffled mini-batches with
global-norm clipping, and (FOLA) accumulate the batch-mean squared gradient;
then average (FedAvg) or take the precision-weighted product (FOLA). Models:
the MLP, FedReg's MNIST CNN (``models.zoo.FedRegCNN``, same layers) and the FOLA
authors' CIFAR CNN (``models.zoo.FolaCNN``). Runs on
the GPU when torch sees one (each round ends with a synchronisation). Needs
the optional ``[bench]`` extra (torch).

Two designs of the same round are timed:

* ``time_rounds`` (``loop_round``): the papers' Python loop over clients and batches;
* ``time_func_rounds`` (``func_round``): the strongest PyTorch design, parameters
  stacked over clients (a leading ``K`` axis) and one local step for all clients at
  once as ``torch.func.vmap(torch.func.grad(loss))`` over ``functional_call``,
  optionally under ``torch.compile``. It needs clients of equal size.

Given the same initial weights, data and per-client batch orders both give the
same new global parameters (tests/test_bench_anchors.py).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np


ALGORITHMS = ("fedavg", "fola")
MODELS = ("mlp", "fedreg_cnn", "fola_cnn")
CONV_MODELS = ("fedreg_cnn", "fola_cnn")


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def _mlp(torch, in_dim: int, hidden: Sequence[int], num_classes: int):
    layers, last = [], in_dim
    for h in hidden:
        layers += [torch.nn.Linear(last, h), torch.nn.ReLU()]
        last = h
    layers.append(torch.nn.Linear(last, num_classes))
    return torch.nn.Sequential(torch.nn.Flatten(), *layers)


def _fedreg_cnn(torch, channels: int, num_classes: int):
    """FedReg's CNN on NCHW input: three 5x5 VALID convs, two 2x2 max-pools, Dense 256 (228,010 params)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(channels, 32, 5), nn.ReLU(),
        nn.Conv2d(32, 32, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(576, 256), nn.ReLU(), nn.Linear(256, num_classes))


def _fola_cnn(torch, channels: int, num_classes: int):
    """The FOLA authors' CIFAR CNN on NCHW input (``models.zoo.FolaCNN``, 878,538 params on 32x32x3)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1600, 512), nn.ReLU(), nn.Linear(512, num_classes))


def _client_tensors(torch, fed, n: int, model: str, device):
    x, y = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in fed.client(n))
    if model in CONV_MODELS:
        x = x.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return x, y


def _check(algorithm: str, model: str) -> None:
    if algorithm not in ALGORITHMS or model not in MODELS:
        raise ValueError(f"the PyTorch loop covers algorithms {ALGORITHMS} and models {MODELS}; "
                         f"got {algorithm!r} on {model!r}")


def build_model(fed, model: str = "mlp", hidden: Sequence[int] = (200, 200), seed: int = 0):
    """The torch module of ``model`` for ``fed``'s inputs, initialised from ``torch.manual_seed(seed)``, on the
    device (CUDA when torch sees one)."""
    import torch
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if model == "mlp":
        net = _mlp(torch, int(np.prod(fed.input_shape)), hidden, fed.num_classes)
    else:
        net = (_fedreg_cnn if model == "fedreg_cnn" else _fola_cnn)(torch, fed.input_shape[-1], fed.num_classes)
    return net.to(device)


def draw_orders(rng: np.random.Generator, counts: Sequence[int], local_epochs: int) -> list[list[np.ndarray]]:
    """Each client's batch order of one round: ``orders[n][e]`` is a permutation of ``counts[n]`` sample indices
    for epoch ``e`` (drawn client by client, epoch by epoch, as the loop always drew them)."""
    return [[rng.permutation(int(m)) for _ in range(local_epochs)] for m in counts]


def loop_round(model, global_params: list, global_prec: list, clients: list, weights: np.ndarray,
               orders: list, *, algorithm: str, batch_size: int, lr: float = 0.01, lam: float = 1e3,
               clip_norm: float = 10.0, round_index: int = 1) -> tuple[list, list]:
    """One FedAvg or FOLA round as the papers' Python loop over clients and batches.

    Args:
      model: the torch module (its parameters are overwritten with each client's).
      global_params: the global parameters, a list of tensors in ``model.parameters()`` order.
      global_prec: FOLA's global precision, same shapes (zeros in round 1; ignored by FedAvg).
      clients: per client ``(x [m_n, ...], y [m_n])`` tensors on the model's device.
      weights: ``[N]`` float32 aggregation weights ``pi_n``.
      orders: ``orders[n][e]``, client ``n``'s sample permutation for local epoch ``e`` (``draw_orders``).
      round_index: ``r`` (1-based): FOLA's prior term is ``lam / r * prec * (theta - center)``.
    Returns:
      the new ``(global_params, global_prec)`` lists (``global_prec`` unchanged for FedAvg).
    """
    import torch
    device = global_params[0].device
    loss_fn = torch.nn.CrossEntropyLoss()
    r = round_index
    sum_w = [torch.zeros_like(p) for p in global_params]
    sum_wx = [torch.zeros_like(p) for p in global_params]
    for n, (x, y) in enumerate(clients):
        with torch.no_grad():
            for p, g in zip(model.parameters(), global_params):
                p.copy_(g)
        fisher = [prec.clone() for prec in global_prec]
        m = len(y)
        for epoch_order in orders[n]:
            order = torch.as_tensor(epoch_order).to(device)
            for i in range(0, m, batch_size):
                idx = order[i:i + batch_size]
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model(x[idx]), y[idx].long())
                loss.backward()
                with torch.no_grad():
                    params = list(model.parameters())
                    if algorithm == "fola":
                        for f, p in zip(fisher, params):
                            f.add_(p.grad.square(), alpha=len(idx) / m)
                        for p, c, prec in zip(params, global_params, global_prec):
                            p.grad.add_(lam / r * prec * (p - c))
                    torch.nn.utils.clip_grad_norm_(params, clip_norm)
                    for p in params:
                        p.add_(p.grad, alpha=-lr)
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                w = float(weights[n]) * (fisher[k] if algorithm == "fola" else 1.0)
                sum_w[k] += w if algorithm == "fola" else torch.full_like(p, float(w))
                sum_wx[k] += w * p
    with torch.no_grad():
        eps = 1e-5 if algorithm == "fola" else 0.0
        new_params = [wx / (w + eps) for wx, w in zip(sum_wx, sum_w)]
        new_prec = sum_w if algorithm == "fola" else global_prec
    return new_params, new_prec


def time_rounds(fed, *, algorithm: str, batch_size: int, model: str = "mlp", hidden: Sequence[int] = (200, 200),
                local_epochs: int = 1, lr: float = 0.01, lam: float = 1e3, clip_norm: float = 10.0, rounds: int = 2,
                seed: int = 0) -> list[float]:
    """Seconds per round of FedAvg or FOLA over all clients of ``fed`` (a ``FederatedData``), as the papers'
    Python loop (``loop_round``); the first round includes torch's warm-up."""
    import torch
    _check(algorithm, model)
    net = build_model(fed, model, hidden, seed)
    rng = np.random.default_rng(seed)
    device = next(net.parameters()).device
    global_params = [p.detach().clone() for p in net.parameters()]
    global_prec = [torch.zeros_like(p) for p in global_params]
    clients = [_client_tensors(torch, fed, n, model, device) for n in range(fed.num_clients)]
    weights = fed.weights.astype(np.float32)
    times = []
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        orders = draw_orders(rng, fed.counts, local_epochs)
        global_params, global_prec = loop_round(
            net, global_params, global_prec, clients, weights, orders, algorithm=algorithm, batch_size=batch_size,
            lr=lr, lam=lam, clip_norm=clip_norm, round_index=r)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def stacked_clients(fed, model: str = "mlp", device=None):
    """All clients' samples stacked: ``(xs [K, n, ...], ys [K, n] int64)`` tensors (NCHW images for the CNN).

    Raises:
      ValueError: if the clients hold different numbers of samples.
    """
    import torch
    counts = np.asarray(fed.counts)
    if counts.min() != counts.max():
        raise ValueError(f"time_func_rounds stacks clients of equal size; these hold {counts.min()} to "
                         f"{counts.max()} samples; fix: use a uniform split (equal fed.counts) or time_rounds")
    n = int(counts[0])
    xs = torch.from_numpy(np.ascontiguousarray(fed.x[:, :n])).to(device)
    ys = torch.from_numpy(np.ascontiguousarray(fed.y[:, :n])).long().to(device)
    if model in CONV_MODELS:
        xs = xs.permute(0, 1, 4, 2, 3).contiguous()  # [K, n, H, W, C] -> [K, n, C, H, W]
    return xs, ys


def make_local_step(model, *, algorithm: str, lr: float = 0.01, clip_norm: float = 10.0, compiled: bool = False):
    """One local SGD step of all clients at once.

    Returns ``step(params, fisher, xb, yb, center, prec, coef, fisher_scale) -> (params, fisher)`` with
    ``params``/``fisher``: dicts of ``[K, ...]`` stacked tensors (``fisher`` is ``{}`` for FedAvg), ``xb``:
    ``[K, B, ...]``, ``yb``: ``[K, B]``, ``center``/``prec``: dicts of the global ``[...]`` tensors (FOLA's prior),
    ``coef``: 0-d tensor ``lam / r``, ``fisher_scale``: 0-d tensor ``B / m``. The gradient is
    ``vmap(grad(mean cross-entropy))`` over ``functional_call``; FOLA adds ``gradient**2 * B / m`` to the Fisher
    (before the prior term, as the loop does) and ``coef * prec * (theta - center)`` to the gradient; then each
    client's gradient is clipped to global norm ``clip_norm`` (``clip_grad_norm_``'s formula) and
    ``theta -= lr * gradient``. ``compiled=True`` wraps the step in ``torch.compile`` (inductor).
    """
    import torch
    from torch.func import functional_call, grad, vmap
    fola = algorithm == "fola"

    def loss(params, x, y):
        return torch.nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    grads_of = vmap(grad(loss))

    def step(params, fisher, xb, yb, center, prec, coef, fisher_scale):
        g = grads_of(params, xb, yb)
        if fola:
            fisher = {k: fisher[k] + g[k].square() * fisher_scale for k in g}
            g = {k: g[k] + coef * prec[k] * (params[k] - center[k]) for k in g}
        sq = sum(v.square().flatten(1).sum(1) for v in g.values())  # [K]
        scale = torch.clamp(clip_norm / (sq.sqrt() + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
        params = {k: params[k] - lr * scale.view((-1,) + (1,) * (v.ndim - 1)) * v for k, v in g.items()}
        return params, fisher

    return torch.compile(step) if compiled else step


def func_round(step, params: dict, prec: dict, xs, ys, weights, orders, *, algorithm: str, batch_size: int,
               lam: float = 1e3, round_index: int = 1) -> tuple[dict, dict]:
    """One FedAvg or FOLA round of all ``K`` clients at once (``torch.no_grad`` is not needed: torch.func).

    Args:
      step: ``make_local_step(model, ...)``, the vmapped local step.
      params: the global parameters, ``{name: [...]}`` (``model.named_parameters()`` names).
      prec: FOLA's global precision, same shapes (zeros in round 1; ignored by FedAvg).
      xs: ``[K, n, ...]`` client inputs; ys: ``[K, n]`` int64 labels (``stacked_clients``).
      weights: ``[K]`` float32 tensor of aggregation weights ``pi_k``.
      orders: ``[K, E, n]`` int64 tensor, client ``k``'s sample permutation for local epoch ``e``.
      round_index: ``r`` (1-based): FOLA's prior coefficient is ``lam / r``.
    Returns:
      the new global ``(params, prec)`` dicts: FedAvg's weighted mean ``sum_k pi_k theta_k / sum_k pi_k``, or
      FOLA's precision-weighted product ``sum_k pi_k F_k theta_k / (sum_k pi_k F_k + 1e-5)`` with precision
      ``sum_k pi_k F_k`` (``F_k``: the global precision plus client ``k``'s accumulated Fisher).
    """
    import torch
    fola = algorithm == "fola"
    num_clients, num_epochs, m = orders.shape
    rows = torch.arange(num_clients, device=xs.device)[:, None]
    stacked = {k: v.expand((num_clients,) + v.shape).clone() for k, v in params.items()}
    fisher = {k: v.expand((num_clients,) + v.shape).clone() for k, v in prec.items()} if fola else {}
    coef = torch.tensor(lam / round_index, device=xs.device)
    for e in range(num_epochs):
        for i in range(0, m, batch_size):
            idx = orders[:, e, i:i + batch_size]  # [K, B]
            scale = torch.tensor(idx.shape[1] / m, device=xs.device)
            stacked, fisher = step(stacked, fisher, xs[rows, idx], ys[rows, idx], params, prec, coef, scale)

    def weighted_sum(tree):
        return {k: torch.tensordot(weights, v, dims=1) for k, v in tree.items()}  # sum over K

    if not fola:
        total = weights.sum()
        return {k: v / total for k, v in weighted_sum(stacked).items()}, prec
    new_prec = weighted_sum(fisher)
    wx = weighted_sum({k: fisher[k] * stacked[k] for k in stacked})
    return {k: wx[k] / (new_prec[k] + 1e-5) for k in wx}, new_prec


def time_func_rounds(fed, *, algorithm: str, batch_size: int, model: str = "mlp", hidden: Sequence[int] = (200, 200),
                     local_epochs: int = 1, lr: float = 0.01, lam: float = 1e3, clip_norm: float = 10.0,
                     rounds: int = 2, seed: int = 0, compiled: bool = False) -> list[float]:
    """Seconds per round of FedAvg or FOLA as ``func_round`` (clients stacked, vmapped local steps), optionally
    under ``torch.compile``; the first entry includes the warm-up (and the compilation). Same initial weights,
    data and batch orders as ``time_rounds`` with the same ``seed``.

    Raises:
      ValueError: clients of unequal size (see ``stacked_clients``), or an algorithm or model not covered.
      RuntimeError: ``compiled=True`` and ``torch.compile`` fails on this machine.
    """
    import torch
    _check(algorithm, model)
    net = build_model(fed, model, hidden, seed)
    device = next(net.parameters()).device
    xs, ys = stacked_clients(fed, model, device)
    rng = np.random.default_rng(seed)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    prec = {k: torch.zeros_like(v) for k, v in params.items()}
    weights = torch.from_numpy(fed.weights.astype(np.float32)).to(device)
    step = make_local_step(net, algorithm=algorithm, lr=lr, clip_norm=clip_norm, compiled=compiled)
    times = []
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        orders = torch.from_numpy(np.asarray(draw_orders(rng, fed.counts, local_epochs))).to(device)
        try:
            params, prec = func_round(step, params, prec, xs, ys, weights, orders, algorithm=algorithm,
                                      batch_size=batch_size, lam=lam, round_index=r)
        except Exception as error:  # torch.compile's failures surface at the first call
            if not compiled or r > 1:
                raise
            first = (str(error).strip().splitlines() or [""])[0]
            raise RuntimeError(f"torch.compile failed on this machine ({type(error).__name__}: {first}); "
                               "fix: time_func_rounds(compiled=False)") from error
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times
