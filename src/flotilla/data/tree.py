"""Structured batches: a batch's inputs or targets may be a tensor, or tuples, lists and dicts of
tensors (nested), as ``torch.utils.data.default_collate`` makes them from a dataset's items.

Every strategy moves a batch with :func:`to_device` (a tree map over the tensors, the structure
kept) and counts its samples with :func:`batch_len` (the leading dimension, which every tensor of
the batch must share).  :func:`check_batch` is the pre-start check: anything else in a batch (a
string, a number, tensors with different numbers of samples, no tensor at all) is refused with
one line naming where in the structure it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "BatchError",
    "batch_len",
    "check_batch",
    "leaves",
    "split_batch",
    "take",
    "to_device",
    "tree_map",
]


class BatchError(ValueError):
    """A batch that is not a tensor or a tuple/list/dict of tensors with one number of samples."""


def tree_map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor (tuples, lists and dicts rebuilt alike; a
    named tuple stays one; other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, tree_map(fn, v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(tree_map(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(tree_map(fn, v) for v in value)
    return value


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device``."""
    return tree_map(lambda t: t.to(device), value)


def take(value: Any, index: torch.Tensor) -> Any:
    """The samples ``index`` of every tensor of ``value`` (indexing the leading dimension)."""
    return tree_map(lambda t: t[index], value)


def split_batch(value: Any, parts: int) -> list[Any]:
    """``value`` split along the samples into ``parts`` nearly equal batches (views; the first
    ones one sample larger when they do not divide: ``torch.tensor_split``), the structure kept."""

    def part(i: int) -> Any:
        return tree_map(lambda t: t.tensor_split(parts)[i], value)

    return [part(i) for i in range(parts)]


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` of every leaf of ``value`` (``path`` like ``["ids"][0]``)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def batch_len(value: Any) -> int:
    """The number of samples of a batch: the leading dimension of its first tensor."""
    for _, leaf in leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise BatchError("holds no tensor with a batch dimension")


def check_batch(value: Any, what: str) -> int:
    """The number of samples of ``value`` (module doc), or :class:`BatchError` naming ``what``
    and the offending place."""
    n: int | None = None
    first = ""
    for path, leaf in leaves(value):
        where = f"{what}{path}"
        if not isinstance(leaf, torch.Tensor):
            raise BatchError(
                f"{where} is a {type(leaf).__name__}; a batch holds tensors, "
                "or tuples, lists and dicts of tensors"
            )
        if leaf.dim() == 0:
            raise BatchError(f"{where} is a 0-d tensor; every tensor of a batch needs a batch dimension")
        if n is None:
            n, first = int(leaf.shape[0]), where
        elif int(leaf.shape[0]) != n:
            raise BatchError(f"{where} holds {int(leaf.shape[0])} samples but {first} holds {n}")
    if n is None:
        raise BatchError(f"{what} holds no tensor")
    return n
