"""Durable snapshots of one parameter-server shard: parameters, optimizer state, versions, clocks.

File format (format 3; no pickle): one **safetensors** file per shard, readable by any safetensors
tool.  Its tensors are the shard's flat chunk buffers, named ``<kind>.<slot>``: ``w`` weights,
``m`` momentum, ``p`` gradients not yet folded into momentum, ``s`` weights at the last fold (kept
for weight decay, absent when they are the weights); under a lag-0 model (BSP) also ``fw``/``fp``
the weights and pending sums of the last fold where they differ, and ``g<k>`` the k-th push logged
since (``ps/versioned_reads.py``).  Its ``__metadata__`` header holds three strings::

    format    "flotilla-ps-snapshot/3"
    manifest  JSON: the shard's identity (shard_index, num_shards, num_workers, chunk_bytes), the
              key layout and its digest, the incarnation, versions, the clock table, joined and
              departed workers (and which of them were evicted), the fold state (folded_clock, applied;
              lag-0 models: fold_state, the last fold's versions and the log of pushes since)
    crc32     CRC-32 (decimal) of the manifest and of every tensor's name, dtype, shape and bytes

Invariants:
- A snapshot is written atomically (temporary file, fsync, rename, fsync of the directory:
  :func:`flotilla.core.atomic_io.atomic_write_bytes`), mode 0600: a crash leaves the previous
  snapshot or the new one, never a torn file.  One file holds everything, so there is no manifest
  that could name tensors of another write.
- :func:`capture` takes references only (the store's tensors are immutable), so it is cheap and
  may be encoded and written by another thread while the store moves on.
- :func:`read_snapshot` validates everything (header length, safetensors structure, format, CRC,
  tensor names and dtypes) and :func:`restore` the identity and layout; both raise a one-line
  ``SnapshotError`` naming the file and the problem, and a refused snapshot changes nothing.
- Files of the older hand-written formats (``FLOTILLA-PS-SNP1``/``SNP2`` magic) are refused with
  advice to delete them.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.checks import require_int, require_number
from flotilla.core.errors import ConfigError, FlotillaError, RemoteError
from flotilla.ps import data_views
from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.config import PSConfig, ServerSGD
from flotilla.ps.consistency import ClockTable, wave_size_of
from flotilla.ps.data_views import DataViews, Dropped
from flotilla.ps.store import ShardStore
from flotilla.ps.versioned_reads import FOLD_KINDS, LOG_KIND, check_fold_state
from flotilla.ps.wire import TORCH_FLOAT_DTYPES, dtype_name, keys_from_wire, keys_to_wire

__all__ = [
    "FORMAT",
    "Snapshot",
    "SnapshotError",
    "SnapshotPolicy",
    "capture",
    "decode_snapshot",
    "encode_snapshot",
    "read_snapshot",
    "restore",
    "snapshot_path",
    "write_snapshot",
]

FORMAT = "flotilla-ps-snapshot/3"
OLD_MAGICS = {
    b"FLOTILLA-PS-SNP1": "format 1 (per-push momentum, before the per-clock rule)",
    b"FLOTILLA-PS-SNP2": "format 2 (hand-written, before safetensors)",
}
MAX_HEADER_BYTES = 64 * 2**20
KINDS = ("w", "m", "p", "s")
_IDENTITY = ("shard_index", "num_shards", "num_workers", "chunk_bytes")


class SnapshotError(ConfigError):
    """A snapshot file that cannot be used (corrupt, or written for another shard or layout)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a snapshot holds: a JSON-able ``meta`` and the tensors it refers to; ``source`` names
    the file it was read from (empty for a fresh capture)."""

    meta: dict[str, Any]
    tensors: tuple[tuple[int, str, torch.Tensor], ...]  # (slot, kind, flat tensor)
    source: str = ""

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


def capture(store: ShardStore, incarnation: int, extra: dict[str, Any] | None = None) -> Snapshot:
    """References to the store's current state (cheap: tensors are immutable); ``extra``: more
    JSON-able manifest entries (e.g. ``updates_lost``, ``ps/server_snapshots.py``), kept as read."""
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
        "layout_digest": store.layout.digest,
        "incarnation": incarnation,
        "version": store.version,
        "versions": list(store.versions),
        "clocks": [list(e) for e in store.table.entries],
        "floor": store.table.floor,
        "joined": sorted(store.joined),
        "departed": sorted(store.departed),
        "evicted": sorted(store.clocks.evicted),  # (the momentum shares' divisor: ps/shard_sgd.py)
        "high": store.clocks.high,  # (the join bound: ps/clock_rules.py)
        "resume_at": store.clocks.resume_at,  # (a resumed job's first clock: ps/reshard.py)
        "data_key": cfg.data_key,  # which samples a clock draws, and how many steps it is (ps/reshard)
        "wave_size": wave_size_of(cfg.consistency),
        **views_meta(store.clocks.views),  # (shard 0: the data views, ps/data_views.py)
        "folded_clock": store.folded_clock,
        "applied": list(store.applied),
    }
    fold_meta, fold_tensors = store.fold_snapshot()  # lag-0 models: ps/versioned_reads.py
    meta.update(fold_meta)
    return Snapshot(meta={**(extra or {}), **meta}, tensors=(*tensors, *fold_tensors))


def views_meta(views: DataViews) -> dict[str, Any]:
    """The manifest entries of a shard's data views (none while it has none)."""
    if not views.rev:
        return {}
    return {
        "data_views": views.to_wire(),
        "dropped": [[d.worker_id, d.first, d.stop, d.why] for d in views.dropped],
        "dropped_overflow": views.dropped_overflow,
    }


