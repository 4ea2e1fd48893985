"""Federated arrays: every client's data stacked on a leading axis and padded.

``FederatedData.x`` is ``[N, max_n, ...]``; client ``n`` owns rows
``[0, counts[n])`` and the rest is zero padding that the engine masks out.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class FederatedData:
    """A partitioned data set ready for the round engine.

    x: ``[N, max_n, ...]`` float32 client inputs (zero padded).
    y: ``[N, max_n]`` int32 client labels (zero padded).
    counts: ``[N]`` int32 real samples per client.
    x_test: ``[T, ...]``, y_test: ``[T]``: the global test set.
    num_classes: number of labels.
    name: data set name (for logs).
    """

    x: np.ndarray
    y: np.ndarray
    counts: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str = ""

    @property
    def num_clients(self) -> int:
        return int(self.counts.shape[0])

    @property
    def max_n(self) -> int:
        return int(self.x.shape[1])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[2:])

    @property
    def weights(self) -> np.ndarray:
        """pi_n = m_n / m, ``[N]`` float32."""
        return (self.counts / self.counts.sum()).astype(np.float32)

    def client(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``n``'s real samples, unpadded: ``([m_n, ...], [m_n])``."""
        m = int(self.counts[n])
        return self.x[n, :m], self.y[n, :m]

    def padded_work_ratio(self, batch_size: int, clients_per_chunk: int | None = None) -> float:
        """Batch steps computed under vmap over steps that train on real samples.

        Without chunking every client runs as many steps as the largest one;
        with ``clients_per_chunk`` the engine sorts clients by size and each
        chunk runs as many steps as its own largest client.
        """
        steps = np.ceil(np.sort(self.counts)[::-1] / batch_size)
        chunk = clients_per_chunk or len(steps)
        computed = sum(steps[i] * len(steps[i:i + chunk]) for i in range(0, len(steps), chunk))
        return float(computed / max(steps.sum(), 1))


def stack_clients(x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], *, x_test: np.ndarray,
                  y_test: np.ndarray, num_classes: int, name: str = "",
                  pad_to_multiple: int = 1) -> FederatedData:
    """Stacks per-client index lists into padded ``[N, max_n, ...]`` arrays.

    Args:
      x: ``[n_train, ...]`` inputs; y: ``[n_train]`` labels.
      parts: one int index array per client (each non-empty).
      pad_to_multiple: round ``max_n`` up to a multiple of this (e.g. the batch size).
    """
    if len(parts) == 0:
        raise ValueError("no clients: the partition is empty; fix: use num_clients >= 1")
    counts = np.array([len(p) for p in parts], np.int32)
    if counts.min() < 1:
        raise ValueError(f"client {int(np.argmin(counts))} has no samples; fix: use a partitioner with min_size >= 1")
    max_n = int(np.ceil(counts.max() / pad_to_multiple) * pad_to_multiple)
    xs = np.zeros((len(parts), max_n) + x.shape[1:], np.float32)
    ys = np.zeros((len(parts), max_n), np.int32)
    for n, idx in enumerate(parts):
        xs[n, : len(idx)] = x[idx]
        ys[n, : len(idx)] = y[idx]
    return FederatedData(xs, ys, counts, np.asarray(x_test, np.float32), np.asarray(y_test, np.int32),
                         int(num_classes), name)


def from_partition(dataset, parts: Sequence[np.ndarray], **kwargs) -> FederatedData:
    """``stack_clients`` for a ``data.Dataset`` (train split partitioned, test split global)."""
    return stack_clients(dataset.x_train, dataset.y_train, parts, x_test=dataset.x_test,
                         y_test=dataset.y_test, num_classes=dataset.num_classes, name=dataset.name, **kwargs)
