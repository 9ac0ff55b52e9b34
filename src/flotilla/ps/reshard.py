"""A parameter-server job resumed on another number of shards (or the same): the previous
job's shard snapshots merged into one state at a clock boundary and cut into the new job's
shards (issue 36, item 4).  No I/O, no wall clock: snapshots in, snapshots out
(``launch/ps_resume.py`` finds, reads and writes them).

The job's state lives in its shards: each chunk's weights and momentum (``ps/shard_sgd.py``),
and the clocks the workers reached.  The workers hold nothing the servers do not, except a
worker-side optimizer under ``update: delta`` (which restarts, as a mid-run joiner's does).

Rules
- **Complete or refused.**  The snapshots must be every shard ``0..N-1`` of one job (the same
  ``num_shards``, ``chunk_bytes`` and key layout); a missing, repeated or foreign one is refused
  naming it, and so is a chunk size other than the new job's (chunks would not line up) or a
  model whose parameters differ (:func:`check_keys`).
- **Each shard at a clock boundary.**  A lag-0 model's shard (BSP, SSP(0), WSP with D = 0)
  serves the state of its last fold (``ps/versioned_reads.py``): exactly the clocks below its
  ``c_global``; that state is taken, and pushes it logged since (a clock not every worker
  finished) are left out.  Any other shard applies a push when it arrives: its weights hold
  every push it acknowledged, and its gradients not yet folded into momentum are folded now,
  as its next fold would have (:meth:`ShardSGD._fold`).  A shard's **reach** is the clock it
  stands at: its last fold's ``c_global`` (lag-0), else the highest clock a worker reached on
  it (live or departed).
- **One resume clock, no sample twice.**  The new job starts at ``resume_at``, the highest
  reach: no clock below it is trained again, so no sample of the interrupted epoch is used
  twice.  Where a shard stands behind it (a shard that died after its last snapshot, a clock
  half-finished at a stop), the pushes it does not hold are lost to it, and a slow worker's
  slices of clocks it never computed are dropped: :attr:`Resumed.behind` counts the clocks
  each shard's chunks lack, and the launcher says so (a clean stop has none).
- **Fresh clocks, the same chunks.**  Each new shard holds the chunks the new layout
  (``ps/sharding.py``, N -> M) gives it, with the merged weights and momentum, versions 0, an
  empty clock table whose floor is ``resume_at``, a first fold at ``resume_at`` and its
  ``resume_at`` set, so a worker's first hello at clock 0 joins at ``resume_at``
  (``ps/clock_rules.py``) and shard 0's first data view starts there.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath

import torch

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.config import ShardConfig
from flotilla.ps.consistency import ASP, BSP, ClockTable, allowed_lag, wave_size_of
from flotilla.ps.sharding import ChunkId, KeySpec
from flotilla.ps.snapshot import Snapshot, SnapshotError, capture, restore, snapshot_path
from flotilla.ps.store import ShardStore

__all__ = ["ResumeError", "Resumed", "check_keys", "merge", "reshard"]


class ResumeError(ConfigError):
    """Snapshots that cannot be resumed as asked (one line naming the file or the field)."""


@dataclass(frozen=True, slots=True)
class Resumed:
    """The previous job's state at ``resume_at``: each chunk's weights and momentum."""

    keys: tuple[KeySpec, ...]
    chunk_bytes: int
    num_shards: int  # the previous job's
    resume_at: int  # the clock the new job starts at
    weights: dict[ChunkId, torch.Tensor]
    momentum: dict[ChunkId, torch.Tensor]  # (chunks without momentum are absent)
    reach: tuple[int, ...]  # per previous shard: the clock it stood at
    behind: tuple[int, ...]  # per previous shard: worker-clocks below resume_at its chunks lack


def merge(snaps: Sequence[Snapshot], template: ShardConfig) -> Resumed:
    """The state of the job whose shards wrote ``snaps`` (see the module doc).  ``template``:
    the new job's rules (consistency, update rule, chunk size), used to restore each shard (its
    own lag-0-ness is read from its snapshot) and to fold its pending gradients."""
    if not snaps:
        raise ResumeError("no parameter-server snapshot to resume from")
    first = snaps[0].meta
    n, chunk_bytes = _int(snaps[0], "num_shards"), _int(snaps[0], "chunk_bytes")
    by_index: dict[int, Snapshot] = {}
    for snap in snaps:
        for name, want in (("num_shards", n), ("chunk_bytes", chunk_bytes)):
            if _int(snap, name) != want:
                got = snap.meta.get(name)
                raise ResumeError(f"snapshot {snap.source}: {name} {got} is not {want} (another job?)")
        for name in ("layout_digest", "data_key", "wave_size"):
            if snap.meta.get(name) != first.get(name):
                what = "key layout" if name == "layout_digest" else name
                other = snaps[0].source
                raise ResumeError(f"snapshot {snap.source}: its {what} is not {other}'s (another job?)")
        i = _int(snap, "shard_index")
        if i in by_index or not 0 <= i < n:
            raise ResumeError(f"snapshot {snap.source}: shard {i} of {n} is out of range or given twice")
        by_index[i] = snap
    missing = [i for i in range(n) if i not in by_index]
    if missing:
        where = snapshot_path(_dir_of(snaps[0].source), missing[0], n)
        raise ResumeError(
            f"the previous job had {n} shard(s); the snapshot of shard {missing[0]} is missing ({where}): "
            "a resume needs every shard's state"
        )
    _same_data(snaps[0], template)
    if chunk_bytes != template.chunk_bytes:
        raise ResumeError(
            f"strategy.chunk_bytes: the snapshots were written with {chunk_bytes}, this job has "
            f"{template.chunk_bytes}; resume with the same chunk_bytes"
        )
    stores = [_canonical(by_index[i], template) for i in range(n)]
    keys = stores[0][0].layout.keys  # type: ignore[union-attr]
    reach = tuple(r for _, r, _ in stores)
    resume_at = max(reach)
    weights: dict[ChunkId, torch.Tensor] = {}
    momentum: dict[ChunkId, torch.Tensor] = {}
    behind = []
    for store, at, lag0 in stores:
        layout = store.layout
        assert layout is not None
        for slot, cid in enumerate(layout.chunk_ids):
            chunk = layout.plan.chunks[cid].chunk_id
            weights[chunk] = store.weights[slot]
            m = store.momentum[slot]
            if m is not None:
                momentum[chunk] = m
        if lag0:  # (its state is its last fold's: every worker's clocks from there on)
            behind.append((resume_at - at) * max(1, len(store.table.entries)))
        else:
            behind.append(sum(resume_at - c for _, c in store.table.entries if c < resume_at))
    return Resumed(
        keys=tuple(keys),
        chunk_bytes=chunk_bytes,
        num_shards=n,
        resume_at=resume_at,
        weights=weights,
        momentum=momentum,
        reach=reach,
        behind=tuple(behind),
    )


def check_keys(resumed: Resumed, keys: Sequence[KeySpec], source: str) -> None:
    """``ResumeError`` naming the first parameter of the job's model that the snapshots in
    ``source`` do not hold alike (name, shape, dtype), or the first they hold that it lacks."""
    have = {k.name: k for k in resumed.keys}
    want = {k.name: k for k in keys}
    for name, k in want.items():
        got = have.get(name)
        if got is None:
            raise ResumeError(
                f"--resume {source}: the model's parameter {name!r} is not in the snapshots (another model?)"
            )
        if (got.shape, got.dtype) != (k.shape, k.dtype):
            raise ResumeError(
                f"--resume {source}: parameter {name!r} is {k.dtype}{list(k.shape)} in this model, "
                f"{got.dtype}{list(got.shape)} in the snapshots (another model?)"
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ResumeError(
            f"--resume {source}: the snapshots hold {extra[0]!r}, which this model lacks (another model?)"
        )


def reshard(resumed: Resumed, template: ShardConfig, keys: Sequence[KeySpec] | None = None) -> list[Snapshot]:
    """The new job's shard snapshots (``template.num_shards`` of them; see the module doc).
    ``keys``: the job's model's, in its order (the layout digest the workers check depends on
    it; :func:`check_keys` first); default the snapshots'."""
    resumed = replace(resumed, keys=tuple(keys)) if keys is not None else resumed
    out = []
    for j in range(template.num_shards):
        config = replace(template, shard_index=j)
        store = ShardStore(config)
        store.clocks = ShardClocks(
            num_workers=config.num_workers,
            keeps_views=j == 0,
            table=ClockTable((), floor=resumed.resume_at),
            resume_at=resumed.resume_at,
        )
        layout = store.make_layout(resumed.keys)
        chunks = [layout.plan.chunks[c].chunk_id for c in layout.chunk_ids]
        store.seed(list(resumed.keys), list(layout.chunk_ids), [resumed.weights[c] for c in chunks])
        store.momentum = [resumed.momentum.get(c) for c in chunks]
        out.append(capture(store, secrets.randbits(52), {"updates_lost": 0}))
    return out


