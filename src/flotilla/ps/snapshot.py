"""Durable snapshots of one parameter-server shard: parameters, optimizer state, versions, clocks.

File layout (no pickle; safetensors-like)::

    MAGIC (16 bytes) | header length (8 bytes, little endian) | msgpack header | raw tensor bytes

The header names the shard's identity (index, count, chunk_bytes, num_workers), the key layout,
the incarnation, versions, the clock table and joined/departed workers, and, for each tensor,
its slot, kind (``w`` weights / ``m`` momentum / ``p`` gradients not yet folded into momentum /
``s`` weights at the last fold, kept for weight decay), dtype, element count and byte offset in the
payload, plus a CRC-32 of the payload.

Invariants:
- A snapshot is written atomically (temporary file, fsync, rename, fsync of the directory:
  :func:`flotilla.core.atomic_io.atomic_write_bytes`): a crash leaves the previous snapshot or
  the new one, never a torn file.
- :func:`capture` takes references only (the store's tensors are immutable), so it is cheap and
  may be encoded and written by another thread while the store moves on.
- :func:`read_snapshot` validates everything (magic, sizes, msgpack limits, identity, layout,
  offsets, CRC) and raises ``SnapshotError`` naming the file and the problem.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.checks import require_int, require_number
from flotilla.core.errors import ConfigError, RemoteError
from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.config import PSConfig, ServerSGD
from flotilla.ps.consistency import ClockTable
from flotilla.ps.store import ShardStore
from flotilla.ps.wire import TORCH_FLOAT_DTYPES, keys_from_wire, keys_to_wire

__all__ = [
    "MAGIC",
    "Snapshot",
    "SnapshotError",
    "SnapshotPolicy",
    "capture",
    "read_snapshot",
    "restore",
    "snapshot_path",
    "write_snapshot",
]

MAGIC = b"FLOTILLA-PS-SNP2"
OLD_MAGICS = {b"FLOTILLA-PS-SNP1": "format 1 (per-push momentum, before the per-clock rule)"}
MAX_HEADER_BYTES = 64 * 2**20
KINDS = ("w", "m", "p", "s")


class SnapshotError(ConfigError):
    """A snapshot file that cannot be used (corrupt, or written for another shard or layout)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a snapshot holds: a msgpack-able ``meta`` and the tensors it refers to."""

    meta: dict[str, Any]
    tensors: tuple[tuple[int, str, torch.Tensor], ...]  # (slot, kind, flat tensor)

    @property
    def version(self) -> int:
        return int(self.meta["version"])


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotPolicy:
    """Snapshot into ``directory`` every ``every_versions`` pushes and/or ``every_s`` seconds
    (0 disables that trigger); the file is :func:`flotilla.ps.snapshot.snapshot_path`."""

    directory: Path
    every_versions: int = 0
    every_s: float = 0.0

    def __post_init__(self) -> None:
        require_int("SnapshotPolicy", "every_versions", self.every_versions, min=0)
        require_number("SnapshotPolicy", "every_s", self.every_s, min=0.0)

    @classmethod
    def of(cls, ps: PSConfig, directory: Path) -> SnapshotPolicy:
        """The policy of a job's :class:`PSConfig` (``snapshot_every_*``), writing to ``directory``."""
        return cls(
            directory=directory, every_versions=ps.snapshot_every_versions, every_s=ps.snapshot_every_s
        )


def snapshot_path(directory: str | os.PathLike[str], shard_index: int, num_shards: int) -> Path:
    """Where shard ``shard_index`` of ``num_shards`` keeps its snapshot (its identity on disk)."""
    return Path(directory) / f"ps-shard-{shard_index}-of-{num_shards}.snap"


def capture(store: ShardStore, incarnation: int) -> Snapshot:
    """References to the store's current state (cheap: tensors are immutable)."""
    if store.layout is None:
        raise SnapshotError("cannot snapshot a shard that has not been seeded")
    cfg = store.config
    tensors = [(s, "w", w) for s, w in enumerate(store.weights)]
    for kind, buffers in (("m", store.momentum), ("p", store.pending), ("s", store.start)):
        tensors += [
            (s, kind, t) for s, t in enumerate(buffers) if t is not None and t is not store.weights[s]
        ]  # "s" is usually the weights
    meta = {
        "shard_index": cfg.shard_index,
        "num_shards": cfg.num_shards,
        "num_workers": cfg.num_workers,
        "chunk_bytes": cfg.chunk_bytes,
        "keys": keys_to_wire(store.layout.keys),
        "incarnation": incarnation,
        "version": store.version,
        "versions": list(store.versions),
        "clocks": [list(e) for e in store.table.entries],
        "floor": store.table.floor,
        "joined": sorted(store.joined),
        "departed": sorted(store.departed),
        "folded_clock": store.folded_clock,
        "applied": list(store.applied),
    }
    return Snapshot(meta=meta, tensors=tuple(tensors))


