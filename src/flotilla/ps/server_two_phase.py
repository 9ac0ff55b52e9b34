"""The two-phase push operations of a parameter-server shard (issue 19; the protocol and why a
clock is then applied on every shard or on none: ``ps/two_phase.py``): ``ps.stage``,
``ps.commit``, ``ps.cpull`` (a commit carried by the pull of the next clock), ``ps.stage_part``
(one part of a virtual worker's clock), ``ps.vpull`` (a part's vote to commit it, carried by its
pull of the next clock), and the eviction's ``ps.fence`` and ``ps.resolve``.
A mixin of :class:`flotilla.ps.server.PSServer`, whose lock, pending pulls and reply helpers it
uses.

Invariants: each handler validates its whole request before changing anything and runs under the
server's lock; a commit or resolve that advances ``c_global`` answers the pulls it made servable;
only a live member of the job (in the shard's table) may fence or resolve, at most
``MAX_EVICT`` ids at a time.
"""

from __future__ import annotations

from typing import Any

from flotilla.comm.endpoint import Deferred, Reply, Request
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.clock_rules import MAX_CLOCK, MAX_WORKER_ID
from flotilla.ps.consistency import max_pull_ahead

__all__ = ["MAX_EVICT", "TwoPhaseOps"]

MAX_EVICT = 64  # worker ids one ps.evict / ps.fence / ps.resolve may name

log = get_logger("ps.server")


def _ids(body: dict[str, Any]) -> list[int]:
    ids = body["evict"]
    if len(ids) > MAX_EVICT or any(type(w) is not int or not 0 <= w <= MAX_WORKER_ID for w in ids):
        raise RemoteError(
            "schema", f"evict must be a list of at most {MAX_EVICT} ints in [0, {MAX_WORKER_ID}]"
        )
    return list(ids)


