"""The spread of the workers' parameter-server clocks over time, from their metrics records.

Pure (no I/O, no wall clock): the coordinator feeds it the ``(time_s, clock)`` of every training
record as heartbeats bring them in, and reads the spread for the live display and the summary.

Why not just ``max - min`` of each worker's latest reported clock: heartbeats ship a worker's
records every 0.25 s, so the latest clocks of two workers can be a quarter of a second apart; at
40 clocks/s that showed a "clock spread" of 10 under SSP(3).  Here every worker's clock is taken
*at the same time*: records are swept in ``time_s`` order up to the watermark, the earliest
"latest record time" of the workers still reporting.  No record at or before the watermark can
still arrive (each worker's records arrive in its own time order), so the spread of the swept
state is exact, and ``max_spread`` is the exact maximum over every instant swept.

What the figures mean: a record for clock ``c`` is written after the worker's ``push_pull(c)``
returned, i.e. after its push of clock ``c`` and its pull of the weights for ``c + 1``.  Under
SSP(s) that pull waited until every worker had pushed clock ``c - s``, but the slowest worker's
own record follows the push that released the others, so the recorded spread can reach
``s + 1`` (BSP: 1).  ``time_s`` comes from each worker's wall clock (the same clock on one
machine; across machines, clock skew enters the figure).

Workers are registered by ``expect(name)`` when they join (so that the records of a worker whose
first heartbeat is late are not swept past), or else by their first record.  ``close(name, keep=True)``
marks a worker that will send
nothing more but still counts (it finished, or left gracefully: its final clock is a real clock
of the job); ``keep=False`` drops it once its records are swept (it died).

Cost: ``add`` only queues; the sweep runs when a figure is read (the display, ~5 times a second)
or a worker closes, at amortised O(log workers) per record (lazy heaps for the watermark and for
the smallest and largest clock, rebuilt from the live entries whenever their stale entries
outnumber the workers).  Memory is bounded: while an open worker sends nothing (a slow start, an
evaluation under ASP), the others' records wait; past ``max_pending`` waiting records in all, the
sweep goes ahead anyway, up to the earliest of the workers' newest waiting records, comparing
the silent worker at its last clock (``forced`` counts the sweeps that went past a silent
worker: the figure is then approximate).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Sized
from dataclasses import dataclass, field

__all__ = ["ClockSpread"]

MAX_PENDING = 100_000


def _mostly_stale(heap: Sized, live: int) -> bool:
    """Whether a lazy heap holds so many superseded entries that rebuilding it pays."""
    return len(heap) > 2 * live + 64


@dataclass(slots=True)
class _Worker:
    pending: deque[tuple[float, int]] = field(default_factory=deque)  # not yet swept, in order
    latest_t: float = -math.inf
    open: bool = True
    keep: bool = True


class ClockSpread:
    """Exact clock spread of a set of workers; see the module doc."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._workers: dict[Hashable, _Worker] = {}
        self._clock: dict[Hashable, int] = {}  # swept state: each counted worker's clock
        self._low: list[tuple[int, int, Hashable]] = []  # lazy heaps over _clock:
        self._high: list[tuple[int, int, Hashable]] = []  # (±clock, seq, name)
        self._seq = 0
        self._pending = 0  # records queued over all workers
        self._open_latest: list[tuple[float, int, Hashable]] = []  # lazy heap: watermark
        self._swept_t = -math.inf
        self._max_spread = 0
        self._max_spread_t: float | None = None
        self.forced = 0

    # ------------------------------------------------------------------ input
    def expect(self, name: Hashable) -> None:
        """``name`` will report (e.g. it joined): until its first record arrives, nothing later
        than that can be swept.  A worker's first record registers it too, but only then."""
        if name not in self._workers:
            self._workers[name] = _Worker()
            self._push_latest(name, -math.inf)

    def add(self, name: Hashable, time_s: float, clock: int) -> bool:
        """Queue one training record of ``name``; True if it was accepted.  Records of one worker
        come in increasing ``time_s``; one not later than that worker's previous record is
        ignored.  A closed worker's late record still counts if it is later than everything
        swept so far and the worker was closed with ``keep`` (a record shipped after its
        "leave"); else it is ignored.  A malformed record raises ValueError and changes nothing."""
        if (
            isinstance(time_s, bool)
            or not isinstance(time_s, (int, float))
            or not math.isfinite(time_s)
            or type(clock) is not int
        ):
            raise ValueError(
                f"clock record of {name!r}: need a finite time_s and an int clock, got {time_s!r}, {clock!r}"
            )
        self.expect(name)
        w = self._workers[name]
        if time_s <= w.latest_t or (not w.open and (not w.keep or time_s <= self._swept_t)):
            return False
        w.pending.append((float(time_s), clock))
        w.latest_t = float(time_s)
        self._pending += 1
        if w.open:
            self._push_latest(name, w.latest_t)
        if self._pending > self.max_pending:
            self._sweep(force=True)
        return True

    def close(self, name: Hashable, *, keep: bool) -> None:
        """``name`` sends no more records; ``keep``: whether its last clock still counts."""
        w = self._workers.get(name)
        if w is None or not w.open:
            return
        w.open, w.keep = False, keep
        if not keep and not w.pending:  # its last record is swept already
            self._drop(name)
        self._sweep()

    # ------------------------------------------------------------------ figures
    @property
    def spread(self) -> int:
        """``max - min`` of the counted workers' clocks at ``swept_t`` (0 with fewer than two)."""
        self._sweep()
        return self._current_spread()

    @property
    def max_spread(self) -> int:
        """The largest spread at any instant swept so far."""
        self._sweep()
        return self._max_spread

    @property
    def max_spread_t(self) -> float | None:
        self._sweep()
        return self._max_spread_t

    @property
    def swept_t(self) -> float:
        """Records up to this time are swept."""
        self._sweep()
        return self._swept_t

    @property
    def clocks(self) -> dict[Hashable, int]:
        """Each counted worker's clock at ``swept_t``."""
        self._sweep()
        return dict(self._clock)

    # ------------------------------------------------------------------ sweep
    def _push_latest(self, name: Hashable, t: float) -> None:
        if _mostly_stale(self._open_latest, len(self._workers)):
            self._open_latest = [
                (w.latest_t, self._next_seq(), n) for n, w in self._workers.items() if w.open and n != name
            ]
            heapq.heapify(self._open_latest)
        heapq.heappush(self._open_latest, (t, self._next_seq(), name))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _watermark(self) -> float:
        heap = self._open_latest
        while heap:
            t, _, name = heap[0]
            w = self._workers[name]
            if w.open and w.latest_t == t:
                return t
            heapq.heappop(heap)  # superseded by a later record, or closed
        return math.inf

    def _set_clock(self, name: Hashable, clock: int) -> None:
        self._clock[name] = clock
        if _mostly_stale(self._high, len(self._clock)):
            self._low = [(c, self._next_seq(), n) for n, c in self._clock.items() if n != name]
            self._high = [(-c, q, n) for c, q, n in self._low]
            heapq.heapify(self._low)
            heapq.heapify(self._high)
        seq = self._next_seq()
        heapq.heappush(self._low, (clock, seq, name))
        heapq.heappush(self._high, (-clock, seq, name))

    def _drop(self, name: Hashable) -> None:
        self._clock.pop(name, None)  # its heap entries go stale

    def _extreme(self, heap: list[tuple[int, int, Hashable]], sign: int) -> int | None:
        while heap:
            value, _, name = heap[0]
            if self._clock.get(name) == sign * value:
                return int(sign * value)
            heapq.heappop(heap)
        return None

    def _current_spread(self) -> int:
        low, high = self._extreme(self._low, 1), self._extreme(self._high, -1)
        return 0 if low is None or high is None else high - low

    def _sweep(self, *, force: bool = False) -> None:
        watermark = self._watermark()
        if force:  # memory cap: go past a silent worker
            ahead = min(w.pending[-1][0] for w in self._workers.values() if w.pending)
            if ahead > watermark:
                self.forced += 1
                watermark = ahead
        heap = [
            (w.pending[0][0], name)
            for name, w in self._workers.items()
            if w.pending and w.pending[0][0] <= watermark
        ]
        heapq.heapify(heap)
        leaving: list[Hashable] = []
        while heap:
            t, name = heapq.heappop(heap)
            w = self._workers[name]
            _, clock = w.pending.popleft()
            self._pending -= 1
            self._set_clock(name, clock)
            self._swept_t = max(self._swept_t, t)
            if w.pending and w.pending[0][0] <= watermark:
                heapq.heappush(heap, (w.pending[0][0], name))
            elif not w.open and not w.keep and not w.pending:
                leaving.append(name)  # a dead worker's last record
            if heap and heap[0][0] == t:
                continue  # records at the same instant: apply them all
            spread = self._current_spread()
            if spread > self._max_spread:
                self._max_spread, self._max_spread_t = spread, t
            for gone in leaving:  # not compared with anything later
                self._drop(gone)
            leaving.clear()