def write_snapshot(path: str | os.PathLike[str], snap: Snapshot) -> int:
    """Encode and write ``snap`` atomically; returns the number of bytes written."""
    parts: list[memoryview] = []
    descs, offset, crc = [], 0, 0
    for slot, kind, t in snap.tensors:
        view = t.contiguous().view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        descs.append([slot, kind, str(t.dtype).removeprefix("torch."), t.numel(), offset])
        parts.append(view)
        crc = zlib.crc32(view, crc)
        offset += view.nbytes
    header = msgpack.packb(
        {**snap.meta, "tensors": descs, "payload_bytes": offset, "crc32": crc}, use_bin_type=True
    )
    data = b"".join([MAGIC, len(header).to_bytes(8, "little"), header, *parts])
    atomic_write_bytes(path, data, mode=0o600)
    return len(data)


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load and validate a snapshot file (see the module doc)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"snapshot {p}: cannot read: {exc.strerror}") from None
    if data[:16] in OLD_MAGICS:
        raise SnapshotError(
            f"snapshot {p}: written by an older flotilla, {OLD_MAGICS[data[:16]]}; "
            "it cannot be resumed: delete it to start the shard afresh"
        )
    if len(data) < 24 or data[:16] != MAGIC:
        raise SnapshotError(f"snapshot {p}: not a flotilla PS snapshot (bad magic)")
    head_len = int.from_bytes(data[16:24], "little")
    if head_len > min(MAX_HEADER_BYTES, len(data) - 24):
        raise SnapshotError(f"snapshot {p}: header length {head_len} is out of range")
    try:
        meta = msgpack.unpackb(data[24 : 24 + head_len], raw=False, strict_map_key=True, max_ext_len=0)
        payload = memoryview(data)[24 + head_len :]
        tensors = _tensors(meta, payload)
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {p}: {exc}") from None
    except Exception as exc:
        raise SnapshotError(f"snapshot {p}: malformed header ({type(exc).__name__}: {exc})") from None
    meta = {k: v for k, v in meta.items() if k not in ("tensors", "payload_bytes", "crc32")}
    return Snapshot(meta=meta, tensors=tensors)


def _tensors(meta: Any, payload: memoryview) -> tuple[tuple[int, str, torch.Tensor], ...]:
    if not isinstance(meta, dict) or meta.get("payload_bytes") != payload.nbytes:
        raise SnapshotError("payload length does not match the header (truncated file?)")
    if zlib.crc32(payload) != meta.get("crc32"):
        raise SnapshotError("payload CRC mismatch (corrupt file)")
    out = []
    for slot, kind, dtype_name, numel, offset in meta["tensors"]:
        dtype = TORCH_FLOAT_DTYPES.get(dtype_name)
        nbytes = numel * (dtype.itemsize if dtype is not None else 0)
        if dtype is None or kind not in KINDS or offset < 0 or offset + nbytes > payload.nbytes:
            raise SnapshotError(f"bad tensor descriptor {[slot, kind, dtype_name, numel, offset]}")
        raw = bytearray(payload[offset : offset + nbytes])
        t = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        out.append((int(slot), kind, t))
    return tuple(out)


def restore(store: ShardStore, snap: Snapshot) -> int:
    """Load ``snap`` into a fresh ``store``; returns the snapshot's incarnation.

    Raises ``SnapshotError`` if it was written for another shard identity or is inconsistent.
    """
    cfg, meta = store.config, snap.meta
    mine = (cfg.shard_index, cfg.num_shards, cfg.num_workers, cfg.chunk_bytes)
    theirs = tuple(meta.get(k) for k in ("shard_index", "num_shards", "num_workers", "chunk_bytes"))
    if mine != theirs:
        raise SnapshotError(
            f"snapshot is for (shard_index, num_shards, num_workers, chunk_bytes) "
            f"= {theirs}, this server is {mine}"
        )
    try:
        layout = store.make_layout(keys_from_wire(meta["keys"]))
    except RemoteError as exc:
        raise SnapshotError(f"snapshot layout is invalid: {exc.message}") from None
    n = len(layout.chunk_ids)
    buffers: dict[str, list[torch.Tensor | None]] = {k: [None] * n for k in KINDS}
    for slot, kind, t in snap.tensors:
        chunk = layout.plan.chunks[layout.chunk_ids[slot]] if 0 <= slot < n else None
        if chunk is None or t.numel() != chunk.num_elems or t.dtype != layout.dtypes[slot]:
            raise SnapshotError(f"snapshot tensor for slot {slot} does not fit the layout")
        buffers[kind][slot] = t
    weights = buffers["w"]
    if any(w is None for w in weights) or len(meta["versions"]) != n:
        raise SnapshotError("snapshot misses weights or versions of some chunks")
    store.layout, store.weights = layout, weights  # type: ignore[assignment]
    store.momentum, store.pending, store.start = buffers["m"], buffers["p"], buffers["s"]
    store.versions = [int(v) for v in meta["versions"]]
    store.version = int(meta["version"])
    store.clocks = ShardClocks(
        num_workers=cfg.num_workers,
        table=ClockTable(tuple((int(w), int(c)) for w, c in meta["clocks"]), floor=int(meta["floor"])),
        joined=frozenset(int(w) for w in meta["joined"]),
        departed=frozenset(int(w) for w in meta["departed"]),
    )
    applied, folded = meta.get("applied"), meta.get("folded_clock")
    if (
        not isinstance(applied, list)
        or len(applied) != n
        or type(folded) is not int
        or any(type(a) is not int or a < 0 for a in applied)
    ):
        raise SnapshotError("snapshot 'applied'/'folded_clock' are missing or do not match the chunks")
    store.applied = list(applied)
    store.folded_clock = folded
    if isinstance(store.config.update, ServerSGD) and store.config.update.weight_decay:
        store.start = [s if s is not None else w for s, w in zip(store.start, store.weights)]
    return int(meta["incarnation"])
