"""Failure-detection policy (pure): when is a silent worker dead, when is a quiet one suspected.

Two independent signals, both decided here from times the caller passes in (never the wall clock):

- **Silence** (``check_silence``): a worker whose last message is older than
  ``heartbeat_timeout_s`` is dead.  Unless the *checker itself* was not running: if the previous
  check is more than ``heartbeat_timeout_s / 2`` ago, nobody's silence can be told from our own
  (the coordinator process was suspended, or the machine slept), so everybody's last-seen time
  is reset to now and nobody is declared dead.
- **Report grace** (``suspects``): after the first failure report of an epoch, the other members
  of that epoch are waited for ``report_grace_s`` at most; a member that by then has neither
  reported the failure nor been declared dead is *suspected* (alive, perhaps hung in the broken
  collective) and left out of the next view.  It may come back later as a newcomer.

Invariants: both functions are total and deterministic; a worker is never declared dead by
``check_silence`` on a check that follows a stall; ``suspects`` never names a reporter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class FailurePolicy:
    """``heartbeat_timeout_s``: silence after which a worker is dead.  ``report_grace_s``: how
    long the members of a broken epoch are waited for once one of them reported the failure
    (about one collective timeout: a live member blocked in the broken collective has timed out
    and reported by then)."""

    heartbeat_timeout_s: float
    report_grace_s: float

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if not self.report_grace_s >= 0:
            raise ValueError(f"report_grace_s must be >= 0, got {self.report_grace_s}")


@dataclass(frozen=True, slots=True)
class Silence:
    """The verdict of one silence check: ``dead`` workers, or ``stalled`` (the checker was not
    running: reset every last-seen time to the check's time, blame nobody)."""

    dead: frozenset[int]
    stalled: bool


def check_silence(
    policy: FailurePolicy,
    *,
    last_check_s: float | None,
    now_s: float,
    last_seen_s: Mapping[int, float],
) -> Silence:
    """Which of the workers in ``last_seen_s`` (the ones still expected to talk) are dead now."""
    limit = policy.heartbeat_timeout_s
    if last_check_s is not None and now_s - last_check_s > limit / 2:
        return Silence(frozenset(), stalled=True)
    return Silence(frozenset(w for w, t in last_seen_s.items() if now_s - t > limit), stalled=False)


def suspects(
    policy: FailurePolicy,
    *,
    opened_s: float,
    now_s: float,
    pending: Iterable[int],
) -> frozenset[int]:
    """The ``pending`` members (neither reported nor known gone) to give up on at ``now_s``, for a
    failure first reported at ``opened_s``: all of them once the grace is over, else none."""
    if now_s - opened_s < policy.report_grace_s:
        return frozenset()
    return frozenset(pending)
