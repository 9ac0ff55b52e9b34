"""Dry-run of a schedule: replay every stage's action list with modelled durations (pure).

Execution model (the one the stage runtime implements):

- each stage executes its actions strictly in order on one compute stream;
- compute actions (``Forward``, ``Backward``, ``OptimizerStep``) occupy the stage for their
  duration;
- sends never block the stage: the message travels on the directed link (src, dst) for the send's
  duration; a link carries one message at a time (FIFO), so a send starts when the stage issues it
  AND the link is free; its timeline entry spans the transfer;
- a receive blocks the stage until the matching message (same direction, microbatch, src, dst) has
  arrived; its timeline entry spans the wait (zero length when the message was already there).

The replay runs on the shared discrete-event core (``flotilla.core.events``): each stage runs its
actions until a receive finds no message; the matching send later wakes it with an event at the
message's arrival time.  The result does not depend on the order in which stages are simulated
(each stage's times follow from its own list and the arrival times of its messages).  If no stage
can move while some still have actions left (the event queue is empty), the schedule deadlocks
and ``dry_run`` raises ``ScheduleError`` naming every blocked stage and the receive it waits on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.events import Event, EventQueue, run_until
from flotilla.pipeline.schedule import (
    COMPUTE_ACTIONS,
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    format_action,
)


class ScheduleError(FlotillaError):
    """A schedule cannot run (deadlock, unmatched communication, inconsistent versions)."""


class TimelineEntry(NamedTuple):
    """One executed action: ``(stage_idx, action, start_s, end_s)``."""

    stage_idx: int
    action: Action
    start_s: float
    end_s: float


Timeline = list[TimelineEntry]
Durations = Callable[[int, Action], float]


def unit_durations(stage_idx: int, action: Action) -> float:
    """Forward and backward take 1, everything else 0 (the textbook bubble picture)."""
    return 1.0 if isinstance(action, (Forward, Backward)) else 0.0


MessageKey = tuple[str, int, int, int]


def message_key(stage_idx: int, action: Action) -> MessageKey:
    """(direction, microbatch, src, dst) of a send or receive executed on ``stage_idx``."""
    if isinstance(action, SendAct):
        return ("act", action.microbatch_idx, stage_idx, action.peer_stage)
    if isinstance(action, RecvAct):
        return ("act", action.microbatch_idx, action.peer_stage, stage_idx)
    if isinstance(action, SendGrad):
        return ("grad", action.microbatch_idx, stage_idx, action.peer_stage)
    if isinstance(action, RecvGrad):
        return ("grad", action.microbatch_idx, action.peer_stage, stage_idx)
    raise TypeError(f"not a communication action: {action!r}")


class _Sim:
    """Mutable state of one dry-run (internal).  Each stage is a process that runs its actions
    until it must wait for a message; delivering that message is an event on the shared
    ``EventQueue`` that wakes the stage at the message's arrival time."""

    def __init__(self, schedule: Schedule, durations: Durations) -> None:
        self.schedule = schedule
        self.durations = durations
        self.pcs = [0] * schedule.num_stages
        self.clock = [0.0] * schedule.num_stages
        self.link_free: dict[tuple[int, int], float] = {}
        self.in_flight: dict[MessageKey, deque[float]] = {}
        self.waiting: dict[MessageKey, int] = {}  # message -> the stage blocked on it
        self.queue: EventQueue[int] = EventQueue()  # payload: the stage to wake
        self.entries: Timeline = []

    def step(self, i: int) -> bool:
        """Execute stage i's next action if it can run; return whether it did."""
        action = self.schedule.stages[i][self.pcs[i]]
        if isinstance(action, (RecvAct, RecvGrad)):
            key = message_key(i, action)
            queue = self.in_flight.get(key)
            if not queue:
                self.waiting[key] = i
                return False
            arrival = queue.popleft()
            end = max(self.clock[i], arrival)
            self.entries.append(TimelineEntry(i, action, self.clock[i], end))
            self.clock[i] = end
        elif isinstance(action, (SendAct, SendGrad)):
            key = message_key(i, action)
            link = (i, action.peer_stage)
            start = max(self.clock[i], self.link_free.get(link, 0.0))
            arrival = start + self.durations(i, action)
            self.link_free[link] = arrival
            self.in_flight.setdefault(key, deque()).append(arrival)
            self.entries.append(TimelineEntry(i, action, start, arrival))
            receiver = self.waiting.pop(key, None)
            if receiver is not None:
                self.queue.push(max(arrival, self.queue.now), receiver, tie=receiver)
        else:
            start = self.clock[i]
            self.clock[i] = start + self.durations(i, action)
            self.entries.append(TimelineEntry(i, action, start, self.clock[i]))
        self.pcs[i] += 1
        return True

    def advance(self, event: Event[int]) -> None:
        """Run the woken stage until it blocks on a receive or finishes."""
        i, stage = event.payload, self.schedule.stages[event.payload]
        while self.pcs[i] < len(stage) and self.step(i):
            pass

    def run(self) -> Timeline:
        stages = self.schedule.stages
        for i in range(self.schedule.num_stages):
            self.queue.push(0.0, i, tie=i)
        run_until(self.queue, self.advance)
        blocked = [i for i in range(self.schedule.num_stages) if self.pcs[i] < len(stages[i])]
        if blocked:
            waits = ", ".join(
                f"stage {i} at action {self.pcs[i]} ({format_action(stages[i][self.pcs[i]])})"
                for i in blocked
            )
            raise ScheduleError(f"deadlock: no stage can proceed; blocked: {waits}")
        self.entries.sort(key=lambda e: (e.start_s, e.stage_idx, e.end_s))
        return self.entries


