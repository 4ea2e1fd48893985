"""Federated arrays: every client's data stacked on a leading axis and padded.

``FederatedData.x`` is ``[N, max_n, ...]``; client ``n`` owns rows
``[0, counts[n])`` and the rest is zero padding that the engine masks out.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from bfedjax.data.validate import check_labels


@dataclasses.dataclass(frozen=True)
class FederatedData:
    """A partitioned data set ready for the round engine.

    Attributes:
      x: ``[N, max_n, ...]`` float32 client inputs (zero padded).
      y: ``[N, max_n]`` int32 client labels, or ``[N, max_n, H, W]`` masks (zero padded).
      counts: ``[N]`` int32 real samples per client.
      x_test: ``[T, ...]``, y_test: ``[T]``: the global test set.
      num_classes: number of labels.
      name: data set name (for logs).
      x_test_clients: ``[N, max_t, ...]``, y_test_clients: ``[N, max_t]``, test_counts: ``[N]``:
        optional per-client test splits (zero padded; ``None`` when the federation has none).
    """

    x: np.ndarray
    y: np.ndarray
    counts: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str = ""
    x_test_clients: np.ndarray | None = None
    y_test_clients: np.ndarray | None = None
    test_counts: np.ndarray | None = None

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
                  pad_to_multiple: int = 1, test_parts: Sequence[np.ndarray] | None = None) -> FederatedData:
    """Stacks per-client index lists into padded ``[N, max_n, ...]`` arrays.

    Args:
      x: ``[n_train, ...]`` inputs; y: ``[n_train]`` labels.
      parts: one int index array per client (each non-empty).
      pad_to_multiple: round ``max_n`` up to a multiple of this (e.g. the batch size).
      test_parts: optional index arrays into ``x_test`` / ``y_test``, one per client: the
        clients' own test splits (``data.dirichlet_train_test``); the global test set stays whole.

    Raises:
      ValueError: no clients, an empty client, or a label outside ``[0, num_classes)`` (one line with
        counts, :mod:`bfedjax.data.validate`). Non-finite inputs are kept: a poisoned client is a case
        the engine handles, and simulations build them on purpose.
    """
    if len(parts) == 0:
        raise ValueError("no clients: the partition is empty; fix: use num_clients >= 1")
    fix = f"map the labels to class ids 0..{int(num_classes) - 1} or pass the right num_classes"
    for split, labels in (("training", y), ("test", y_test)):
        check_labels(labels, int(num_classes), name=name or "stack_clients", split=split, fix=fix)
    counts = np.array([len(p) for p in parts], np.int32)
    if counts.min() < 1:
        raise ValueError(f"client {int(np.argmin(counts))} has no samples; fix: use a partitioner with min_size >= 1")
    xs, ys, counts = _padded(x, y, parts, pad_to_multiple)
    own = {}
    if test_parts is not None:
        if len(test_parts) != len(parts):
            raise ValueError(f"{len(test_parts)} test splits for {len(parts)} clients; fix: one per client")
        own = dict(zip(("x_test_clients", "y_test_clients", "test_counts"),
                       _padded(np.asarray(x_test), np.asarray(y_test), test_parts, 1)))
    return FederatedData(xs, ys, counts, np.asarray(x_test, np.float32), np.asarray(y_test, np.int32),
                         int(num_classes), name, **own)


def _padded(x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], pad_to_multiple: int):
    """``([N, max_n, ...] float32, [N, max_n, ...] int32, [N] int32)`` of the index arrays ``parts``
    (``y`` holds class ids ``[m]`` or segmentation masks ``[m, H, W]``)."""
    counts = np.array([len(p) for p in parts], np.int32)
    max_n = max(1, int(np.ceil(counts.max() / pad_to_multiple) * pad_to_multiple))
    try:
        xs = np.zeros((len(parts), max_n) + x.shape[1:], np.float32)
        ys = np.zeros((len(parts), max_n) + y.shape[1:], np.int32)
    except MemoryError:
        gib = len(parts) * max_n * (np.prod(x.shape[1:]) + np.prod(y.shape[1:])) * 4 / 2 ** 30
        raise ValueError(f"the padded client arrays [{len(parts)}, {max_n}, ...] need {gib:.3g} GiB, more than this "
                         "machine can allocate; fix: fewer clients or fewer samples per client") from None
    for n, idx in enumerate(parts):
        xs[n, : len(idx)] = x[idx]
        ys[n, : len(idx)] = y[idx]
    return xs, ys, counts


def join_tasks(feds: Sequence[FederatedData], name: str = "") -> tuple[FederatedData, np.ndarray]:
    """One federation of several tasks (objective heterogeneity): each client keeps its data and labels.

    Tasks may have different label spaces (a client of task t has labels ``0..num_classes_t - 1``);
    their inputs must have one shape. A client's own test split is its per-client split when its
    task has them, else its task's whole test set. The global test set is the tasks' test sets one
    after the other (only meaningful to an evaluate hook that knows the tasks).

    Returns:
      ``(federation with per-client test splits, [N] int32 task of each client)``; the task index
      is the client's architecture group when each task has its own head.
    """
    if not feds or len({fed.input_shape for fed in feds}) != 1:
        raise ValueError("join_tasks needs at least one federation, all with the same input shape; fix: resize or "
                         "pad the tasks' inputs to one shape")
    train, test, tasks = [], [], []
    for t, fed in enumerate(feds):
        for n in range(fed.num_clients):
            train.append(fed.client(n))
            if fed.test_counts is not None:
                m = int(fed.test_counts[n])
                test.append((fed.x_test_clients[n, :m], fed.y_test_clients[n, :m]))
            else:
                test.append((fed.x_test, fed.y_test))
            tasks.append(t)
    stacked = [_padded(np.concatenate([x for x, _ in part]), np.concatenate([y for _, y in part]),
                       _consecutive([len(y) for _, y in part]), 1) for part in (train, test)]
    (xs, ys, counts), (xt, yt, test_counts) = stacked
    joined = FederatedData(xs, ys, counts, np.concatenate([fed.x_test for fed in feds]),
                           np.concatenate([fed.y_test for fed in feds]), max(fed.num_classes for fed in feds),
                           name or "+".join(fed.name for fed in feds), xt, yt, test_counts)
    return joined, np.asarray(tasks, np.int32)


def _consecutive(sizes: Sequence[int]) -> list[np.ndarray]:
    """Index arrays of consecutive blocks of the given sizes."""
    ends = np.cumsum(sizes)
    return [np.arange(end - size, end) for size, end in zip(sizes, ends)]


def from_partition(dataset, parts: Sequence[np.ndarray], **kwargs) -> FederatedData:
    """A ``FederatedData`` of ``dataset``'s training split, partitioned, and its whole test split.

    Args:
      dataset: a ``data.Dataset`` (``data.load``): ``x_train [n, ...]``, ``y_train [n]``, ``x_test``, ``y_test``.
      parts: one int index array into ``x_train`` per client (``data.partition``).
      **kwargs: ``stack_clients``'s ``pad_to_multiple`` and ``test_parts`` (the clients' own test splits).
    Returns:
      ``FederatedData``: ``x [N, max_n, ...]``, ``y [N, max_n]`` padded, ``counts [N]``, ``weights [N]``
      (``counts / sum``), and the global ``x_test``, ``y_test``.
    """
    return stack_clients(dataset.x_train, dataset.y_train, parts, x_test=dataset.x_test,
                         y_test=dataset.y_test, num_classes=dataset.num_classes, name=dataset.name, **kwargs)
