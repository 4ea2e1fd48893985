"""Pytrees as Flower ``ArrayRecord`` objects of named arrays, and the checks a received record must pass.

A pytree travels as one ``flwr.app.Array`` per leaf, named by the leaf's
tree path (``jax.tree_util.keystr``: ``"['params']['Dense_0']['kernel']"``),
never by leaf order. Decoding goes by the structure the receiver expects
(``like``: a pytree of arrays or ``jax.ShapeDtypeStruct`` objects it derives from
its own algorithm), so a record with a missing name, an extra name, another
shape or dtype, or non-finite values is refused with a one-line reason.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flwr.app import Array, ArrayRecord

PyTree = Any


class MalformedRecordError(ValueError):
    """A received record does not match the expected pytree (the message names the first problem)."""


def leaf_names(tree: PyTree) -> list[str]:
    """The names of ``tree``'s leaves (``keystr`` of their paths), in ``tree_flatten`` order."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def to_record(tree: PyTree) -> ArrayRecord:
    """``tree``'s leaves (arrays or scalars) as an ``ArrayRecord`` keyed by their tree paths.

    A leaf of shape ``[...]`` and dtype ``d`` becomes an ``Array`` of the same shape and dtype.
    """
    named = {}
    for name, leaf in zip(leaf_names(tree), jax.tree.leaves(tree)):
        named[name] = Array(np.asarray(leaf))
    return ArrayRecord(named)


def _expected(like: PyTree) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {name: (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
            for name, leaf in zip(leaf_names(like), jax.tree.leaves(like))}


def record_problem(record, like: PyTree, *, finite: bool = True) -> str | None:
    """Why ``record`` cannot be read as a pytree shaped like ``like`` (``None``: it can).

    Checks that ``record`` is an ``ArrayRecord`` holding exactly ``like``'s leaf names, each an
    array of the expected shape and dtype (in its metadata and its bytes) and, with ``finite``,
    free of NaN and Inf in floating leaves.
    """
    try:
        _decoded(record, like, finite)
    except MalformedRecordError as err:
        return str(err)
    return None


def from_record(record, like: PyTree, *, finite: bool = True) -> PyTree:
    """The pytree ``like`` (arrays or ``ShapeDtypeStruct`` objects) with its leaves read from ``record`` by name.

    Raises ``MalformedRecordError`` naming the first problem (see ``record_problem``).
    """
    leaves = _decoded(record, like, finite)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _decoded(record, like: PyTree, finite: bool) -> list[np.ndarray]:
    if not isinstance(record, ArrayRecord):
        raise MalformedRecordError(f"expected an ArrayRecord, got {type(record).__name__}")
    expected = _expected(like)
    missing = [name for name in expected if name not in record]
    if missing:
        raise MalformedRecordError(f"missing arrays {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    extra = sorted(name for name in record if name not in expected)
    if extra:
        raise MalformedRecordError(f"unexpected arrays {extra[:3]}{' ...' if len(extra) > 3 else ''}")
    leaves = []
    for name, (shape, dtype) in expected.items():
        array = record[name]
        if str(array.dtype) != dtype.name or tuple(array.shape) != shape:
            raise MalformedRecordError(f"{name} is {array.dtype}{list(array.shape)}, expected "
                                       f"{dtype.name}{list(shape)}")
        try:
            value = array.numpy()
        except Exception as err:  # noqa: BLE001 - any undecodable payload is a malformed reply
            raise MalformedRecordError(f"{name} cannot be decoded ({type(err).__name__}: {err})") from None
        if value.dtype != dtype or value.shape != shape:
            raise MalformedRecordError(f"{name} holds {value.dtype}{list(value.shape)} under metadata "
                                       f"{array.dtype}{list(array.shape)}")
        if finite and np.issubdtype(dtype, np.inexact) and not np.all(np.isfinite(value)):
            raise MalformedRecordError(f"{name} holds NaN or Inf")
        leaves.append(value)
    return leaves


__all__ = ["MalformedRecordError", "from_record", "leaf_names", "record_problem", "to_record"]
