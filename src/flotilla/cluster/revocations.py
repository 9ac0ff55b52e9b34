"""Revocation schedules (pure): which workers are killed, stopped and added, and when (SPEC §8).

A :class:`RevocationSchedule` combines three optional sources, and :func:`plan_revocations`
expands it into ONE sorted tuple of :class:`RevocationAction` that a launcher executes:

- **explicit events**: ``kill`` (SIGKILL; with ``notice_s``, SIGTERM at the event and SIGKILL
  ``notice_s`` later), ``stop`` (SIGSTOP, SIGCONT ``duration_s`` later), ``add`` (start a worker
  process that joins: a new name, or a restart of a worker killed earlier), each at ``at_s``
  seconds from the start of the run or at the start of step ``at_step``;
- a seeded **random** rate: Poisson arrivals (mean gap ``mean_interval_s``) between ``start_s``
  and ``stop_s``; each kills a live worker drawn uniformly, unless that would leave fewer than
  ``min_alive`` alive (the arrival is then skipped), and restarts it ``respawn_after_s`` later
  (``None``: never);
- the replay of a recorded spot **trace** (:mod:`flotilla.cluster.revocation_trace`).

Ownership (so that every source can be checked on its own): the workers named by an event are
*scripted* -- only events touch them.  ``random`` kills only unscripted workers; ``trace`` drives
the unscripted workers (they are its initial nodes, in the cluster's order) and adds ``spot-k``
workers; ``random`` and ``trace`` cannot be combined.  One worker's events all use ``at_s`` or all
``at_step``: the two axes are independent (the launcher watches the clock and the step counter),
so an order across them cannot be checked.

The clock of the timed actions starts at the job's start, or -- with ``time_from_step`` set on the
schedule -- once the job has reached that step (each timed action of the plan then carries it as
``from_step``; the launcher starts the clock when it sees the step), so that revocations begin
when training does, however long the start-up took on a given machine.

Invariants of a plan: sorted by axis (timed actions first), then time or step, then kind (kills,
then stops, then adds at equal times), then worker name; on each axis a worker is killed or stopped
only while alive, added only while not alive (a timed kill with notice leaves at ``at_s`` and may
be restarted from ``at_s + notice_s``), and stops of one worker do not overlap in time; the same
schedule, workers and horizon give the same plan (random draws come from ``random.Random(seed)``).

Assumptions: all workers of the cluster are alive at time 0 / step 0; a kill of a stopped worker
is allowed (its SIGCONT is then moot); ``min_alive`` counts workers on the time axis only.
"""

from __future__ import annotations

import heapq
import random as _random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from flotilla.cluster.revocation_trace import TraceAction, TraceError, TraceReplay, replay_trace
from flotilla.core.errors import ConfigError

__all__ = [
    "Action",
    "RandomRevocations",
    "RevocationAction",
    "RevocationError",
    "RevocationSchedule",
    "check_events",
    "check_schedule",
    "plan_revocations",
]


