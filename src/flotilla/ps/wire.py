"""The parameter server's wire format: the operations' body schemas (:data:`OPS`), the key
layout as ``[[name, shape, dtype], ...]`` lists, their
validation, the layout digest that servers and workers compare, and the torch dtypes a PS key may
have (:data:`flotilla.core.dtypes.FLOAT_DTYPES`).

Operations (bodies are msgpack maps; tensors are raw frames, see ``docs/ps.md``):

=============  =====================================================  ==========================
op             body                                                   reply
=============  =====================================================  ==========================
``ps.hello``   worker_id, clock, incarnation (last seen, -1 = none)   incarnation, clock, ...
``ps.init``    keys                                                   initialized, chunks
``ps.seed``    keys, chunks  + one tensor per chunk                   seeded
``ps.push``    worker_id, clock, incarnation, base_version, chunks    applied, version, clock
               + one tensor per chunk
``ps.pull``    worker_id, clock, incarnation, chunks, wait_s          version, versions, c_global
                                                                      + one tensor per chunk
``ps.pushpull`` push's body + wait_s, pull_clock + one tensor per chunk as ``ps.pull`` (pull_clock)
``ps.leave``   worker_id, incarnation, finished (its last clock done)  {}
``ps.evict``   worker_id, incarnation, evict (ids declared dead, <= 64) evicted (ids removed)
``ps.stage``   push's body + one tensor per chunk (phase 1)          staged, clock, version
``ps.stage_part`` push's body + part, parts (one part of a VW's clock) staged, clock, version,
               + one tensor per chunk (may be none)                   complete
``ps.commit``  worker_id, incarnation, clock (phase 2)                applied, version, clock
``ps.cpull``   pull's body + commit (staged clock to commit, or -1)   as ``ps.pull``
``ps.vpull``   pull's body + commit, part, parts (a VW part's vote to  as ``ps.pull``, once the
               commit its staged clock, then its pull of clock)       VW's clock is applied
``ps.fence``   worker_id, incarnation, evict                          clocks [[id, committed, staged]]
``ps.resolve`` worker_id, incarnation, evict, upto (target per id)    resolved, failed
``ps.stats``   {}                                                     version, clocks, digest, ...
``ps.snapshot`` {}                                                    version, path, bytes
=============  =====================================================  ==========================

Every reply of shard 0 to a request naming a ``worker_id`` also carries ``data_views``
(``{rev, views: [[start, [worker ids]], ...]}`` from that worker's clock on: ``ps/data_views.py``).

Invariants: a parsed layout holds at most :data:`MAX_KEYS` keys of whitelisted float dtypes with
int shapes; a malformed one raises ``RemoteError("layout")`` and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flotilla.core.dtypes import FLOAT_DTYPES, canonical_dtype
from flotilla.core.errors import ConfigError, RemoteError
from flotilla.ps.sharding import KeySpec, ShardingError

__all__ = [
    "MAX_KEYS",
    "OPS",
    "TORCH_FLOAT_DTYPES",
    "dtype_name",
    "flatten",
    "keys_from_wire",
    "keys_of",
    "keys_to_wire",
    "layout_digest",
    "torch_dtype",
    "writable",
]

MAX_KEYS = 100_000

_PUSH = {"worker_id": int, "clock": int, "incarnation": int, "base_version": int, "chunks": list}
_PULL = {"worker_id": int, "clock": int, "incarnation": int, "chunks": list, "wait_s": float}
OPS: dict[str, tuple[dict[str, Any], int | None]] = {
    "ps.hello": ({"worker_id": int, "clock": int, "incarnation": int}, 0),
    "ps.init": ({"keys": list}, 0),
    "ps.seed": ({"keys": list, "chunks": list}, None),
    "ps.push": (_PUSH, None),
    "ps.pull": (_PULL, 0),
    "ps.pushpull": ({**_PUSH, "wait_s": float, "pull_clock": int}, None),
    "ps.leave": ({"worker_id": int, "incarnation": int, "finished": bool}, 0),
    "ps.evict": ({"worker_id": int, "incarnation": int, "evict": list}, 0),
    "ps.stage": (_PUSH, None),
    "ps.stage_part": ({**_PUSH, "part": int, "parts": int}, None),
    "ps.commit": ({"worker_id": int, "incarnation": int, "clock": int}, 0),
    "ps.cpull": ({**_PULL, "commit": int}, 0),
    "ps.vpull": ({**_PULL, "commit": int, "part": int, "parts": int}, 0),
    "ps.fence": ({"worker_id": int, "incarnation": int, "evict": list}, 0),
    "ps.resolve": ({"worker_id": int, "incarnation": int, "evict": list, "upto": list}, 0),
    "ps.stats": ({}, 0),
    "ps.snapshot": ({}, 0),
}
"""Every PS operation: its request body schema and the most tensor frames it may carry
(``None``: any number), as the message plane checks them before a handler runs."""
TORCH_FLOAT_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in sorted(FLOAT_DTYPES)}
"""The dtypes a PS key may have, by name."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a key's dtype name (``float32`` or ``torch.float32``)."""
    return TORCH_FLOAT_DTYPES[canonical_dtype(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def keys_of(tensors: Mapping[str, torch.Tensor]) -> tuple[KeySpec, ...]:
    """The PS keys (name, shape, dtype) of named tensors, in the mapping's order."""
    return tuple(KeySpec.of(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items())


def flatten(keys: Sequence[KeySpec], values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every key's tensor of ``values`` as a flat view (no copy); ``ConfigError`` if one is
    missing or differs from the layout."""
    flats = {}
    for key in keys:
        t = values.get(key.name)
        if t is None:
            raise ConfigError(f"no tensor for PS key {key.name!r}")
        if tuple(t.shape) != key.shape or dtype_name(t.dtype) != canonical_dtype(key.dtype):
            raise ConfigError(
                f"tensor for key {key.name!r} is {t.dtype} {tuple(t.shape)}, "
                f"the layout says {key.dtype} {key.shape}"
            )
        flats[key.name] = t.detach().reshape(-1)
    return flats


def writable(out: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``out`` if every tensor is contiguous (a pull writes into them in place)."""
    bad = [name for name, t in out.items() if not t.is_contiguous()]
    if bad:
        raise ConfigError(f"pull: tensors {bad[:4]} are not contiguous; pull writes in place")
    return out


def keys_to_wire(keys: Sequence[KeySpec]) -> list[list[object]]:
    return [[k.name, list(k.shape), canonical_dtype(k.dtype)] for k in keys]


def keys_from_wire(raw: object) -> tuple[KeySpec, ...]:
    """Parse ``[[name, shape, dtype], ...]``; raises ``RemoteError("layout")``."""
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_KEYS:
        raise RemoteError("layout", f"keys must be a non-empty list of at most {MAX_KEYS} entries")
    out = []
    for item in raw:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[1], list)
            and all(type(d) is int for d in item[1])
        ):
            raise RemoteError("layout", "every key must be [name, shape (list of ints), dtype]")
        if item[2] not in TORCH_FLOAT_DTYPES:
            raise RemoteError(
                "layout", f"key dtype must be one of {sorted(TORCH_FLOAT_DTYPES)}, got {item[2]!r}"
            )
        try:
            out.append(KeySpec.of(item[0], tuple(item[1]), item[2]))
        except (ShardingError, TypeError) as exc:
            raise RemoteError("layout", str(exc)) from None
    return tuple(out)


def layout_digest(keys: Sequence[KeySpec], num_shards: int, chunk_bytes: int) -> str:
    """Digest of a layout and its sharding parameters (servers refuse a different one)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((keys_to_wire(keys), num_shards, chunk_bytes)).encode())
    return h.hexdigest()
