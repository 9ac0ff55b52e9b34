"""Key -> shard map of the parameter server (SPEC §1).  Pure: sizes in bytes, no torch.

Every parameter tensor is a *key*.  A key larger than ``chunk_bytes`` is split along its
flattened element index into near-equal *chunks* (each at most ``chunk_bytes``); smaller keys are
one chunk.  Chunks are assigned to ``num_shards`` servers by a deterministic greedy (LPT): largest
chunk first, each to the currently least-loaded shard, ties broken by shard index; equal-sized
chunks are ordered by (key name, chunk index).

Invariants (property-tested in ``tests/unit/test_ps_sharding.py``):
- every element of every key is covered by exactly one chunk; chunks of a key are contiguous and
  ordered by ``chunk_idx``;
- ``chunk.num_bytes <= chunk_bytes`` for every chunk;
- ``max(bytes_per_shard()) <= total / num_shards + largest chunk`` (the greedy bound);
- the plan is a pure function of the *set* of keys and the arguments: the same on every worker
  and every server, whatever order the keys are listed in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from flotilla.core.dtypes import DTYPE_ITEMSIZE as DTYPE_ITEMSIZE  # re-exported: key dtypes
from flotilla.core.errors import ConfigError

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

ChunkId = tuple[str, int]
"""A chunk's identity: ``(key name, chunk_idx)``."""


class ShardingError(ConfigError, ValueError):
    """Invalid sharding input; the message names the field and the allowed values."""


def _canonical_dtype(dtype: str) -> str:
    return dtype.removeprefix("torch.")


@dataclass(frozen=True, kw_only=True, slots=True)
class KeySpec:
    """One PS key: a parameter tensor described by its name, shape, dtype and size in bytes.

    ``num_bytes`` must equal ``prod(shape) * itemsize(dtype)``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ShardingError(f"KeySpec.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.shape, tuple) or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise ShardingError(f"KeySpec.shape must be a tuple of ints >= 0, got {self.shape!r}")
        if _canonical_dtype(self.dtype) not in DTYPE_ITEMSIZE:
            raise ShardingError(f"KeySpec.dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        expected = self.num_elems * self.itemsize
        if self.num_bytes != expected:
            raise ShardingError(
                f"KeySpec.num_bytes must equal prod(shape) * itemsize = {expected} for key "
                f"{self.name!r}, got {self.num_bytes!r}"
            )

    @classmethod
    def of(cls, name: str, shape: Sequence[int], dtype: str) -> KeySpec:
        """Build a spec computing ``num_bytes`` from shape and dtype."""
        shape_t = tuple(shape)
        itemsize = DTYPE_ITEMSIZE.get(_canonical_dtype(dtype))
        if itemsize is None:
            raise ShardingError(f"KeySpec.dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {dtype!r}")
        return cls(name=name, shape=shape_t, dtype=dtype, num_bytes=math.prod(shape_t) * itemsize)

    @property
    def num_elems(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[_canonical_dtype(self.dtype)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """Elements ``[offset_elems, offset_elems + num_elems)`` of key ``key``'s flattened tensor."""

    key: str
    chunk_idx: int
    offset_elems: int
    num_elems: int
    num_bytes: int

    @property
    def chunk_id(self) -> ChunkId:
        return (self.key, self.chunk_idx)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPlan:
    """The result of :func:`plan_shards`: chunks (keys in input order, chunks by index) and the
    shard of each (``assignment[i]`` is the shard of ``chunks[i]``)."""

    num_shards: int
    chunk_bytes: int
    keys: tuple[KeySpec, ...]
    chunks: tuple[Chunk, ...]
    assignment: tuple[int, ...]
    _index: Mapping[ChunkId, int] = field(repr=False, compare=False)
    _by_key: Mapping[str, tuple[int, ...]] = field(repr=False, compare=False)

    def shard_of(self, chunk_id: ChunkId | Chunk) -> int:
        """The shard holding a chunk (given as a :class:`Chunk` or ``(key, chunk_idx)``)."""
        cid = chunk_id.chunk_id if isinstance(chunk_id, Chunk) else tuple(chunk_id)
        try:
            return self.assignment[self._index[cid]]  # type: ignore[index]
        except KeyError:
            raise KeyError(f"unknown chunk {cid!r}") from None

    def chunks_of_shard(self, shard: int) -> tuple[Chunk, ...]:
        """Chunks held by ``shard``, in plan order."""
        if not 0 <= shard < self.num_shards:
            raise ShardingError(f"shard must be in [0, {self.num_shards}), got {shard!r}")
        return tuple(c for c, s in zip(self.chunks, self.assignment, strict=True) if s == shard)

    def chunks_of_key(self, name: str) -> tuple[Chunk, ...]:
        """The chunks of key ``name`` ordered by ``chunk_idx`` (they tile the key exactly)."""
        try:
            return tuple(self.chunks[i] for i in self._by_key[name])
        except KeyError:
            raise KeyError(f"unknown key {name!r}") from None

    def bytes_per_shard(self) -> tuple[int, ...]:
        """Total chunk bytes assigned to each shard."""
        loads = [0] * self.num_shards
        for c, s in zip(self.chunks, self.assignment, strict=True):
            loads[s] += c.num_bytes
        return tuple(loads)

    def index_of(self, chunk_id: ChunkId) -> int:
        """Position of a chunk in ``chunks`` (a compact integer id, e.g. for the wire)."""
        return self._index[tuple(chunk_id)]  # type: ignore[index]


