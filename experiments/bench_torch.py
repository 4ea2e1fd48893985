"""The PyTorch reference for experiments/bench.py: a Python loop over clients and batches.

This mirrors the papers' released PyTorch code (the FOLA authors' ``cnn_*.py``):
per client, copy the global weights, run SGD over shuffled mini-batches with
global-norm clipping, and (FOLA) accumulate the batch-mean squared gradient;
then average (FedAvg) or take the precision-weighted product (FOLA). Models:
the MLP and FedReg's MNIST CNN (``models.zoo.FedRegCNN``, same layers). Runs on
the GPU when torch sees one (each round ends with a synchronisation). Needs
the optional ``[bench]`` extra (torch).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np


ALGORITHMS = ("fedavg", "fola")
MODELS = ("mlp", "fedreg_cnn")


def available() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


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


def _client_tensors(torch, fed, n: int, model: str, device):
    x, y = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in fed.client(n))
    if model == "fedreg_cnn":
        x = x.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return x, y


def time_rounds(fed, *, algorithm: str, batch_size: int, model: str = "mlp", hidden: Sequence[int] = (200, 200),
                local_epochs: int = 1, lr: float = 0.01, lam: float = 1e3, clip_norm: float = 10.0, rounds: int = 2,
                seed: int = 0) -> list[float]:
    """Seconds per round of FedAvg or FOLA over all clients of ``fed`` (a ``FederatedData``)."""
    import torch
    if algorithm not in ALGORITHMS or model not in MODELS:
        raise ValueError(f"the PyTorch loop covers algorithms {ALGORITHMS} and models {MODELS}; "
                         f"got {algorithm!r} on {model!r}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = model
    if kind == "mlp":
        model = _mlp(torch, int(np.prod(fed.input_shape)), hidden, fed.num_classes)
    else:
        model = _fedreg_cnn(torch, fed.input_shape[-1], fed.num_classes)
    model = model.to(device)
    global_params = [p.detach().clone() for p in model.parameters()]
    global_prec = [torch.zeros_like(p) for p in global_params]
    clients = [_client_tensors(torch, fed, n, kind, device) for n in range(fed.num_clients)]
    weights = fed.weights.astype(np.float32)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for r in range(1, rounds + 1):
        start = time.perf_counter()
        sum_w = [torch.zeros_like(p) for p in global_params]
        sum_wx = [torch.zeros_like(p) for p in global_params]
        for n, (x, y) in enumerate(clients):
            with torch.no_grad():
                for p, g in zip(model.parameters(), global_params):
                    p.copy_(g)
            fisher = [prec.clone() for prec in global_prec]
            m = len(y)
            for _ in range(local_epochs):
                order = torch.from_numpy(rng.permutation(m)).to(device)
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
            global_params = [wx / (w + eps) for wx, w in zip(sum_wx, sum_w)]
            if algorithm == "fola":
                global_prec = sum_w
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times
