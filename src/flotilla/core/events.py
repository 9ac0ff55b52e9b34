"""The one small discrete-event core shared by flotilla's mini-simulators (``ps/consistency.simulate``,
``ps/wsp.simulate_wsp``, ``pipeline/timeline.dry_run``) and, later, the simulator proper.

Pure: no wall clock (time is a number the caller chooses: ticks or modelled seconds), no threads,
no I/O, no torch.

:class:`EventQueue` holds ``(time, priority, tie, seq, payload)`` entries and pops them in that
order:
- ``time`` first (earliest first);
- then ``priority`` (lower first): a simulator uses it to order kinds of events at the same time
  (e.g. completions before starts);
- then ``tie``: any comparable key the caller passes, e.g. a seeded random number for a seeded
  random order of simultaneous events, or a worker index;
- then ``seq``, the insertion order, so equal keys pop first-in first-out and payloads are never
  compared.

So a run is a deterministic function of the events pushed (and of the caller's seed).
:func:`run_until` drives a queue with a handler until it is empty, a time limit or a predicate.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Event", "EventQueue", "run_until"]

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class Event(Generic[P]):
    """One scheduled event: ``payload`` happens at ``time``."""

    time: float
    priority: int
    tie: float
    seq: int
    payload: P


class EventQueue(Generic[P]):
    """A time-ordered queue of events with deterministic tie-breaking (see the module doc)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, float, int, P]] = []
        self._seq = itertools.count()
        self.now: float = 0.0  # time of the last popped event

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, time: float, payload: P, *, priority: int = 0, tie: float = 0.0) -> None:
        """Schedule ``payload`` at ``time`` (not before the current time)."""
        if time < self.now:
            raise ValueError(f"EventQueue.push: time {time} is before the current time {self.now}")
        heapq.heappush(self._heap, (time, priority, tie, next(self._seq), payload))

    def peek_time(self) -> float | None:
        """Time of the next event, ``None`` if the queue is empty."""
        return self._heap[0][0] if self._heap else None

    def pop(self) -> Event[P]:
        """The next event; advances :attr:`now` to its time."""
        time, priority, tie, seq, payload = heapq.heappop(self._heap)
        self.now = time
        return Event(time, priority, tie, seq, payload)

    def pop_simultaneous(self) -> list[Event[P]]:
        """Every event at the next event's time, in queue order (events pushed meanwhile at that
        same time are not included)."""
        first = self.pop()
        out = [first]
        while self._heap and self._heap[0][0] == first.time:
            out.append(self.pop())
        return out

    def drain(self) -> Iterator[Event[P]]:
        """Pop events until the queue is empty (handlers may push more meanwhile)."""
        while self._heap:
            yield self.pop()


def run_until(
    queue: EventQueue[P],
    handle: Callable[[Event[P]], None],
    *,
    until: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> float:
    """Pop and ``handle`` events in order until the queue is empty, the next event is later than
    ``until``, or ``stop()`` is true after an event; returns the time of the last event handled."""
    while queue:
        next_time = queue.peek_time()
        if until is not None and next_time is not None and next_time > until:
            break
        handle(queue.pop())
        if stop is not None and stop():
            break
    return queue.now
