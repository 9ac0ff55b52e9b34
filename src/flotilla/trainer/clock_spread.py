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
first heartbeat is late are not swept past), or else by their first record.  ``close(name, keep=True)`` marks a worker that will send
nothing more but still counts (it finished, or left gracefully: its final clock is a real clock
of the job); ``keep=False`` drops it once its records are swept (it died).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["ClockSpread"]


@dataclass(slots=True)
class _Worker:
    pending: deque[tuple[float, int]] = field(default_factory=deque)   # not yet swept, in order
    latest_t: float = -math.inf
    open: bool = True
    keep: bool = True


class ClockSpread:
    """Exact clock spread of a set of workers; see the module doc."""

    def __init__(self) -> None:
        self._workers: dict[Hashable, _Worker] = {}
        self._clock: dict[Hashable, int] = {}  # swept state: each counted worker's clock
        self.swept_t = -math.inf               # records up to this time are swept
        self.max_spread = 0
        self.max_spread_t: float | None = None

    def expect(self, name: Hashable) -> None:
        """``name`` will report (e.g. it joined): until its first record arrives, nothing later
        than that can be swept.  A worker's first record registers it too, but only then."""
        self._workers.setdefault(name, _Worker())

    def add(self, name: Hashable, time_s: float, clock: int) -> None:
        """One training record of ``name``.  Records of one worker come in increasing
        ``time_s``; one not later than that worker's previous record is ignored.  A closed
        worker's late record still counts if it is later than everything swept so far and the
        worker was closed with ``keep`` (a record shipped after its "leave"); else it is ignored."""
        if not (isinstance(time_s, (int, float)) and math.isfinite(time_s)) or type(clock) is not int:
            raise ValueError(f"clock record of {name!r}: need a finite time_s and an int clock, "
                             f"got {time_s!r}, {clock!r}")
        w = self._workers.setdefault(name, _Worker())
        if time_s <= w.latest_t or (not w.open and (not w.keep or time_s <= self.swept_t)):
            return
        w.pending.append((float(time_s), clock))
        w.latest_t = float(time_s)
        self._sweep()

    def close(self, name: Hashable, *, keep: bool) -> None:
        """``name`` sends no more records; ``keep``: whether its last clock still counts."""
        w = self._workers.get(name)
        if w is None or not w.open:
            return
        w.open, w.keep = False, keep
        if not keep and not w.pending:             # its last record is swept already
            self._clock.pop(name, None)
        self._sweep()

    @property
    def spread(self) -> int:
        """``max - min`` of the counted workers' clocks at ``swept_t`` (0 with fewer than two)."""
        return max(self._clock.values()) - min(self._clock.values()) if self._clock else 0

    @property
    def clocks(self) -> dict[Hashable, int]:
        """Each counted worker's clock at ``swept_t``."""
        return dict(self._clock)

    def _sweep(self) -> None:
        live = [w.latest_t for w in self._workers.values() if w.open]
        watermark = min(live) if live else math.inf
        heap = [(w.pending[0][0], name) for name, w in self._workers.items()
                if w.pending and w.pending[0][0] <= watermark]
        heapq.heapify(heap)
        leaving: list[Hashable] = []
        while heap:
            t, name = heapq.heappop(heap)
            w = self._workers[name]
            _, clock = w.pending.popleft()
            self._clock[name] = clock
            self.swept_t = max(self.swept_t, t)
            if w.pending and w.pending[0][0] <= watermark:
                heapq.heappush(heap, (w.pending[0][0], name))
            elif not w.open and not w.keep and not w.pending:
                leaving.append(name)               # a dead worker's last record
            if heap and heap[0][0] == t:
                continue                           # records at the same instant: apply them all
            spread = self.spread
            if spread > self.max_spread:
                self.max_spread, self.max_spread_t = spread, t
            for gone in leaving:                   # not compared with anything later
                self._clock.pop(gone, None)
            leaving.clear()
        for name, w in self._workers.items():
            if not w.open and not w.keep and not w.pending:
                self._clock.pop(name, None)
