"""Failure detection between ring neighbours (pure): whom a worker watches, and when a watched
peer is suspected.  SPEC §7: survivors detect a revoked peer themselves, without relying on a
notice; this is the heartbeat half of that (the other half is a failed collective, which the
strategy reports as ``Outcome.broken``).

- ``watched(members, me)``: a worker watches its ring predecessor and successor in the view (the
  members in ``worker_id`` order, cyclically) -- every member is then watched by two others (by
  one in a view of two), so a revoked worker is noticed by both of its neighbours.
- ``PeerWatchPolicy.silent``: a watched peer whose last answer is older than ``limit_s`` (1.5
  heartbeat intervals; pings go out every half interval) is suspected.  Unless the *watcher
  itself* was not running: if the previous check is more than ``limit_s`` ago (this process
  was suspended, the machine slept, the watching thread was starved), nobody's silence can be
  told from our own, so the verdict is ``stalled``: the caller restarts every peer's clock and
  blames nobody.

Invariants: both are total and deterministic; time comes in as arguments (no clock); a peer is
never suspected on the check that follows a stall; ``watched`` never names ``me`` and names only
members.

Assumptions: a ping's answer proves the peer's process runs (its serving thread answered); a
frozen process (SIGSTOP) and a dead one look alike, and both are suspected -- a suspected live
worker is evicted from the view and may come back as a newcomer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PeerWatchPolicy", "Verdict", "watched"]


def watched(members: Sequence[int], me: int) -> tuple[int, ...]:
    """The peers ``me`` watches in a view of ``members``: its ring predecessor and successor
    (one peer in a view of two, none alone); ``()`` if ``me`` is not a member."""
    ring = sorted(set(members))
    if me not in ring or len(ring) < 2:
        return ()
    i = ring.index(me)
    pred, succ = ring[i - 1], ring[(i + 1) % len(ring)]
    return (pred,) if pred == succ else tuple(sorted({pred, succ}))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One check: the ``suspects``, or ``stalled`` (restart every clock, blame nobody)."""

    suspects: frozenset[int]
    stalled: bool


MIN_CORROBORATION_S = 0.5  # (the coordinator's heartbeats from a worker come every 0.25 s)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerWatchPolicy:
    """``interval_s``: the heartbeat interval.  A peer is pinged every ``period_s`` (half an
    interval) and suspected after ``limit_s`` (1.5 intervals) without an answer; a check runs
    after every round of pings, so a peer that stops answering is suspected within
    ``limit_s + period_s`` = 2 intervals of its last answer (SPEC §7's bound for a frozen peer)."""

    interval_s: float

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")

    @property
    def period_s(self) -> float:
        """Time between two pings of a peer (and between two checks)."""
        return self.interval_s / 2

    @property
    def limit_s(self) -> float:
        """Silence after which a watched peer is suspected."""
        return 1.5 * self.interval_s

    @property
    def unsuspected_s(self) -> float:
        """The longest a member may stop running without any watcher being able to suspect it:
        its last answer came at most one ``period_s`` before it stopped, so a watcher's clock
        for it runs out ``limit_s - period_s`` after the stop at the earliest (the allowance of
        ``comm.collective.Group.vote``)."""
        return self.limit_s - self.period_s

    @property
    def corroboration_s(self) -> float:
        """The silence at the coordinator that confirms a peer's suspicion (the suspect's own
        heartbeats there, which come every quarter second: ``roles/coordinator.py``)."""
        return max(self.limit_s, MIN_CORROBORATION_S)

    @property
    def frozen_out_s(self) -> float:
        """How long after it stops running a member is out of the views at the latest: its
        watchers suspect it within ``limit_s + period_s`` and the coordinator confirms it after
        ``corroboration_s`` of silence (what the simulator takes for a stop: ``sim/schedule.py``)."""
        return max(self.limit_s + self.period_s, self.corroboration_s)

    def silent(
        self, *, last_heard_s: Mapping[int, float], now_s: float, last_check_s: float | None
    ) -> Verdict:
        """Which peers of ``last_heard_s`` (peer -> time of its last answer, or of the start of
        watching it) are suspected at ``now_s``."""
        if last_check_s is not None and now_s - last_check_s > self.limit_s:
            return Verdict(frozenset(), stalled=True)
        return Verdict(
            frozenset(p for p, t in last_heard_s.items() if now_s - t > self.limit_s), stalled=False
        )