def views_from_meta(meta: dict[str, Any]) -> DataViews:
    """The data views a manifest holds (empty if it has none); ``SnapshotError`` if malformed."""
    if "data_views" not in meta:
        return DataViews()
    try:
        rev, entries = data_views.from_wire(meta["data_views"])
        dropped = tuple(Dropped(int(w), int(a), int(b), str(why)) for w, a, b, why in meta.get("dropped", []))
        overflow = int(meta.get("dropped_overflow", 0))
    except (ValueError, TypeError) as exc:
        raise SnapshotError(f"its data views are malformed: {exc}") from None
    return DataViews(views=entries, dropped=dropped, rev=rev, dropped_overflow=overflow)


# ----------------------------------------------------------------------------- encoding
def _crc(manifest: str, tensors: dict[str, torch.Tensor]) -> int:
    crc = zlib.crc32(manifest.encode())
    for name in sorted(tensors):
        t = tensors[name]
        crc = zlib.crc32(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data, crc)
    return crc


def encode_snapshot(snap: Snapshot) -> bytes:
    """The safetensors bytes of ``snap`` (see the module doc)."""
    # copies: safetensors refuses tensors sharing storage (chunks may be views of one buffer)
    tensors = {f"{kind}.{slot}": t.detach().reshape(-1).clone() for slot, kind, t in snap.tensors}
    manifest = json.dumps(snap.meta, sort_keys=True, separators=(",", ":"))
    crc = _crc(manifest, tensors)
    return st_save(tensors, metadata={"format": FORMAT, "manifest": manifest, "crc32": str(crc)})


def write_snapshot(path: str | os.PathLike[str], snap: Snapshot) -> int:
    """Encode and write ``snap`` atomically (mode 0600); returns the number of bytes written."""
    data = encode_snapshot(snap)
    atomic_write_bytes(path, data, mode=0o600)
    return len(data)


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load and validate a snapshot file (see the module doc)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"snapshot {p}: cannot read: {exc.strerror}") from None
    return decode_snapshot(data, str(p))


def decode_snapshot(data: bytes, source: str) -> Snapshot:
    """Validate and decode the bytes of a snapshot; errors name ``source``."""
    if data[:16] in OLD_MAGICS:
        raise SnapshotError(
            f"snapshot {source}: written by an older flotilla, {OLD_MAGICS[data[:16]]}; "
            "it cannot be resumed: delete it to start the shard afresh"
        )
    try:
        return _decode(data, source)
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {source}: {exc}") from None
    except Exception as exc:  # anything else a corrupt file provokes: one line, naming the file
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise SnapshotError(f"snapshot {source}: malformed ({why})") from None


def _decode(data: bytes, source: str) -> Snapshot:
    head_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < head_len <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise SnapshotError(f"header length {head_len} is out of range (truncated or not a snapshot?)")
    try:
        header = json.loads(data[8 : 8 + head_len])
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise SnapshotError(f"corrupt header ({exc}; truncated or corrupt file?)") from None
    info = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SnapshotError(f"not a flotilla PS snapshot (no {FORMAT!r} metadata)")
    manifest, crc = info.get("manifest"), info.get("crc32")
    if not isinstance(manifest, str) or not isinstance(crc, str) or not crc.isdigit():
        raise SnapshotError("metadata 'manifest'/'crc32' are missing")
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        why = " ".join(str(exc).split())
        raise SnapshotError(f"invalid safetensors data ({why}; truncated or corrupt file?)") from None
    if _crc(manifest, tensors) != int(crc):
        raise SnapshotError("CRC mismatch (corrupt file)")
    meta = json.loads(manifest)  # covered by the CRC: valid unless written so
    if not isinstance(meta, dict):
        raise SnapshotError("the manifest is not a JSON object")
    entries = sorted((_entry(name, t) for name, t in tensors.items()), key=lambda e: (e[1], e[0]))
    return Snapshot(meta=meta, tensors=tuple(entries), source=source)