def split_key(key: KeySpec, chunk_bytes: int) -> tuple[Chunk, ...]:
    """Split one key into the fewest near-equal chunks of at most ``chunk_bytes`` each.

    Sizes differ by at most one element; an empty key is one empty chunk.
    """
    if chunk_bytes < key.itemsize:
        raise ShardingError(
            f"chunk_bytes must be >= the itemsize of key {key.name!r} ({key.itemsize}), got {chunk_bytes}"
        )
    per_chunk = chunk_bytes // key.itemsize
    n = max(1, -(-key.num_elems // per_chunk))
    base, extra = divmod(key.num_elems, n)
    chunks, offset = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        chunks.append(
            Chunk(
                key=key.name, chunk_idx=i, offset_elems=offset, num_elems=size, num_bytes=size * key.itemsize
            )
        )
        offset += size
    return tuple(chunks)


def _greedy_assign(chunks: Sequence[Chunk], num_shards: int) -> tuple[int, ...]:
    order = sorted(range(len(chunks)), key=lambda i: (-chunks[i].num_bytes, chunks[i].chunk_id))
    heap = [(0, s) for s in range(num_shards)]  # (load, shard) -> ties by shard index
    assignment = [0] * len(chunks)
    for i in order:
        load, shard = heapq.heappop(heap)
        assignment[i] = shard
        heapq.heappush(heap, (load + chunks[i].num_bytes, shard))
    return tuple(assignment)


def _validate_args(keys: Sequence[KeySpec], num_shards: int, chunk_bytes: int) -> None:
    for name, value in (("num_shards", num_shards), ("chunk_bytes", chunk_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShardingError(f"{name} must be an int >= 1, got {value!r}")
    seen: set[str] = set()
    for k in keys:
        if not isinstance(k, KeySpec):
            raise ShardingError(f"keys must contain KeySpec objects, got {type(k).__name__}")
        if k.name in seen:
            raise ShardingError(f"keys must have unique names, {k.name!r} appears twice")
        seen.add(k.name)


def plan_shards(
    keys: Sequence[KeySpec], num_shards: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> ShardPlan:
    """Chunk ``keys`` and balance the chunks' bytes over ``num_shards`` shards (see module doc)."""
    _validate_args(keys, num_shards, chunk_bytes)
    chunks: list[Chunk] = []
    by_key: dict[str, tuple[int, ...]] = {}
    for k in keys:
        parts = split_key(k, chunk_bytes)
        by_key[k.name] = tuple(range(len(chunks), len(chunks) + len(parts)))
        chunks.extend(parts)
    return ShardPlan(
        num_shards=num_shards,
        chunk_bytes=chunk_bytes,
        keys=tuple(keys),
        chunks=tuple(chunks),
        assignment=_greedy_assign(chunks, num_shards),
        _index=MappingProxyType({c.chunk_id: i for i, c in enumerate(chunks)}),
        _by_key=MappingProxyType(by_key),
    )
