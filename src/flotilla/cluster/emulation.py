"""Heterogeneity emulation (SPEC §8): a device of speed ``s`` makes compute last ``1/s`` as long.

The real compute is measured between marks and the difference is slept, so a worker at speed 0.5
takes twice as long per step on any machine.  Clock and sleep are injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SpeedEmulator:
    """Stretch measured compute intervals by ``1/speed``."""

    def __init__(
        self,
        speed: float,
        *,
        now: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.speed = speed
        self._now, self._sleep = now, sleep
        self._last = now()
        self.compute_s = 0.0  # measured real compute since reset
        self.slept_s = 0.0  # added delay since reset

    def start(self) -> None:
        """Begin a compute interval (time before this is not counted)."""
        self._last = self._now()

    def mark(self) -> float:
        """End the current interval: sleep to stretch it, start the next.  Returns the delay slept."""
        now = self._now()
        real = max(0.0, now - self._last)
        delay = real * (1.0 / self.speed - 1.0) if self.speed < 1.0 else 0.0
        if delay > 0:
            self._sleep(delay)
        self.compute_s += real
        self.slept_s += delay
        self._last = self._now()
        return delay

    def reset_counters(self) -> tuple[float, float]:
        out = (self.compute_s, self.slept_s)
        self.compute_s = self.slept_s = 0.0
        return out
