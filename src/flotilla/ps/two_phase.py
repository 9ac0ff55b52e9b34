"""A clock is applied on every shard or on none (issue 19): the two-phase push rules, pure.
No torch, no I/O, no wall clock; the shard (``ps/store.py``) and the worker (``ps/client.py``)
execute them, ``tests/unit/test_ps_two_phase.py`` checks them over random interleavings.

Protocol (a job with more than one shard; with one shard a push is atomic by itself):

1. **stage**: the worker sends its update of clock ``c`` to every shard (``ps.stage``).  A shard
   validates it like a push and keeps it aside: not applied, not visible to reads, not counted
   by the gate.  At most one staged clock per worker, and only ``c = recorded`` (the worker's
   committed clock).
2. **commit**: once *every* shard acknowledged the stage, the worker commits ``c`` on every shard
   (``ps.commit``, or ``ps.cpull``: the commit carried by its pull of the next clock, on the same
   connection, so the synchronous path costs no extra round trip beyond the stage).  Commit
   applies the staged update exactly like a push.
3. **eviction resolves** a dead worker's staged clock on every shard the same way: the evicting
   party first **fences** the worker on every shard (no stage or commit from it is accepted any
   more, so what it reads next is final) and collects each shard's committed clock, then tells
   every shard to **resolve** up to ``target = max(committed clocks)``
   (:func:`resolution_target`): a shard at ``target - 1`` whose staged clock is ``target - 1``
   commits it, every other staged clock is discarded, and the worker leaves the table.

Why it is safe: a commit of ``c`` is sent only after every shard staged ``c``, and a shard drops
a staged clock only by committing it or by a resolve.  So if any shard committed ``c``, every
other shard has ``c`` committed or still staged, and ``target = c + 1`` commits it there; if
none did, ``target = c`` and every shard discards it.  Either way every shard ends with the same
clock for the dead worker: never half-applied.  (A staged update is not in the snapshots: a shard
that restarts while holding one loses it, and the live worker stages it again on ``not_staged``;
the guarantee assumes that no shard restarts between a dead worker's stage and its resolution.)

Retries are idempotent: staging a clock already committed answers ``done``; staging the staged
clock again replaces it (``restage``); committing a committed clock answers ``done``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from flotilla.ps.clock_rules import Refused

__all__ = [
    "NONE",
    "commit_verdict",
    "resolution_target",
    "resolve_verdict",
    "stage_verdict",
]

NONE = -1  # "no staged clock"


def _check_fence(worker_id: int, fenced: bool) -> None:
    if fenced:
        raise Refused("unknown_worker", f"worker {worker_id} was declared dead: its pushes are refused")


def stage_verdict(
    worker_id: int, recorded: int, staged: int, clock: object, *, fenced: bool
) -> Literal["stage", "restage", "done"]:
    """What a shard does with ``worker_id``'s stage of ``clock`` (``recorded``: its committed
    clock, ``staged``: its staged clock or :data:`NONE`)."""
    _check_fence(worker_id, fenced)
    if type(clock) is not int:
        raise Refused("bad_clock", f"stage clock must be an int, got {clock!r}")
    if clock == recorded - 1:
        return "done"  # a retry of a clock already committed here
    if clock != recorded:
        raise Refused("bad_clock", f"worker {worker_id} stages clock {clock}, its clock here is {recorded}")
    return "restage" if staged == clock else "stage"


def commit_verdict(
    worker_id: int, recorded: int, staged: int, clock: object, *, fenced: bool
) -> Literal["apply", "done"]:
    """What a shard does with ``worker_id``'s commit of ``clock``: apply the staged update, or
    nothing (``done``: committed already).  ``not_staged`` (e.g. the shard restarted and lost
    it: the worker stages it again) and ``bad_clock`` are refusals."""
    _check_fence(worker_id, fenced)
    if type(clock) is not int:
        raise Refused("bad_clock", f"commit clock must be an int, got {clock!r}")
    if clock == recorded - 1:
        return "done"
    if clock != recorded:
        raise Refused("bad_clock", f"worker {worker_id} commits clock {clock}, its clock here is {recorded}")
    if staged != clock:
        raise Refused("not_staged", f"worker {worker_id}'s clock {clock} is not staged on this shard")
    return "apply"


def resolution_target(committed: Iterable[int]) -> int:
    """The clock every shard must end at for a fenced worker: the highest committed clock any
    shard reports (see the module doc)."""
    clocks = list(committed)
    if not clocks:
        raise ValueError("resolution_target needs at least one shard's committed clock")
    return max(clocks)


def resolve_verdict(recorded: int, staged: int, target: int) -> Literal["commit", "discard"]:
    """What a shard does with a fenced worker's staged clock when told to resolve up to
    ``target``: ``commit`` it (the shard is one clock short and holds exactly that clock) or
    ``discard`` it (or nothing staged).  A shard more than one clock short, or one clock short
    without the staged clock, would break the invariant: ``Refused("half_applied")`` (the shard
    logs it; it cannot happen while the protocol above is followed)."""
    if target <= recorded:
        return "discard"
    if target == recorded + 1 and staged == recorded:
        return "commit"
    raise Refused(
        "half_applied",
        f"told to resolve up to clock {target}, but this shard is at {recorded} with "
        f"{'nothing' if staged == NONE else f'clock {staged}'} staged",
    )
