"""The snapshot side of a parameter-server shard: the shard's state (a :class:`ShardStore`, its
``incarnation``, the lock that guards both) and its snapshots -- resuming from one at start,
writing one on demand, when due, and on close.  :class:`flotilla.ps.server.PSServer` builds on
it to serve the shard on the message plane.

Invariants:
- A snapshot is captured under ``_lock`` (a consistent state) and written outside it, atomically
  (``flotilla.ps.snapshot.write_snapshot``); ``_snap_lock`` allows one write at a time, and
  ``snapshot_version`` (the version of the last completed snapshot) only grows.
- With a :class:`SnapshotPolicy`, a snapshot is due (``_snap_due``) whenever the version passes a
  multiple of ``every_versions``, after the shard is seeded, after a change of its data views
  (shard 0: a join, leave or eviction, ``ps/data_views.py``), and every ``every_s`` seconds; the
  background thread (see ``PSServer``) writes it, capturing the state current when it gets to
  it (possibly newer).  Updates applied after the last completed snapshot are lost if the
  process dies (``docs/ps.md``).
- A shard started with the same identity and directory resumes from the snapshot in
  ``__init__``, before it serves anything; ``restored_from`` says from which file.
- Without a policy nothing is ever written and ``snapshot_now`` raises ``no_snapshots``.
- ``updates_lost`` counts the pushes an earlier incarnation acknowledged that this state does not
  hold: when a worker re-says hello after a restart (``resync``) at a clock past the one this
  shard recorded for it, the difference (its pushes acknowledged after the snapshot this shard
  resumed from).  It is kept in every snapshot's manifest, so it adds up over restarts.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any

from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.config import ShardConfig
from flotilla.ps.snapshot import (
    SnapshotPolicy,
    capture,
    read_snapshot,
    restore,
    snapshot_path,
    write_snapshot,
)
from flotilla.ps.store import ShardStore

__all__ = ["AccountedStore", "SnapshottingShard", "SnapshotPolicy"]

log = get_logger("ps.server")


class AccountedStore(ShardStore):
    """A :class:`ShardStore` that counts the updates lost to restarts (``updates_lost``, module
    doc): a resync hello that raises a worker's recorded clock by k means k acknowledged pushes
    of that worker are not in this state."""

    def __init__(self, config: ShardConfig) -> None:
        super().__init__(config)
        self.updates_lost = 0

    def hello(self, worker_id: int, clock: int, *, resync: bool) -> int:
        fresh = worker_id in self.clocks.fresh  # (a mid-run joiner moving up: nothing lost)
        before = self.clocks.table.as_dict().get(worker_id) if resync and not fresh else None
        recorded = super().hello(worker_id, clock, resync=resync)
        if before is not None and recorded > before:
            self.updates_lost += recorded - before
            log.warning(
                "shard %d: worker %d re-synced at clock %d, this state's was %d: its acknowledged "
                "updates in between were lost with the previous incarnation (%d lost in all)",
                self.config.shard_index,
                worker_id,
                recorded,
                before,
                self.updates_lost,
            )
        return recorded


class SnapshottingShard:
    """One shard's state and its snapshots under ``snapshots`` (none without a policy)."""

    def __init__(self, config: ShardConfig, *, snapshots: SnapshotPolicy | None = None) -> None:
        self.config = config
        self.store = AccountedStore(config)
        self.incarnation = secrets.randbits(52)
        self._policy = snapshots
        self._lock = threading.Lock()
        self._snap_due = threading.Event()
        self._snap_lock = threading.Lock()  # one snapshot write at a time
        self._snap_written = threading.Condition()
        self.snapshot_version = -1  # version of the last completed snapshot
        self._snap_lost = 0  # its updates_lost
        self._snap_views = 0  # its data views' rev (shard 0: a membership change is written soon)
        self._last_snap_t = time.monotonic()
        self.restored_from: Path | None = None
        self._load_snapshot()

    def _path(self) -> Path | None:
        if self._policy is None:
            return None
        return snapshot_path(self._policy.directory, self.config.shard_index, self.config.num_shards)

    def _load_snapshot(self) -> None:
        path = self._path()
        if path is None or not path.exists():
            return
        snap = read_snapshot(path)
        previous = restore(self.store, snap)
        self.store.updates_lost = self._snap_lost = int(snap.meta.get("updates_lost", 0))
        self._snap_views = self.store.clocks.views.rev
        self.snapshot_version = self.store.version
        self.restored_from = path
        log.warning(
            "shard %d resumed from %s at version %d (previous incarnation %x)",
            self.config.shard_index,
            path,
            self.store.version,
            previous,
        )

    def snapshot_now(self) -> dict[str, Any]:
        """Capture under the lock, write outside it; returns {version, path, bytes}."""
        path = self._path()
        if path is None:
            raise RemoteError("no_snapshots", "this server was started without a snapshot directory")
        with self._snap_lock:
            with self._lock:
                lost, views = self.store.updates_lost, self.store.clocks.views.rev
                if not self.store.initialized or (
                    self.store.version == self.snapshot_version
                    and lost == self._snap_lost
                    and views == self._snap_views
                ):
                    return {"version": self.snapshot_version, "path": str(path), "bytes": 0}
                snap = capture(self.store, self.incarnation, {"updates_lost": lost})
            size = write_snapshot(path, snap)
            self._last_snap_t = time.monotonic()
            with self._snap_written:
                self.snapshot_version, self._snap_lost, self._snap_views = snap.version, lost, views
                self._snap_written.notify_all()
        return {"version": snap.version, "path": str(path), "bytes": size}

    def wait_snapshot(self, version: int, timeout_s: float) -> bool:
        """Wait until a snapshot of at least ``version`` is on disk; False on timeout."""
        with self._snap_written:
            return self._snap_written.wait_for(lambda: self.snapshot_version >= version, timeout_s)

    def _snapshot_if_due(self) -> None:
        """Write a snapshot if one is due (by version or seed) or ``every_s`` has passed; called
        by the background thread, which it never lets an error stop."""
        policy = self._policy
        if policy is None:
            return
        timed = policy.every_s > 0 and time.monotonic() - self._last_snap_t >= policy.every_s
        views_changed = self.store.clocks.views.rev != self._snap_views and self.store.initialized
        if self._snap_due.is_set() or timed or views_changed:
            self._snap_due.clear()
            try:
                self.snapshot_now()
            except Exception:
                log.exception("shard %d: snapshot failed", self.config.shard_index)

    def _snapshot_after_seed(self) -> None:
        if self._policy is not None:
            self._snap_due.set()

    def _snapshot_if_crossed(self) -> None:
        """Mark a snapshot due if the version crossed a multiple of ``every_versions`` (under
        the lock)."""
        policy = self._policy
        if (
            policy is not None
            and policy.every_versions
            and (  # crossed a multiple of K
                self.store.version // policy.every_versions > self.snapshot_version // policy.every_versions
            )
        ):
            self._snap_due.set()
