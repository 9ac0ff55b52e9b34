"""Why the coordinator declared a worker dead, in words for the summary (``members_lost``).

A *lost* member is a worker the job went on without although it never left by itself: its
process died (a launcher's death notice), it went silent (heartbeats), its ring neighbours
found it silent or gone, or it did not report after its epoch broke (for instance a worker that
joined but could not reach its peers).  The coordinator notes one entry per lost worker, when
and why (``LostMember``); ``report/summary.py`` puts them into ``summary.json`` and the commands
say them on exit, so a job never reports success without naming whom it lost.

A worker that *left* the job before it was done (it asked to, on SIGTERM, or its process ended
with exit status 0) is not lost, but the summary names it too (``members_left``: when and why).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from flotilla.cluster import rendezvous_events as ev

__all__ = ["LostMember", "LostMembers", "why_lost"]


@dataclass(frozen=True, slots=True)
class LostMember:
    worker_id: int
    name: str
    at_s: float  # seconds since the coordinator started
    why: str
    rejoined_as: int | None = None  # the worker id it came back under (same name: roles/worker.py)
    rejoined_at_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def why_lost(
    event: object, *, suspected: bool = False, notice: str | None = None, heartbeat_timeout_s: float = 0.0
) -> str:
    """The reason a worker was left out of the views while the coordinator handled ``event``
    (``suspected``: it is alive, as far as the coordinator knows, but never reported after its
    epoch broke -- typically stuck forming a group whose peers it cannot connect to)."""
    if isinstance(event, ev.Suspected):
        how = "gone (its connections closed)" if event.closed else "silent"
        return f"worker {event.reporter}'s neighbour watch found it {how}"
    if isinstance(event, ev.DeathNoticed):
        return f"its process ended ({notice or 'death notice'})"
    if isinstance(event, ev.RingReturned):
        return (
            f"cut off from the majority: worker {event.worker_id}'s side went on without it in ring "
            f"mode and handed its view {event.epoch} back at the heal (docs/membership.md, Partitions)"
        )
    if suspected:
        return (
            "it did not report after its epoch broke: still inside a collective or a group "
            "rendezvous that never completed (can its peers reach the address it advertised?)"
        )
    return f"no heartbeat for {heartbeat_timeout_s:g} s"


class LostMembers:
    """The coordinator's ledger of lost members (one entry per worker, the first reason)."""

    def __init__(self, *, t0_unix: float, heartbeat_timeout_s: float) -> None:
        self._t0_unix, self._heartbeat_timeout_s = t0_unix, heartbeat_timeout_s
        self._lost: list[LostMember] = []
        self._left: list[LostMember] = []  # (left before the job was done: not lost)
        self._notices: dict[int, str] = {}  # worker -> the launcher's death notice

    def notice(self, worker_id: int, why: str) -> None:
        """The launcher saw the process of ``worker_id`` end (``why``); a worker already noted lost
        for another reason -- its neighbours found it silent before the launcher reaped it -- has
        the process's end put first: it names the cause (the user's exception, say)."""
        self._notices[worker_id] = why
        for i, m in enumerate(self._lost):
            ended = m.why.startswith("its process ended")
            if m.worker_id == worker_id and m.rejoined_as is None and not ended:
                self._lost[i] = replace(m, why=f"its process ended ({why}); first: {m.why}")

    def note(self, worker_id: int, name: str, event: object, *, suspected: bool) -> bool:
        """``worker_id`` is out of the views while the coordinator handled ``event``; False if it
        was already noted (the first reason is kept)."""
        if self.holds(worker_id):
            return False
        why = why_lost(
            event,
            suspected=suspected,
            notice=self._notices.get(worker_id),
            heartbeat_timeout_s=self._heartbeat_timeout_s,
        )
        at_s = round(time.time() - self._t0_unix, 3)
        self._lost.append(LostMember(worker_id=worker_id, name=name, at_s=at_s, why=why))
        return True

    def holds(self, worker_id: int) -> bool:
        """Whether ``worker_id`` was noted lost."""
        return any(m.worker_id == worker_id for m in self._lost)

    def rejoined(self, name: str, worker_id: int) -> None:
        """A worker named ``name`` joined as ``worker_id``: the lost member of that name that has
        not come back yet has (a woken or reconnected worker, or a restarted process)."""
        for i, m in enumerate(self._lost):
            if m.name == name and m.rejoined_as is None:
                at_s = round(time.time() - self._t0_unix, 3)
                self._lost[i] = replace(m, rejoined_as=worker_id, rejoined_at_s=at_s)
                return

    def back(self, worker_id: int) -> None:
        """A lost member is in a view again under its own id (a suspected one that polled again)."""
        for i, m in enumerate(self._lost):
            if m.worker_id == worker_id and m.rejoined_as is None:
                at_s = round(time.time() - self._t0_unix, 3)
                self._lost[i] = replace(m, rejoined_as=worker_id, rejoined_at_s=at_s)
                return

    def left(self, worker_id: int, name: str, why: str) -> None:
        """``worker_id`` left the job before it was done (the first reason is kept)."""
        if any(m.worker_id == worker_id for m in (*self._lost, *self._left)):
            return
        at_s = round(time.time() - self._t0_unix, 3)
        self._left.append(LostMember(worker_id=worker_id, name=name, at_s=at_s, why=why))

    def to_list(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self._lost]

    def left_list(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self._left]
