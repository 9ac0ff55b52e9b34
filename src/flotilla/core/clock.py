"""Clocks.  Pure planning code never reads the wall clock: it is handed a ``Clock``.

``WallClock`` is the real one (monotonic seconds); ``ManualClock`` is advanced by tests and by
the simulator.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin (monotonic)."""
        ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self._t = start_s

    def now(self) -> float:
        return self._t

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError("dt_s must be >= 0")
        self._t += dt_s
