"""Updates lost to a shard restart (``ps/server_snapshots.AccountedStore``): a worker that re-says
hello after a restart at a clock past the one the resumed state recorded for it lost exactly the
difference; the count travels in the snapshot manifest, so it adds up over restarts.  And the
launcher's default snapshot cadence for strategy ps (``launch/ps_shards.with_default_snapshots``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.config import load_config
from flotilla.launch.ps_shards import DEFAULT_SNAPSHOT_EVERY_S, with_default_snapshots
from flotilla.ps.consistency import BSP
from flotilla.ps.server_snapshots import SnapshotPolicy, SnapshottingShard
from flotilla.ps.sharding import KeySpec
from flotilla.ps.store import DeltaUpdate, ShardConfig

pytestmark = pytest.mark.timeout(30)
KEYS = (KeySpec.of("w", (40,), "float32"),)
ROOT = Path(__file__).resolve().parents[2]


def shard(tmp_path: Path) -> SnapshottingShard:
    cfg = ShardConfig(
        shard_index=0, num_shards=1, num_workers=2, consistency=BSP(), update=DeltaUpdate(), chunk_bytes=64
    )
    return SnapshottingShard(cfg, snapshots=SnapshotPolicy(directory=tmp_path))


def push_clocks(s: SnapshottingShard, worker: int, clocks: range) -> None:
    ids = list(s.store.layout.chunk_ids)  # type: ignore[union-attr]
    sizes = [s.store.layout.plan.chunks[c].num_elems for c in ids]  # type: ignore[union-attr]
    for c in clocks:
        s.store.push(worker, c, s.store.version, ids, [torch.ones(n) for n in sizes])


def test_a_resync_past_the_resumed_state_counts_the_lost_updates_and_they_add_up(tmp_path: Path) -> None:
    first = shard(tmp_path)
    layout = first.store.make_layout(KEYS)
    ids = list(layout.chunk_ids)
    first.store.seed(list(KEYS), ids, [torch.zeros(layout.plan.chunks[c].num_elems) for c in ids])
    for w in (0, 1):
        assert first.store.hello(w, 0, resync=True) == 0  # a first hello: a join, nothing lost
    push_clocks(first, 0, range(0, 3))
    push_clocks(first, 1, range(0, 3))
    first.snapshot_now()  # clocks 3 and 3 on disk
    push_clocks(first, 0, range(3, 5))  # acknowledged, never snapshotted: lost with the process
    assert first.store.updates_lost == 0

    second = shard(tmp_path)  # the restart resumes from the snapshot
    assert second.restored_from is not None and second.store.version == 6
    assert second.store.hello(0, 5, resync=True) == 5  # worker 0 says it had 5 acknowledged
    assert second.store.hello(1, 3, resync=True) == 3  # worker 1 lost nothing
    assert second.store.hello(1, 3, resync=True) == 3  # a repeated hello counts nothing again
    assert second.store.updates_lost == 2
    push_clocks(second, 1, range(3, 4))
    second.snapshot_now()

    third = shard(tmp_path)  # the count is in the manifest: it adds up over restarts
    assert third.store.updates_lost == 2
    assert third.store.hello(1, 5, resync=True) == 5
    assert third.store.updates_lost == 3


def test_ps_jobs_snapshot_by_default_unless_told_otherwise() -> None:
    cfg = load_config(ROOT / "examples" / "ps_ssp.yaml")
    assert cfg.strategy.snapshot_every_s == 0.0  # (the example sets no cadence)
    assert with_default_snapshots(cfg).strategy.snapshot_every_s == DEFAULT_SNAPSHOT_EVERY_S
    own = load_config(ROOT / "examples" / "ps_ssp.yaml", ["strategy.snapshot_every_versions=50"])
    assert with_default_snapshots(own) == own
    off = load_config(ROOT / "examples" / "ps_ssp.yaml", ["job.auto_checkpoint=false"])
    assert with_default_snapshots(off) == off
    tiny = load_config(ROOT / "examples" / "tiny.yaml")  # not ps: unchanged
    assert with_default_snapshots(tiny) == tiny
