"""A parameter-server shard's pending pulls (a mixin of :class:`flotilla.ps.server.PSServer`):
a pull the consistency gate does not allow yet is **parked** (``Request.defer``) and answered
when a push, commit, vote, hello, leave or eviction makes it servable, or failed with
``not_ready`` (and why it is still blocked) after its ``wait_s``.

Invariants: at most one pull is pending per worker and part (a virtual worker's stages wait side
by side; a newer pull of the same part supersedes the older), so memory stays bounded; a part's
vote-pull (``ps.vpull``) is answered only once the worker's clock passed the voted one; every
method named "(under the lock)" runs under the server's lock and answers nothing itself (the
caller answers outside the lock: :meth:`PendingPulls._answer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from flotilla.comm.endpoint import Deferred, Reply, Request
from flotilla.core.errors import RemoteError
from flotilla.ps.clock_rules import blocked_reason

__all__ = ["Pending", "PendingPulls"]


@dataclass(slots=True)
class Pending:
    deferred: Deferred
    worker_id: int
    clock: int
    chunks: list[int]
    issued: float
    deadline: float
    part: int = 0  # a virtual worker's part (its stages' pulls wait side by side)
    after: int = -1  # a part's vote: answered only once the worker's clock passed this one

    @property
    def key(self) -> tuple[int, int]:
        return self.worker_id, self.part


class PendingPulls:
    """Parking, answering and expiring pulls (module doc)."""

    store: Any  # a ShardStore
    config: Any
    _lock: Any
    _max_wait_s: float
    _pending: dict[tuple[int, int], Pending]
    _views_field: Any

    def _serve_or_park(
        self, req: Request, clock: int, *, part: int = 0, after: int = -1
    ) -> tuple[Reply | Deferred, Pending | None]:
        """Answer a pull for ``clock`` now, or park it (under the lock; validated already).
        ``part``/``after``: a virtual worker's part, answered once the worker's clock passed
        ``after`` (its vote's clock was applied)."""
        b = req.body
        worker = b["worker_id"]
        if self._may_answer(worker, clock, after):
            return self._pull_reply(b["chunks"], worker), None
        deferred = req.defer()
        now = time.monotonic()
        old = self._pending.pop((worker, part), None)
        until = now + min(b["wait_s"], self._max_wait_s)
        p = Pending(deferred, worker, clock, list(b["chunks"]), now, until, part, after)
        self._pending[p.key] = p
        return deferred, old

    def _may_answer(self, worker: int, clock: int, after: int) -> bool:
        """(Under the lock.)  The gate allows the pull and the worker's clock passed ``after``."""
        return self.store.clock_of(worker) > after and self.store.may_serve(worker, clock)

    def _drop_pending(self, workers: list[int]) -> list[Pending]:
        """(Under the lock.)  Remove and return the pending pulls of ``workers`` (every part)."""
        gone = set(workers)
        return [self._pending.pop(k) for k in list(self._pending) if k[0] in gone]

    def _pull_reply(self, chunks: list[int], worker_id: int) -> Reply:
        """(Under the lock.)"""
        # (lag-0 models: the last fold's state; a VW part's vote may ask for no chunk here)
        tensors, versions = self.store.read(chunks) if chunks else ([], [])
        version, c_global = self.store.read_clock()
        body = {"version": version, "versions": versions, "c_global": c_global}
        return Reply({**body, **self._views_field(worker_id)}, tensors)

    def _servable(self) -> list[tuple[Deferred, Reply | RemoteError]]:
        """Pending pulls that can be answered now (called under the lock; answered outside)."""
        out: list[tuple[Deferred, Reply | RemoteError]] = []
        for key, p in list(self._pending.items()):
            try:
                if not self._may_answer(p.worker_id, p.clock, p.after):
                    continue
                answer: Reply | RemoteError = self._pull_reply(p.chunks, p.worker_id)
            except RemoteError as exc:
                answer = exc
            del self._pending[key]
            out.append((p.deferred, answer))
        return out

    @staticmethod
    def _answer(ready: list[tuple[Deferred, Reply | RemoteError]]) -> None:
        for deferred, answer in ready:
            if isinstance(answer, RemoteError):
                deferred.fail(answer.code, answer.message)
            else:
                deferred.resolve(answer)

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [p for p in self._pending.values() if p.deadline <= now]
            for p in expired:
                del self._pending[p.key]
            why = [self._blocked_reason(p, now) for p in expired]
        for p, reason in zip(expired, why):
            p.deferred.fail("not_ready", reason)

    def _blocked_reason(self, p: Pending, now: float) -> str:
        if p.after >= 0 and self.store.clocks.table.as_dict().get(p.worker_id, p.after + 1) <= p.after:
            return (
                f"part {p.part} of virtual worker {p.worker_id} on shard {self.config.shard_index} "
                f"still waits after {now - p.issued:.1f} s for the other parts' votes to commit "
                f"clock {p.after}"
            )
        return (
            f"pull for clock {p.clock} by worker {p.worker_id} on shard {self.config.shard_index} "
            f"still blocked after {now - p.issued:.1f} s: "
            + blocked_reason(self.store.clocks, self.config.consistency, p.clock)
        )