class TwoPhaseOps:
    """``ps.stage``/``commit``/``cpull``/``fence``/``resolve`` handlers (module doc)."""

    store: Any  # a ShardStore
    config: Any
    _lock: Any
    _pending: dict[tuple[int, int], Any]
    _drop_pending: Any
    _check_incarnation: Any
    _servable: Any
    _answer: Any
    _serve_or_park: Any
    _snapshot_if_crossed: Any

    def two_phase_handlers(self) -> dict[str, Any]:
        return {
            "ps.stage": self._stage,
            "ps.stage_part": self._stage_part,
            "ps.commit": self._commit,
            "ps.cpull": self._cpull,
            "ps.vpull": self._vpull,
            "ps.fence": self._fence,
            "ps.resolve": self._resolve,
        }

    def _stage(self, req: Request) -> dict[str, Any]:
        b = req.body
        with self._lock:
            self._check_incarnation(b)
            staged, clock = self.store.stage(
                b["worker_id"], b["clock"], b["base_version"], b["chunks"], req.tensors
            )
            return {"staged": staged, "clock": clock, "version": self.store.version}

    def _stage_part(self, req: Request) -> dict[str, Any]:
        """Stage one part of a virtual worker's clock (``two_phase.stage_part``); ``complete``:
        every part of it is staged on this shard."""
        b = req.body
        with self._lock:
            self._check_incarnation(b)
            staged, clock, complete = self.store.stage_part(
                b["worker_id"], b["clock"], b["base_version"], b["chunks"], req.tensors, b["part"], b["parts"]
            )
            return {"staged": staged, "clock": clock, "version": self.store.version, "complete": complete}

    def _commit_now(self, worker_id: int, clock: int) -> tuple[dict[str, Any], list]:
        """(Under the lock.)  Commit; the reply fields and the pulls it made servable."""
        result = self.store.commit(worker_id, clock)
        ready = self._servable() if result.applied else []
        if result.applied:
            self._snapshot_if_crossed()
        return {"applied": result.applied, "version": result.version, "clock": result.clock}, ready

    def _commit(self, req: Request) -> dict[str, Any]:
        b = req.body
        with self._lock:
            self._check_incarnation(b)
            reply, ready = self._commit_now(b["worker_id"], b["clock"])
        self._answer(ready)
        return reply

    def _cpull(self, req: Request) -> Reply | Deferred:
        """Commit ``commit`` (the worker's staged clock; -1: nothing), then pull for ``clock``
        as ``ps.pull``.  Retrying it is safe (a committed clock is acknowledged again)."""
        b = req.body
        wait_s = b["wait_s"]
        if not (isinstance(wait_s, float | int) and 0 < wait_s < float("inf")):
            raise RemoteError("schema", f"wait_s must be a finite number > 0, got {wait_s!r}")
        if b["commit"] < -1:
            raise RemoteError("schema", f"commit must be a clock >= 0 or -1 (none), got {b['commit']}")
        if b["commit"] >= 0 and not b["commit"] < b["clock"] <= b["commit"] + 1 + max_pull_ahead(
            self.config.consistency
        ):
            raise RemoteError("bad_clock", f"pull clock {b['clock']} does not follow commit {b['commit']}")
        ready: list = []
        with self._lock:
            self._check_incarnation(b)
            self.store.read(b["chunks"])  # validates the chunk ids first
            if b["commit"] >= 0:
                _, ready = self._commit_now(b["worker_id"], b["commit"])
            answer, old = self._serve_or_park(req, b["clock"])
        self._answer(ready)
        if old is not None:
            old.deferred.fail("superseded", f"a newer pull by worker {old.worker_id} replaced it")
        return answer

    def _vpull(self, req: Request) -> Reply | Deferred:
        """A virtual worker part's vote to commit its staged clock ``commit``
        (``two_phase.vote_verdict``; the last vote applies it), then its pull for ``clock``,
        answered once that clock is applied here and the gate allows the pull.  Retrying it is
        safe (a vote is recorded once; a committed clock is acknowledged)."""
        b = req.body
        if not (isinstance(b["wait_s"], float | int) and 0 < b["wait_s"] < float("inf")):
            raise RemoteError("schema", f"wait_s must be a finite number > 0, got {b['wait_s']!r}")
        if not 0 <= b["commit"] < b["clock"] <= b["commit"] + 1 + max_pull_ahead(self.config.consistency):
            raise RemoteError("bad_clock", f"pull clock {b['clock']} does not follow commit {b['commit']}")
        ready: list = []
        with self._lock:
            self._check_incarnation(b)
            if b["chunks"]:  # (a part holding no chunk here still votes)
                self.store.read(b["chunks"])  # validates the chunk ids first
            result = self.store.vote(b["worker_id"], b["commit"], b["part"], b["parts"])
            if result is not None and result.applied:
                ready = self._servable()
                self._snapshot_if_crossed()
            answer, old = self._serve_or_park(req, b["clock"], part=b["part"], after=b["commit"])
        self._answer(ready)
        if old is not None:
            newer = f"a newer pull by part {b['part']} of worker {b['worker_id']} replaced it"
            old.deferred.fail("superseded", newer)
        return answer

    def _fence(self, req: Request) -> dict[str, Any]:
        """Refuse the named workers' stages and commits from now on; their committed and staged
        clocks here (``[[id, committed, staged or -1], ...]``; absent ids are left out)."""
        b = req.body
        ids = _ids(b)
        with self._lock:
            self._check_incarnation(b)
            self.store.clock_of(b["worker_id"])  # only a live member of the job may fence
            found = [(w, self.store.fence(w)) for w in ids if w != b["worker_id"]]
        return {"clocks": [[w, c[0], c[1]] for w, c in found if c is not None]}

    def _resolve(self, req: Request) -> dict[str, Any]:
        """Resolve each fenced worker up to its target clock (commit or discard its staged clock)
        and evict it; a shard that cannot reach a target answers ``half_applied`` for it (logged)."""
        b = req.body
        ids, upto = _ids(b), b["upto"]
        if len(upto) != len(ids) or any(type(c) is not int or not 0 <= c <= MAX_CLOCK for c in upto):
            raise RemoteError("schema", f"upto must hold one clock in [0, {MAX_CLOCK}] per evicted id")
        out, failed = [], []
        with self._lock:
            self._check_incarnation(b)
            self.store.clock_of(b["worker_id"])
            for w, target in zip(ids, upto):
                if w == b["worker_id"]:
                    continue
                try:
                    r = self.store.resolve(w, target)
                except RemoteError as exc:
                    log.error("shard %d: %s", self.config.shard_index, exc)
                    failed.append(w)
                    continue
                if r.outcome != "absent":
                    out.append([w, r.outcome, r.clock])
                    self._log_resolved(w, r.outcome, r.clock)
            dropped = self._drop_pending([w for w, _, _ in out])
            ready = self._servable()
        for p in dropped:
            p.deferred.fail("unknown_worker", "the worker was declared dead")
        self._answer(ready)
        return {"resolved": out, "failed": failed}

    # ------------------------------------------------------------------ the hosting process's own
    def bar_local(self, worker_id: int) -> bool:
        """The process hosting this shard knows ``worker_id`` will never train (a newcomer given
        up): a hello from it not yet seen is refused from now on (``clock_rules.bar``); False
        when the shard knows it (then :meth:`fence_local` and :meth:`resolve_local`) or it left."""
        with self._lock:
            return self.store.bar(worker_id)

    def fence_local(self, worker_id: int) -> int | None:
        """The process hosting this shard declares ``worker_id`` dead (as ``ps.fence`` does for a
        member): its stages and commits are refused from now on; its committed clock here (None:
        unknown).  Then :meth:`resolve_local` on every shard with the highest committed clock
        (``two_phase.resolution_target``)."""
        with self._lock:
            found = self.store.fence(worker_id)
        return None if found is None else found[0]

    def resolve_local(self, worker_id: int, target: int) -> str:
        """``ps.resolve`` for one fenced worker by the hosting process: its staged clock committed
        or discarded up to ``target``, the worker evicted, its pending pulls failed and the pulls
        it held back answered; the outcome (``committed``, ``discarded``, ``none``, ``absent``)."""
        with self._lock:
            r = self.store.resolve(worker_id, target)
            if r.outcome != "absent":
                self._log_resolved(worker_id, r.outcome, r.clock)
            dropped = self._drop_pending([worker_id])
            ready = self._servable()
        for p in dropped:
            p.deferred.fail("unknown_worker", "the worker was declared dead")
        self._answer(ready)
        return str(r.outcome)

    def _log_resolved(self, worker_id: int, outcome: str, clock: int) -> None:
        log.warning(
            "shard %d: worker %d declared dead, removed at clock %d; c_global now %d; its staged clock: %s",
            self.config.shard_index,
            worker_id,
            clock,
            self.store.table.c_global,
            outcome,
        )
