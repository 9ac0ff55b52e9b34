"""The parameter-server role: one shard (a :class:`ShardStore`) served on the message plane.
The shard's state and its snapshots are :class:`flotilla.ps.server_snapshots.SnapshottingShard`
(its module doc holds the snapshot invariants); shard 0's data views in the replies are
``ps/server_views.py``; parked pulls ``ps/server_pending.py``; two-phase pushes
``ps/server_two_phase.py``; this module is the serving side.

Operations: see the table in ``ps/wire.py`` (:data:`flotilla.ps.wire.OPS` holds their schemas).

Invariants:
- Handlers never block: a pull the consistency gate does not allow yet is **deferred**
  (``Request.defer``) and answered when a push, commit, vote, hello, leave or eviction makes it
  servable, or with error ``not_ready`` after ``wait_s`` (the client retries until its
  ``pull_timeout_s``; ``ps/server_pending.py``).  At most one
  pull per worker (per part of a virtual worker) is pending (a newer one supersedes it), so memory
  stays bounded.
- ``incarnation`` is a random id drawn at every start; a push/pull/leave naming another one is
  refused with ``restarted`` and changes nothing, so a worker re-says hello (re-syncing its clock,
  see ``ShardStore.hello``) before it continues against a restarted server.
- One background thread expires pending pulls and writes the snapshots that are due; ``close``
  writes a final snapshot (with a policy) after answering every pending pull.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Any

from flotilla.comm.base import ServerBase
from flotilla.comm.endpoint import Deferred, Reply, Request
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.config import ShardConfig, shard_config_from
from flotilla.ps.consistency import max_pull_ahead
from flotilla.ps.server_pending import Pending, PendingPulls
from flotilla.ps.server_snapshots import SnapshotPolicy, SnapshottingShard
from flotilla.ps.server_two_phase import MAX_EVICT, TwoPhaseOps
from flotilla.ps.server_views import DataViewReplies
from flotilla.ps.snapshot import views_meta
from flotilla.ps.wire import OPS, keys_from_wire

__all__ = ["MAX_EVICT", "PSServer", "SnapshotPolicy", "shard_config_from"]

TICK_S = 0.05

log = get_logger("ps.server")


def _check_wait(wait_s: float) -> None:
    if not (math.isfinite(wait_s) and wait_s > 0):
        raise RemoteError("schema", f"wait_s must be a finite number > 0, got {wait_s!r}")


class PSServer(TwoPhaseOps, PendingPulls, DataViewReplies, SnapshottingShard):
    """Serves one shard on ``transport`` (a bound, not yet started message-plane server)."""

    def __init__(
        self,
        config: ShardConfig,
        transport: ServerBase,
        *,
        snapshots: SnapshotPolicy | None = None,
        max_wait_s: float = 3600.0,
    ) -> None:
        super().__init__(config, snapshots=snapshots)  # resumes from a snapshot, if any
        self._transport = transport
        self._max_wait_s = max_wait_s
        self._pending: dict[tuple[int, int], Pending] = {}  # by (worker, part): ps/server_pending.py
        self._stop = threading.Event()
        self.op_counts: Counter[str] = Counter()
        self._register()
        self._thread = threading.Thread(
            target=self._housekeeping, daemon=True, name=f"flotilla-ps-shard{config.shard_index}"
        )

    @property
    def address(self) -> str:
        return self._transport.address

    def start(self) -> PSServer:
        self._transport.start()
        self._thread.start()
        return self

    def close(self, *, final_snapshot: bool = True) -> None:
        """Answer pending pulls with ``shutting_down``, write a final snapshot (unless told not
        to: tests use that to stand for a crash), stop serving."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.deferred.fail("shutting_down", f"shard {self.config.shard_index} is shutting down")
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._policy is not None and final_snapshot:
            self.snapshot_now()
        self._transport.close()

    def __enter__(self) -> PSServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _housekeeping(self) -> None:
        while not self._stop.is_set():
            self._snap_due.wait(TICK_S)
            self._expire(time.monotonic())
            self._snapshot_if_due()

    # ------------------------------------------------------------------ handlers
    def _register(self) -> None:
        handlers: dict[str, Any] = {
            "ps.hello": self._hello,
            "ps.init": self._init,
            "ps.seed": self._seed,
            "ps.push": self._push,
            "ps.pull": self._pull,
            "ps.pushpull": self._pushpull,
            "ps.leave": self._leave,
            "ps.evict": self._evict,
            "ps.stats": self._stats,
            "ps.snapshot": lambda r: self.snapshot_now(),
            **self.two_phase_handlers(),  # ps.stage, commit, cpull, fence, resolve
        }
        for op, (schema, max_tensors) in OPS.items():
            handler = handlers[op]
            self._transport.register(op, self._counted(op, handler), schema, max_tensors=max_tensors)

    def read_local(self, chunk_ids: list[int]) -> list[Any]:
        """The process hosting this shard reads its chunks' tensors (as a pull serves them),
        under the shard's lock, without joining the job."""
        with self._lock:
            tensors, _ = self.store.read(chunk_ids)
            return list(tensors)

    def views_local(self) -> dict[str, Any]:
        """The process hosting this shard reads its data views (shard 0 keeps the job's:
        ``ps/data_views.py``) as a run's summary gives them: ``{views, dropped, dropped_overflow}``."""
        with self._lock:
            meta = views_meta(self.store.clocks.views)
        return {
            "views": meta["data_views"]["views"] if meta else [],
            "dropped": meta.get("dropped", []),
            "dropped_overflow": meta.get("dropped_overflow", 0),
        }

    def workers_local(self) -> list[int]:
        """The process hosting this shard reads the worker ids in its clock table (joined, not
        departed), sorted."""
        with self._lock:
            return sorted(self.store.table.as_dict())

    def _counted(self, op: str, handler: Any) -> Any:
        def run(req: Request) -> Any:
            self.op_counts[op] += 1  # requests that passed the message plane's checks
            views = self.store.clocks.views
            try:
                reply = handler(req)
            finally:
                if self.store.clocks.views is not views:
                    self._log_views(views)
            if isinstance(reply, dict) and "worker_id" in req.body:
                reply.update(self._views_for(req.body["worker_id"]))
            return reply

        return run

    def _check_incarnation(self, body: dict[str, Any]) -> None:
        if body["incarnation"] != self.incarnation:
            raise RemoteError(
                "restarted",
                f"shard {self.config.shard_index} restarted (incarnation "
                f"{self.incarnation}, request names {body['incarnation']}): say hello again",
            )

    def _hello(self, req: Request) -> dict[str, Any]:
        b = req.body
        with self._lock:
            clock = self.store.hello(b["worker_id"], b["clock"], resync=b["incarnation"] != self.incarnation)
            ready = self._servable()
            reply = {
                "incarnation": self.incarnation,
                "clock": clock,
                "initialized": self.store.initialized,
                "version": self.store.version,
                "complete": self.store.complete,
            }
        self._answer(ready)
        return reply

    def _init(self, req: Request) -> dict[str, Any]:
        keys = keys_from_wire(req.body["keys"])
        with self._lock:
            digest = self.store.check_layout(keys)
            return {"initialized": self.store.initialized, "layout": digest, "incarnation": self.incarnation}

    def _seed(self, req: Request) -> dict[str, Any]:
        keys = keys_from_wire(req.body["keys"])
        with self._lock:
            seeded = self.store.seed(keys, req.body["chunks"], req.tensors)
        if seeded:
            self._snapshot_after_seed()
        return {"seeded": seeded}

    def _push(self, req: Request) -> dict[str, Any]:
        b = req.body
        with self._lock:
            self._check_incarnation(b)
            result, ready = self._apply_push(b, req.tensors)
        self._answer(ready)
        return {"applied": result.applied, "version": result.version, "clock": result.clock}

    def _pull(self, req: Request) -> Reply | Deferred:
        b = req.body
        _check_wait(b["wait_s"])
        with self._lock:
            self._check_incarnation(b)
            self.store.read(b["chunks"])  # validates the chunk ids now
            answer, old = self._serve_or_park(req, b["clock"])
        if old is not None:
            old.deferred.fail("superseded", f"a newer pull by worker {old.worker_id} replaced it")
        return answer

    def _pushpull(self, req: Request) -> Reply | Deferred:
        """Push tagged ``clock``, then pull for ``pull_clock``: ``clock + 1``, or ``clock + 2``
        (read-ahead) where the consistency model allows it.  One round trip per shard per step.
        Retrying it after an error is safe (the push is acknowledged, not applied, again)."""
        b = req.body
        _check_wait(b["wait_s"])
        first, last = b["clock"] + 1, b["clock"] + 1 + max_pull_ahead(self.config.consistency)
        if not first <= b["pull_clock"] <= last:
            raise RemoteError(
                "bad_clock",
                f"pull_clock {b['pull_clock']} of a push tagged "
                f"{b['clock']} must be in [{first}, {last}] under "
                f"{self.config.consistency}",
            )
        with self._lock:
            self._check_incarnation(b)
            result, ready = self._apply_push(b, req.tensors)  # validates everything first
            answer, old = self._serve_or_park(req, b["pull_clock"])
        self._answer(ready)
        if old is not None:
            old.deferred.fail("superseded", f"a newer pull by worker {old.worker_id} replaced it")
        return answer

    def _apply_push(self, b: dict[str, Any], tensors: list) -> tuple[Any, list]:
        """Apply one push (under the lock); returns its result and the pulls it made servable."""
        result = self.store.push(b["worker_id"], b["clock"], b["base_version"], b["chunks"], tensors)
        ready = self._servable() if result.applied else []
        self._snapshot_if_crossed()
        return result, ready

    def _leave(self, req: Request) -> dict[str, Any]:
        with self._lock:
            self._check_incarnation(req.body)
            self.store.leave(req.body["worker_id"], finished=req.body["finished"])
            dropped = self._drop_pending([req.body["worker_id"]])
            ready = self._servable()
        for p in dropped:
            p.deferred.fail("unknown_worker", "the worker left")
        self._answer(ready)
        return {}

    def _evict(self, req: Request) -> dict[str, Any]:
        """A live worker passes on the coordinator's word that workers are dead or gone: each is
        removed from the clock table like a leave (``clock_rules.evict``); unknown or departed
        ids change nothing and are logged."""
        b = req.body
        ids = b["evict"]
        if len(ids) > MAX_EVICT or any(type(w) is not int for w in ids):
            raise RemoteError("schema", f"evict must be a list of at most {MAX_EVICT} ints")
        with self._lock:
            self._check_incarnation(b)
            self.store.clock_of(b["worker_id"])  # only a live member of the job may evict
            removed = [w for w in ids if w != b["worker_id"] and self._evict_one(w)]
            dropped = self._drop_pending(removed)
            ready = self._servable()
        for p in dropped:
            p.deferred.fail("unknown_worker", "the worker was declared dead")
        self._answer(ready)
        return {"evicted": removed}

    def _evict_one(self, worker_id: int) -> bool:
        """(Under the lock.)"""
        clock = self.store.clocks.table.as_dict().get(worker_id)
        if not self.store.evict(worker_id):
            log.info(
                "shard %d: evict of worker %d: not in the table (no-op)", self.config.shard_index, worker_id
            )
            return False
        log.warning(
            "shard %d: worker %d declared dead, removed at clock %s; c_global now %d",
            self.config.shard_index,
            worker_id,
            clock,
            self.store.table.c_global,
        )
        return True

    def _stats(self, req: Request) -> dict[str, Any]:
        with self._lock:
            s = self.store
            return {
                "incarnation": self.incarnation,
                "version": s.version,
                "initialized": s.initialized,
                "clocks": [list(e) for e in s.table.entries],
                "departed": sorted(s.departed),
                "c_global": s.table.c_global,
                "digest": s.digest(),
                "pending": len(self._pending),
                "snapshot_version": self.snapshot_version,
                "num_chunks": len(s.weights),
            }