class RevocationError(ConfigError):
    """A schedule that cannot be planned.  ``where`` is the dotted path of the culprit inside the
    schedule (``"events.3.worker"``, ``"random.min_alive"``, ``"trace.start_ms"``)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


class Action(Enum):
    """What happens to a worker process."""

    KILL = "kill"  # SIGKILL (SIGTERM first when notice_s is set)
    STOP = "stop"  # SIGSTOP, then SIGCONT after duration_s
    ADD = "add"  # start a process that joins (new worker or restart)


_RANK = {Action.KILL: 0, Action.STOP: 1, Action.ADD: 2}  # order at equal times


@dataclass(frozen=True, kw_only=True, slots=True)
class RevocationAction:
    """One action of a plan (or one explicit event): exactly one of ``at_s`` (>= 0) and
    ``at_step`` (>= 0); ``notice_s`` (> 0) only on a kill; ``duration_s`` (> 0) on every stop."""

    action: Action
    worker: str
    at_s: float | None = None
    at_step: int | None = None
    notice_s: float | None = None
    duration_s: float | None = None
    from_step: int | None = None  # a timed action: at_s counts from when the job reached this step

    def __post_init__(self) -> None:
        if self.from_step is not None and (self.at_s is None or self.from_step < 0):
            raise ValueError(f"from_step must be >= 0 and only on a timed action (got {self.from_step})")
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(f"set exactly one of at_s, at_step (got {self.at_s}, {self.at_step})")
        if (self.at_s is not None and not self.at_s >= 0) or (self.at_step is not None and self.at_step < 0):
            raise ValueError(f"at_s/at_step must be >= 0 (got {self.at_s}, {self.at_step})")
        if self.notice_s is not None and (self.action is not Action.KILL or not self.notice_s > 0):
            raise ValueError(
                f"notice_s must be > 0 and only on a kill (got {self.notice_s} on {self.action})"
            )
        if (self.duration_s is not None) != (self.action is Action.STOP) or (
            self.duration_s is not None and not self.duration_s > 0
        ):
            raise ValueError(f"a stop, and only a stop, takes duration_s > 0 (got {self.duration_s})")

    @property
    def timed(self) -> bool:
        """Whether the action is on the time axis (``at_s``) rather than the step axis."""
        return self.at_s is not None

    @property
    def when(self) -> str:
        """``"12.5 s"`` or ``"step 40"``, for messages."""
        return f"{self.at_s:g} s" if self.at_s is not None else f"step {self.at_step}"

    def sort_key(self) -> tuple[int, float, int, str]:
        """The plan order: axis (timed first), time or step, kind (kill, stop, add), worker."""
        at = self.at_s if self.at_s is not None else float(self.at_step or 0)
        return (0 if self.timed else 1, at, _RANK[self.action], self.worker)


@dataclass(frozen=True, kw_only=True, slots=True)
class RandomRevocations:
    """Seeded Poisson kills of random unscripted workers (see the module docstring)."""

    mean_interval_s: float
    seed: int = 0
    respawn_after_s: float | None = None
    start_s: float = 0.0
    stop_s: float | None = None  # None: until the plan's horizon
    min_alive: int = 1

    def __post_init__(self) -> None:
        if not self.mean_interval_s > 0:
            raise RevocationError(f"must be > 0 (got {self.mean_interval_s})", "random.mean_interval_s")
        if self.respawn_after_s is not None and not self.respawn_after_s >= 0:
            raise RevocationError(
                f"must be >= 0 or null (got {self.respawn_after_s})", "random.respawn_after_s"
            )
        if not self.start_s >= 0:
            raise RevocationError(f"must be >= 0 (got {self.start_s})", "random.start_s")
        if self.stop_s is not None and not self.stop_s > self.start_s:
            raise RevocationError(
                f"must be > start_s ({self.start_s:g}) (got {self.stop_s:g})", "random.stop_s"
            )
        if self.min_alive < 1:
            raise RevocationError(f"must be >= 1 (got {self.min_alive})", "random.min_alive")


@dataclass(frozen=True, kw_only=True, slots=True)
class RevocationSchedule:
    """Explicit events, a random rate and a trace replay: each optional; random and trace
    exclude each other.  ``time_from_step``: the timed actions' clock starts once the job has
    reached this step (None: at the job's start)."""

    events: tuple[RevocationAction, ...] = ()
    random: RandomRevocations | None = None
    trace: TraceReplay | None = None
    time_from_step: int | None = None

    def __post_init__(self) -> None:
        if self.time_from_step is not None and self.time_from_step < 0:
            raise RevocationError(f"must be >= 0 or null (got {self.time_from_step})", "time_from_step")
        if self.random is not None and self.trace is not None:
            raise RevocationError(
                "set random or trace, not both: both drive the workers that no event names "
                "(combine either with explicit events)",
                "random",
            )

    def scripted(self) -> frozenset[str]:
        """The workers named by an explicit event (only events touch them)."""
        return frozenset(event.worker for event in self.events)


# ------------------------------------------------------------------------------------ events


@dataclass(slots=True)
class _Life:
    """What the event check knows about one worker while it walks the sorted events."""

    alive: bool
    last: int | None = None  # index of the event that last changed ``alive``
    free_at_s: float = 0.0  # a timed kill with notice: restartable from here
    stopped_until_s: float = 0.0


def _check_one(events: Sequence[RevocationAction], i: int, life: _Life) -> None:
    event, where = events[i], f"events.{i}"
    because = ""
    if life.last is not None:
        verb = "added" if life.alive else "killed"
        because = f" (event {life.last} {verb} it at {events[life.last].when})"
    if event.action is Action.ADD:
        if life.alive:
            raise RevocationError(
                f"worker {event.worker!r} is already alive at {event.when}{because}; add starts a new "
                "worker or restarts a killed one",
                f"{where}.worker",
            )
        if event.at_s is not None and event.at_s < life.free_at_s:
            raise RevocationError(
                f"worker {event.worker!r} is still leaving until {life.free_at_s:g} s{because} "
                f"(kill with notice_s); restart it at or after that time",
                f"{where}.at_s",
            )
        return
    if not life.alive:
        hint = because or " (it has not been added yet)"
        raise RevocationError(
            f"worker {event.worker!r} is not alive at {event.when}{hint}; cannot {event.action.value} it",
            f"{where}.worker",
        )
    if event.action is Action.STOP and event.at_s is not None:
        if event.at_s < life.stopped_until_s:
            raise RevocationError(
                f"worker {event.worker!r} is already stopped until {life.stopped_until_s:g} s; stops of "
                "one worker may not overlap",
                f"{where}.at_s",
            )
        life.stopped_until_s = event.at_s + (event.duration_s or 0.0)


def check_events(events: Sequence[RevocationAction], workers: Sequence[str]) -> None:
    """Raise :class:`RevocationError` (``where`` = ``events.<index>.<field>``) unless every event
    names a known worker (a cluster worker or one an add event names), each worker's events use
    one axis, and, in plan order, each kill/stop finds its worker alive and each add finds it not
    alive (see the module docstring)."""
    added = {event.worker for event in events if event.action is Action.ADD}
    axis: dict[str, int] = {}
    for i, event in enumerate(events):
        if event.worker not in workers and event.worker not in added:
            raise RevocationError(
                f"unknown worker {event.worker!r}; allowed: {', '.join(workers)} or a worker that an "
                "add event starts",
                f"events.{i}.worker",
            )
        first = axis.setdefault(event.worker, i)
        if events[first].timed != event.timed:
            raise RevocationError(
                f"worker {event.worker!r} has events at_s and at_step (event {first}); one worker's "
                "events must all use the same one, or their order cannot be checked",
                f"events.{i}.{'at_s' if event.timed else 'at_step'}",
            )
    lives = {name: _Life(alive=name in workers) for name in {*workers, *added}}
    for i in sorted(range(len(events)), key=lambda k: events[k].sort_key()):
        event, life = events[i], lives[events[i].worker]
        _check_one(events, i, life)
        if event.action is not Action.STOP:
            life.alive, life.last = event.action is Action.ADD, i
        if event.action is Action.KILL and event.at_s is not None:
            life.free_at_s, life.stopped_until_s = event.at_s + (event.notice_s or 0.0), 0.0


# ------------------------------------------------------------------------------ random, trace


def _check_random(rnd: RandomRevocations, workers: Sequence[str], pool: Sequence[str]) -> None:
    if not pool:
        raise RevocationError(
            "every worker is named by an event; random kills only workers that no event names", "random"
        )
    if rnd.min_alive >= len(workers):
        raise RevocationError(
            f"must be < the number of workers ({len(workers)}), or no worker can ever be killed "
            f"(got {rnd.min_alive})",
            "random.min_alive",
        )


def _random_actions(
    rnd: RandomRevocations,
    workers: Sequence[str],
    pool: Sequence[str],
    timed_events: Sequence[RevocationAction],
    horizon_s: float | None,
) -> list[RevocationAction]:
    """Simulate the Poisson kills on the time axis, the explicit timed events applied as time
    passes so that ``min_alive`` counts every worker; a respawn is planned with its kill (the
    caller drops what lies beyond the horizon)."""
    ends = [end for end in (rnd.stop_s, horizon_s) if end is not None]
    if not ends:
        raise ValueError("random revocations need random.stop_s or a horizon_s to end")
    end, rng = min(ends), _random.Random(rnd.seed)
    alive = set(workers)
    scripted = [e for e in sorted(timed_events, key=RevocationAction.sort_key) if e.action is not Action.STOP]
    respawns: list[tuple[float, str]] = []  # heap of (at_s, worker)
    actions: list[RevocationAction] = []
    t, next_event = rnd.start_s, 0
    while True:
        t += rng.expovariate(1.0 / rnd.mean_interval_s)
        if t > end:
            break
        while next_event < len(scripted) and (scripted[next_event].at_s or 0.0) <= t:
            event = scripted[next_event]
            (alive.add if event.action is Action.ADD else alive.discard)(event.worker)
            next_event += 1
        while respawns and respawns[0][0] < t:  # a worker respawning exactly at t is not yet alive
            alive.add(heapq.heappop(respawns)[1])
        candidates = [name for name in pool if name in alive]
        if len(alive) - 1 < rnd.min_alive or not candidates:
            continue  # the arrival is skipped
        victim = rng.choice(candidates)
        alive.discard(victim)
        actions.append(RevocationAction(action=Action.KILL, worker=victim, at_s=t))
        if rnd.respawn_after_s is not None:
            heapq.heappush(respawns, (t + rnd.respawn_after_s, victim))
            actions.append(RevocationAction(action=Action.ADD, worker=victim, at_s=t + rnd.respawn_after_s))
    return actions


def _trace_actions(schedule: RevocationSchedule, workers: Sequence[str]) -> list[RevocationAction]:
    assert schedule.trace is not None
    scripted = schedule.scripted()
    unscripted = [name for name in workers if name not in scripted]
    try:
        changes = replay_trace(schedule.trace, unscripted, taken=scripted)
    except TraceError as err:
        named = sorted(scripted & set(workers))
        note = (
            f"; the trace drives only the workers that no event names (events name {named})" if named else ""
        )
        raise RevocationError(f"{err}{note}", f"trace.{err.field}") from None
    kind = {TraceAction.ADD: Action.ADD, TraceAction.REMOVE: Action.KILL}
    return [RevocationAction(action=kind[c.action], worker=c.worker, at_s=c.at_s) for c in changes]


# -------------------------------------------------------------------------------------- plan


def check_schedule(schedule: RevocationSchedule, workers: Sequence[str]) -> None:
    """Raise :class:`RevocationError` for a schedule that cannot run on ``workers`` (the
    cluster's worker names, in order): bad events (:func:`check_events`), a trace whose initial
    nodes do not match the unscripted workers, a random rate with nothing to kill.  The random
    draws themselves need a horizon and are valid by construction."""
    check_events(schedule.events, workers)
    scripted = schedule.scripted()
    if schedule.random is not None:
        _check_random(schedule.random, workers, [name for name in workers if name not in scripted])
    if schedule.trace is not None:
        _trace_actions(schedule, workers)


def plan_revocations(
    schedule: RevocationSchedule,
    workers: Sequence[str],
    *,
    horizon_s: float | None = None,
    horizon_steps: int | None = None,
) -> tuple[RevocationAction, ...]:
    """The one sorted plan of ``schedule`` on ``workers`` (the cluster's worker names, in
    order): timed actions with ``at_s <= horizon_s`` and step actions with ``at_step <=
    horizon_steps`` (``None``: no bound; a random rate without ``stop_s`` needs ``horizon_s``);
    with ``schedule.time_from_step``, every timed action carries it as ``from_step``.
    Deterministic; raises :class:`RevocationError` like :func:`check_schedule`."""
    check_schedule(schedule, workers)
    actions = list(schedule.events)
    if schedule.trace is not None:
        actions += _trace_actions(schedule, workers)
    if schedule.random is not None:
        scripted = schedule.scripted()
        pool = [name for name in workers if name not in scripted]
        timed = [event for event in schedule.events if event.timed]
        actions += _random_actions(schedule.random, workers, pool, timed, horizon_s)
    kept = [
        a
        for a in actions
        if (a.at_s is None or horizon_s is None or a.at_s <= horizon_s)
        and (a.at_step is None or horizon_steps is None or a.at_step <= horizon_steps)
    ]
    if schedule.time_from_step is not None:
        kept = [replace(a, from_step=schedule.time_from_step) if a.timed else a for a in kept]
    return tuple(sorted(kept, key=RevocationAction.sort_key))