def _entry(name: str, t: torch.Tensor) -> tuple[int, str, torch.Tensor]:
    kind, _, slot = name.partition(".")
    known = kind in KINDS or kind in FOLD_KINDS or (kind[:1] == LOG_KIND and kind[1:].isdigit())
    if not known or len(kind) > 10 or not (slot.isascii() and slot.isdigit()) or len(slot) > 9:
        raise SnapshotError(f"unexpected tensor {name!r}")
    if t.dtype not in TORCH_FLOAT_DTYPES.values() or t.dim() != 1:
        raise SnapshotError(f"tensor {name!r} has dtype {t.dtype} and shape {list(t.shape)}")
    return int(slot), kind, t


# ----------------------------------------------------------------------------- restoring
def restore(store: ShardStore, snap: Snapshot) -> int:
    """Load ``snap`` into a fresh ``store``; returns the snapshot's incarnation.

    Raises ``SnapshotError`` (naming ``snap.source``) if it was written for another shard identity
    or layout or is inconsistent; the store is then unchanged.
    """
    try:
        return _restore(store, snap)
    except SnapshotError as exc:
        raise SnapshotError(f"snapshot {snap.source or '(in memory)'}: {exc}") from None
    except (KeyError, TypeError, ValueError, FlotillaError) as exc:
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise SnapshotError(f"snapshot {snap.source or '(in memory)'}: malformed manifest ({why})") from None


def _restore(store: ShardStore, snap: Snapshot) -> int:
    cfg, meta = store.config, snap.meta
    mine = (cfg.shard_index, cfg.num_shards, cfg.num_workers, cfg.chunk_bytes)
    theirs = tuple(meta.get(k) for k in _IDENTITY)
    if mine != theirs:
        raise SnapshotError(
            f"it is for ({', '.join(_IDENTITY)}) = {theirs}, this server is {mine}: "
            "use the snapshot directory of this job or start afresh"
        )
    try:
        layout = store.make_layout(keys_from_wire(meta["keys"]))
    except RemoteError as exc:
        raise SnapshotError(f"its layout is invalid: {exc.message}") from None
    if meta.get("layout_digest") != layout.digest:
        raise SnapshotError(f"its layout digest {meta.get('layout_digest')} is not {layout.digest}")
    n = len(layout.chunk_ids)
    buffers: dict[str, list[torch.Tensor | None]] = {k: [None] * n for k in KINDS}
    fold_tensors: dict[tuple[int, str], torch.Tensor] = {}  # the fold state's (versioned_reads)
    for slot, kind, t in snap.tensors:
        chunk = layout.plan.chunks[layout.chunk_ids[slot]] if 0 <= slot < n else None
        if chunk is None or t.numel() != chunk.num_elems or t.dtype != layout.dtypes[slot]:
            raise SnapshotError(f"its tensor {kind}.{slot} does not fit the layout")
        if kind in buffers:
            buffers[kind][slot] = t
        else:
            fold_tensors[(slot, kind)] = t
    fold_state = meta.get("fold_state")
    if fold_state is not None:
        try:
            check_fold_state(fold_state, n, set(fold_tensors))
        except ValueError as exc:
            raise SnapshotError(str(exc)) from None
    if any(w is None for w in buffers["w"]) or len(meta["versions"]) != n:
        raise SnapshotError("it misses weights or versions of some chunks")
    applied, folded = meta.get("applied"), meta.get("folded_clock")
    if (
        not isinstance(applied, list)
        or len(applied) != n
        or type(folded) is not int
        or any(type(a) is not int or a < 0 for a in applied)
    ):
        raise SnapshotError("its 'applied'/'folded_clock' are missing or do not match the chunks")
    departed = frozenset(int(w) for w in meta["departed"])
    evicted = frozenset(int(w) for w in meta.get("evicted", []))  # (absent from older snapshots)
    if not evicted <= departed:
        raise SnapshotError(f"its evicted workers {sorted(evicted - departed)} never departed")
    views = views_from_meta(meta)
    clocks = ShardClocks(
        num_workers=cfg.num_workers,
        keeps_views=cfg.shard_index == 0,
        high=int(meta.get("high", 0)),  # (absent from older snapshots)
        resume_at=int(meta.get("resume_at", 0)),
        views=views,
        table=ClockTable(tuple((int(w), int(c)) for w, c in meta["clocks"]), floor=int(meta["floor"])),
        joined=frozenset(int(w) for w in meta["joined"]),
        departed=departed,
        evicted=evicted,
    )
    versions = [int(v) for v in meta["versions"]]
    version, incarnation = int(meta["version"]), int(meta["incarnation"])
    # everything is validated: only now does the store change
    store.layout, store.weights = layout, buffers["w"]  # type: ignore[assignment]
    store.momentum, store.pending, store.start = buffers["m"], buffers["p"], buffers["s"]
    store.versions, store.version, store.clocks = versions, version, clocks
    store.applied, store.folded_clock = list(applied), folded
    if isinstance(cfg.update, ServerSGD) and cfg.update.weight_decay:
        store.start = [s if s is not None else w for s, w in zip(store.start, store.weights)]
    store.restore_fold_state(fold_state, fold_tensors)  # lag-0 models (ps/versioned_reads.py)
    return incarnation