# ----------------------------------------------------------------------------- one old shard
def _canonical(snap: Snapshot, template: ShardConfig) -> tuple[ShardStore, int, bool]:
    """``snap``'s shard restored and brought to a clock boundary, its reach, and whether it
    kept a lag-0 model's fold state (module doc)."""
    lag0 = "fold_state" in snap.meta
    consistency = template.consistency
    if (allowed_lag(consistency) == 0) != lag0:
        consistency = BSP() if lag0 else ASP()
    try:
        config = replace(
            template,
            shard_index=_int(snap, "shard_index"),
            num_shards=_int(snap, "num_shards"),
            num_workers=_int(snap, "num_workers"),
            consistency=consistency,
        )
    except FlotillaError as exc:
        why = f"cannot be restored under this job's rules: {exc}"
        raise ResumeError(f"snapshot {snap.source}: {why}") from None
    store = ShardStore(config)
    try:
        restore(store, snap)
    except SnapshotError as exc:
        raise ResumeError(str(exc)) from None
    served = store.served_state()
    if lag0 and served is not None:
        weights, _, _, reach = served
        start = store._start  # (the fold's pending sums and shares: none after a fold)
        store.weights = list(weights)
        if start is not None:
            store.pending, store.applied = list(start[1]), list(start[2])
    else:
        reach = max(store.clocks.top, store.clocks.high)
    if any(p is not None for p in store.pending) or any(store.applied):
        store._fold()  # the pending gradients into momentum, the shares not yet taken
    return store, reach, lag0 and served is not None


def _same_data(snap: Snapshot, template: ShardConfig) -> None:
    """The new job must draw the same samples at a clock as the old one: the same data, seed
    and global batch (``data_key``), the same steps per clock (``wave_size``).  (Snapshots
    written before they carried these are not checked.)"""
    key, wave = snap.meta.get("data_key"), snap.meta.get("wave_size")
    if key and template.data_key and key != template.data_key:
        raise ResumeError(
            f"snapshot {snap.source}: it was written by a job with other data (the task, its data, "
            "job.seed or job.batch_size differ): a resume would not continue its data order"
        )
    if wave is not None and wave != wave_size_of(template.consistency):
        raise ResumeError(
            f"strategy.consistency: the snapshots were written with {wave} step(s) per clock (WSP's "
            f"s_local + 1), this job has {wave_size_of(template.consistency)}; resume with the same"
        )


def _int(snap: Snapshot, name: str) -> int:
    value = snap.meta.get(name)
    if type(value) is not int:
        raise ResumeError(f"snapshot {snap.source}: its {name} is missing or not an integer")
    return value


def _dir_of(source: str) -> str:
    return str(PurePath(source).parent) if source else "."
