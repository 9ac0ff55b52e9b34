"""Spot-instance traces (pure): parse ``time_ms,add|remove,node`` text and replay it onto workers.

The trace half of revocation schedules; :mod:`flotilla.cluster.revocations` merges the replay with
explicit events and turns it into kill/add actions.  No I/O: the trace *text* comes in (the config
layer reads the file), and no clock: times are data.

Format (the Bamboo traces in ``examples/traces/``): one event per line, ``time_ms,add|remove,node``,
``time_ms`` a whole number of milliseconds from the trace start, times non-decreasing.  Blank lines
and lines starting with ``#`` are skipped; ``\\r\\n`` line ends are accepted.  An error names the
source and the 1-based line number.

Replay rule (nodes -> workers), see :func:`replay_trace`:

- the run starts at ``start_ms``: events at or before it are folded into the *initial* nodes -- the
  nodes alive then, in the order they were added, at most ``max_workers`` of them;
- the replay owns ``max_workers`` *slots*: slot ``i`` of the ``n`` initial nodes is the ``i``-th
  given worker (the cluster's workers, in order), their number must equal ``n`` (refused
  otherwise, naming both counts); the other slots are named ``spot-0``, ``spot-1``, ...;
- after the start, a ``remove`` of a running node frees its slot (a kill of that slot's worker);
  an ``add`` of a node not running takes the lowest free slot (an add: a restart when the slot's
  worker ran before, a new worker otherwise); an add when all ``max_workers`` slots are busy is
  skipped, as is an add of a running node; a remove of a node not running (skipped, never added,
  already removed) is ignored; a node added and removed at the same millisecond leaves no trace;
- ``at_s = (time_ms - start_ms) / 1000 / time_scale`` (``time_scale``: trace seconds per run second).

Invariants of a replay: changes are sorted by ``at_s``; at most ``max_workers`` slots are alive;
each worker's changes alternate, starting with a remove for an initial worker and with an add for
a ``spot-`` slot.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from flotilla.core.errors import ConfigError

__all__ = [
    "SPOT_PREFIX",
    "SlotChange",
    "TraceAction",
    "TraceError",
    "TraceEvent",
    "TraceReplay",
    "initial_nodes",
    "parse_trace",
    "replay_trace",
]

SPOT_PREFIX = "spot-"  # the slots beyond the initial workers: spot-0, spot-1, ...
_NODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TIME = re.compile(r"\d{1,15}")
_FORMAT = "time_ms,add|remove,node"


class TraceError(ConfigError):
    """A trace that cannot be parsed or replayed.  ``field`` names the replay setting at fault
    (``"file"`` for the text itself); ``line`` is the 1-based line number, when one is at fault."""

    def __init__(self, message: str, *, field: str = "file", line: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.line = line


class TraceAction(Enum):
    """What a trace line says happened to a node."""

    ADD = "add"
    REMOVE = "remove"


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceEvent:
    """One parsed trace line."""

    time_ms: int
    action: TraceAction
    node: str
    line: int  # 1-based line number in the trace text


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceReplay:
    """How to replay a parsed trace: scaled by ``time_scale`` (> 0, trace seconds per run
    second), at most ``max_workers`` (>= 1) alive, starting at ``start_ms`` (>= 0)."""

    events: tuple[TraceEvent, ...]
    time_scale: float = 1.0
    max_workers: int
    start_ms: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise TraceError(f"must be > 0 (got {self.time_scale})", field="time_scale")
        if self.max_workers < 1:
            raise TraceError(f"must be >= 1 (got {self.max_workers})", field="max_workers")
        if self.start_ms < 0:
            raise TraceError(f"must be >= 0 (got {self.start_ms})", field="start_ms")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotChange:
    """A worker slot starts (``ADD``) or stops (``REMOVE``) at ``at_s`` run seconds; ``line`` is
    the trace line that caused it."""

    at_s: float
    action: TraceAction
    worker: str
    line: int


def parse_trace(text: str, *, source: str = "<trace>") -> tuple[TraceEvent, ...]:
    """The events of a trace text, in order.  Raises :class:`TraceError` naming ``source`` and
    the line number for a line that is not ``time_ms,add|remove,node``, an unknown action, a
    time earlier than the line before, and for a trace without events."""
    events: list[TraceEvent] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        event = _parse_line(line, number, source)
        if events and event.time_ms < events[-1].time_ms:
            previous = events[-1]
            raise TraceError(
                f"{source}:{number}: time {event.time_ms} ms is before {previous.time_ms} ms on line "
                f"{previous.line} (times must be non-decreasing)",
                line=number,
            )
        events.append(event)
    if not events:
        raise TraceError(f"{source}: no events (expected lines {_FORMAT})")
    return tuple(events)


def _parse_line(line: str, number: int, source: str) -> TraceEvent:
    fields = [field.strip() for field in line.split(",")]
    where = f"{source}:{number}"
    if len(fields) != 3:
        raise TraceError(f"{where}: expected {_FORMAT} (got {line[:60]!r})", line=number)
    time_text, action_text, node = fields
    if _TIME.fullmatch(time_text) is None:
        raise TraceError(
            f"{where}: time_ms must be a whole number of milliseconds >= 0 (got {time_text[:30]!r})",
            line=number,
        )
    try:
        action = TraceAction(action_text)
    except ValueError:
        raise TraceError(
            f"{where}: unknown action {action_text[:30]!r}; allowed: add, remove", line=number
        ) from None
    if _NODE.fullmatch(node) is None:
        raise TraceError(
            f"{where}: node must be 1-64 letters, digits, '_', '-' or '.' (got {node[:30]!r})", line=number
        )
    return TraceEvent(time_ms=int(time_text), action=action, node=node, line=number)


def _fold(events: Sequence[TraceEvent], cap: int) -> dict[str, None]:
    """The nodes alive after ``events``, in the order they were added (at most ``cap``)."""
    alive: dict[str, None] = {}
    for event in events:
        if event.action is TraceAction.ADD and event.node not in alive and len(alive) < cap:
            alive[event.node] = None
        elif event.action is TraceAction.REMOVE:
            alive.pop(event.node, None)
    return alive


def initial_nodes(replay: TraceReplay) -> tuple[str, ...]:
    """The nodes alive at ``start_ms`` (events at or before it folded), in the order they were
    added, at most ``max_workers``: the workers the run starts with, one per node."""
    before = [event for event in replay.events if event.time_ms <= replay.start_ms]
    return tuple(_fold(before, replay.max_workers))


def _check_initial(replay: TraceReplay, workers: Sequence[str]) -> None:
    nodes = initial_nodes(replay)
    if len(nodes) == len(workers):
        return
    if not nodes:
        later = next((e for e in replay.events if e.action is TraceAction.ADD), None)
        hint = f"the first add is at {later.time_ms} ms on line {later.line}" if later else "it adds no node"
        raise TraceError(
            f"no node is alive at start_ms={replay.start_ms} ({hint}); choose a later start_ms",
            field="start_ms",
        )
    given = f"{len(workers)} {'is' if len(workers) == 1 else 'are'} given ({', '.join(workers) or 'none'})"
    raise TraceError(
        f"the trace has {len(nodes)} nodes alive at start_ms={replay.start_ms} (at most "
        f"max_workers={replay.max_workers}), so it starts {len(nodes)} workers, but {given}; "
        "make the counts equal (max_workers, start_ms or the number of workers)",
        field="max_workers",
    )


def _slots(replay: TraceReplay, workers: Sequence[str], taken: Collection[str]) -> list[str]:
    extra = [f"{SPOT_PREFIX}{k}" for k in range(replay.max_workers - len(workers))]
    clash = sorted(set(extra) & (set(taken) | set(workers)))
    if clash:
        raise TraceError(
            f"the trace names its extra workers {SPOT_PREFIX}0..{SPOT_PREFIX}{len(extra) - 1}, "
            f"but {clash} already name other workers; rename them",
            field="max_workers",
        )
    return [*workers, *extra]


def replay_trace(
    replay: TraceReplay, workers: Sequence[str], *, taken: Collection[str] = ()
) -> tuple[SlotChange, ...]:
    """The worker changes of ``replay`` after ``start_ms`` under the rule of this module's
    docstring.  ``workers`` are the workers the trace starts with (one per initial node, in
    order); ``taken`` are names the ``spot-`` slots must not reuse.  Raises :class:`TraceError`
    when the counts differ or a slot name is taken."""
    _check_initial(replay, workers)
    slots = _slots(replay, workers, taken)
    slot_of: dict[str, int] = {node: i for i, node in enumerate(initial_nodes(replay))}
    added_at: dict[str, tuple[int, int]] = {}  # node -> (time_ms, index of its add in changes)
    changes: list[SlotChange | None] = []
    for event in replay.events:
        if event.time_ms <= replay.start_ms:
            continue
        at_s = (event.time_ms - replay.start_ms) / 1000.0 / replay.time_scale
        if event.action is TraceAction.ADD:
            free = sorted(set(range(len(slots))) - set(slot_of.values()))
            if event.node in slot_of or not free:
                continue  # already running, or max_workers alive: skipped
            slot_of[event.node] = free[0]
            added_at[event.node] = (event.time_ms, len(changes))
            changes.append(SlotChange(at_s=at_s, action=event.action, worker=slots[free[0]], line=event.line))
        elif event.node in slot_of:
            slot = slot_of.pop(event.node)
            time_ms, index = added_at.pop(event.node, (-1, -1))
            if time_ms == event.time_ms:
                changes[index] = None  # added and removed at the same millisecond
                continue
            changes.append(SlotChange(at_s=at_s, action=event.action, worker=slots[slot], line=event.line))
    return tuple(change for change in changes if change is not None)
