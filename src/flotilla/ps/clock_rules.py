"""The clock rules of one parameter-server shard, pure: who may join at which clock, resync after
a restart, leave, when the job is complete, whether a push's clock is new, a retry or an error, and
whether a pull may be served now (SPEC §1, §2).  No torch, no I/O, no wall clock.

:class:`ShardClocks` is immutable; every transition returns a new value or raises
:class:`Refused` (``code`` is the wire error code the server answers with, e.g. ``bad_clock``,
``unknown_worker``) and changes nothing.

Rules:
- **hello** (first time): a worker not known to the shard joins at the clock it names, while fewer
  than ``num_workers`` workers have joined; the first joiner sets the table's floor, a later one
  at a lower clock lowers it (workers may start from a resumed checkpoint in any order).
  **hello again**: returns the recorded clock; only with ``resync`` (the server restarted since
  the worker last saw it) a *higher* clock named by the worker replaces the recorded one.
  A worker that has left may not come back.
- **leave**: the worker's clock is dropped (``c_global`` may rise); it stays ``departed``.
- **complete**: every expected worker has joined once (departed ones count).
- **push** tagged ``clock``: must be the worker's recorded clock (advance by one); the previous
  clock is a *retry* (acknowledged, not applied again); anything else is ``bad_clock``.
- **pull** for ``clock``: ``0 <= clock <= own + max_pull_ahead(model)``; ASP serves at once,
  the other models once the job is complete and :func:`~flotilla.ps.consistency.may_serve_pull`
  allows it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flotilla.core.errors import FlotillaError
from flotilla.ps.consistency import (
    ASP,
    ClockError,
    ClockTable,
    ConsistencyModel,
    WorkerId,
    allowed_lag,
    max_pull_ahead,
    may_serve_pull,
)

__all__ = ["Refused", "ShardClocks", "blocked_reason", "check_pull", "hello", "leave", "push"]


class Refused(FlotillaError):
    """A request the clock rules refuse; ``code`` is the server's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardClocks:
    """A shard's clock table and membership; ``num_workers`` workers are expected."""

    num_workers: int
    table: ClockTable = ClockTable()
    joined: frozenset[WorkerId] = frozenset()
    departed: frozenset[WorkerId] = frozenset()

    @property
    def complete(self) -> bool:
        return len(self.joined) >= self.num_workers

    def clock_of(self, worker_id: WorkerId) -> int:
        """The worker's recorded clock; ``Refused("unknown_worker")`` if it has not said hello."""
        try:
            return self.table.clock_of(worker_id)
        except ClockError:
            raise Refused("unknown_worker", f"worker {worker_id!r} has not said hello") from None


def hello(state: ShardClocks, worker_id: int, clock: int, *, resync: bool) -> tuple[ShardClocks, int]:
    """Register ``worker_id`` at ``clock`` (see the module doc); returns the new state and the
    worker's recorded clock."""
    if type(worker_id) is not int or type(clock) is not int or worker_id < 0 or clock < 0:
        raise Refused("bad_clock", "worker_id and clock must be ints >= 0")
    if worker_id in state.departed:
        raise Refused("unknown_worker", f"worker {worker_id} has left this job")
    clocks = state.table.as_dict()
    if worker_id in clocks:
        if resync and clock > clocks[worker_id]:
            clocks[worker_id] = clock
            table = ClockTable(tuple(sorted(clocks.items())), floor=state.table.floor)
            return replace(state, table=table), clock
        return state, clocks[worker_id]
    if state.complete:
        raise Refused(
            "unknown_worker",
            f"worker {worker_id} is not one of the {state.num_workers} workers of this job (all have joined)",
        )
    clocks[worker_id] = clock
    floor = min(state.table.floor, clock) if state.joined else clock
    table = ClockTable(tuple(sorted(clocks.items())), floor=floor)
    return replace(state, table=table, joined=state.joined | {worker_id}), clock


def leave(state: ShardClocks, worker_id: WorkerId) -> ShardClocks:
    """Drop ``worker_id`` from the table for good."""
    try:
        table = state.table.without_worker(worker_id)
    except ClockError as exc:
        raise Refused("unknown_worker", str(exc)) from None
    return replace(state, table=table, departed=state.departed | {worker_id})


def push(state: ShardClocks, worker_id: WorkerId, clock: int) -> ShardClocks | None:
    """The state after ``worker_id``'s push tagged ``clock``; ``None`` for a retry of the previous
    clock (acknowledge, do not apply)."""
    current = state.clock_of(worker_id)
    if type(clock) is int and clock == current - 1:
        return None
    try:
        table = state.table.advance(worker_id, clock)
    except (ClockError, TypeError) as exc:
        raise Refused("bad_clock", str(exc)) from None
    return replace(state, table=table)


def check_pull(state: ShardClocks, model: ConsistencyModel, worker_id: WorkerId, clock: object) -> bool:
    """Whether ``worker_id``'s pull for ``clock`` can be served now; ``Refused`` if invalid."""
    current = state.clock_of(worker_id)
    ahead = max_pull_ahead(model)
    if type(clock) is not int or not 0 <= clock <= current + ahead:
        raise Refused(
            "bad_clock",
            f"pull for clock {clock!r} by worker {worker_id}: must be in [0, {current + ahead}] "
            "(its pushes so far" + (", plus one: read-ahead)" if ahead else ")"),
        )
    if isinstance(model, ASP):
        return True
    return state.complete and may_serve_pull(model, state.table, worker_id, clock)


def blocked_reason(state: ShardClocks, model: ConsistencyModel, clock: int) -> str:
    """Why a pull for ``clock`` still waits: the ``c_global`` it needs and who is behind."""
    lag = allowed_lag(model) or 0
    slow = [w for w, c in state.table.entries if c < clock - lag]
    return (
        f"c_global={state.table.c_global} must reach {clock - lag}; workers behind: "
        f"{slow[:16]}; joined {len(state.joined)}/{state.num_workers}"
    )