def dry_run(schedule: Schedule, durations: Durations | None = None) -> Timeline:
    """Simulate ``schedule`` with ``durations(stage_idx, action) -> seconds`` (default: unit forward
    and backward, everything else free); raises ``ScheduleError`` on deadlock."""
    return _Sim(schedule, durations or unit_durations).run()


def _per_stage(name: str, value: float | Sequence[float], count: int) -> tuple[float, ...]:
    values = (float(value),) * count if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != count or any(v < 0 for v in values):
        raise ConfigError(f"{name} must be a number >= 0 or {count} numbers >= 0, got {value!r}")
    return values


def modelled_timeline(
    schedule: Schedule,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    comm_s: float | Sequence[float] = 0.0,
    optimizer_s: float | Sequence[float] = 0.0,
) -> Timeline:
    """Dry-run with per-stage forward/backward/optimizer times (seconds per microbatch, one number
    for all stages or one per stage) and per-boundary transfer times (``comm_s[i]`` for the link
    between stage i and i+1, both directions)."""
    p = schedule.num_stages
    fwd = _per_stage("forward_s", forward_s, p)
    bwd = _per_stage("backward_s", backward_s, p)
    opt = _per_stage("optimizer_s", optimizer_s, p)
    comm = _per_stage("comm_s", comm_s, max(p - 1, 0)) if p > 1 else ()

    def durations(i: int, action: Action) -> float:
        if isinstance(action, Forward):
            return fwd[i]
        if isinstance(action, Backward):
            return bwd[i]
        if isinstance(action, OptimizerStep):
            return opt[i]
        if isinstance(action, (SendAct, SendGrad)):
            return comm[min(i, action.peer_stage)]
        return 0.0

    return dry_run(schedule, durations)


def makespan_s(timeline: Sequence[TimelineEntry]) -> float:
    """Time from the first start to the last end."""
    if not timeline:
        return 0.0
    return max(e.end_s for e in timeline) - min(e.start_s for e in timeline)


def bubble_fraction(timeline: Sequence[TimelineEntry], num_stages: int) -> float:
    """Share of stage-time spent idle: 1 - (compute busy time) / (num_stages * makespan)."""
    span = makespan_s(timeline)
    if span <= 0:
        return 0.0
    busy = sum(e.end_s - e.start_s for e in timeline if isinstance(e.action, COMPUTE_ACTIONS))
    return 1.0 - busy / (num_stages * span)
