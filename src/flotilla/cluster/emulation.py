"""Heterogeneity emulation (SPEC §8): a device of speed ``s`` makes compute last ``1/s`` as long.

The real compute is measured between marks and the difference is slept, so a worker at speed 0.5
takes twice as long per step on any machine: its forward, its backward and its optimizer step (a
worker's: ``trainer/step.stretch_optimizer_steps``; a pipeline stage's: ``pipeline/runtime.py``),
never its waits for peers.  Clock and sleep are injectable for tests.

**Contention is not the device's.** Where several emulated devices share the host's cores (four
workers on two cores), an interval's wall time includes the time its thread was ready but waited
for a core (Linux: ``/proc/thread-self/schedstat``'s run-queue delay).  The device's compute is the
interval **less that wait** -- what it takes on a core of its own -- and the interval lasts that
times ``f / speed`` (the sleep makes up the difference; never less than the wall time).  So an
emulated device is as slow as its speed says whatever its neighbours do, as long as its sleep can
absorb the wait; without schedstat (another OS), or with a clock injected for a test, the wait is
taken as 0 (the previous rule).  A device that never stretches (speed 1, no slowdown) reads nothing.
Limits: a device of speed 1 still pays for core waits (it never sleeps), so on shared cores a
mixed cluster's fast devices are slowed more than its emulated ones; waits of torch's intra-op
threads are not the calling thread's and are not subtracted; an interval ended on another thread
than it began on (a CUDA backward's hooks) subtracts nothing, and the worker and the stage build a
CUDA device's emulator with ``waited=no_wait`` (a host thread waiting in a synchronisation is not
the device waiting).

Transient slowdowns (``TransientSlowdown``, seeded): each compute interval (``start``: one per
minibatch on a replica) draws a factor f -- ``factor`` with probability ``p`` (else 1), times a
log-normal jitter exp(N(0, sigma²)) -- and lasts f / speed times the real compute (never shorter
than the real compute).  On a host whose cores are not shared the records' ``emulated_s /
compute_s`` is (f / speed - 1) per step (with waits for a core: less, by the wait), and
``slowdown_factor`` (``record_fields``, only where a slowdown is configured) is f itself: the mean
of the unit's drawn factors, weighted by each interval's real compute.
"""

from __future__ import annotations

import _thread
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class TransientSlowdown:
    p: float = 0.0
    factor: float = 1.0
    jitter_sigma: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.p <= 1.0 and self.factor >= 1.0 and self.jitter_sigma >= 0.0):
            raise ValueError(
                f"TransientSlowdown: need 0 <= p <= 1, factor >= 1, jitter_sigma >= 0; got {self}"
            )

    @staticmethod
    def of(config: Any, worker_id: int) -> TransientSlowdown | None:
        """From a ``cluster`` worker's ``slowdown`` section (None: none); seeded per worker."""
        if config is None:
            return None
        return TransientSlowdown(
            p=float(config.p),
            factor=float(config.factor),
            jitter_sigma=float(config.jitter_sigma),
            seed=int(config.seed) * 1_000_003 + worker_id,
        )

    def draw(self, rng: random.Random) -> float:
        f = self.factor if rng.random() < self.p else 1.0
        return f * (rng.lognormvariate(0.0, self.jitter_sigma) if self.jitter_sigma > 0 else 1.0)


_SCHEDSTAT = "/proc/thread-self/schedstat"  # (the calling thread's: opened per read)


def run_queue_wait_s() -> float:
    """Seconds the calling thread has spent ready to run but waiting for a core (Linux
    schedstat's run-queue delay, cumulative); 0.0 where the kernel does not say.  A few
    microseconds (an open, a read, a close): read only by emulated devices, which sleep."""
    try:
        fd = os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return 0.0
    try:
        return int(os.read(fd, 128).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0
    finally:
        os.close(fd)


def _no_wait() -> float:
    return 0.0


def no_wait() -> float:
    """No run-queue wait: for an emulator of a CUDA device (a host thread waiting in a
    synchronisation is not the device waiting) or a test's clock."""
    return 0.0


def _tid() -> int:
    """This thread's id (``_thread``, always loaded: not ``threading``, which the simulator's
    import chain must not load)."""
    return _thread.get_native_id()


class SpeedEmulator:
    """Stretch measured compute intervals by ``1/speed``."""

    def __init__(
        self,
        speed: float,
        *,
        now: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        slowdown: TransientSlowdown | None = None,
        waited: Callable[[], float] | None = None,
    ) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.speed = speed
        self._now, self._sleep = now, sleep
        # the run-queue wait (module doc): the real one only against the real clock
        self._waited = (
            waited if waited is not None else (run_queue_wait_s if now is time.perf_counter else _no_wait)
        )
        self._last = now()
        self.compute_s = 0.0  # measured real compute since reset
        self.slept_s = 0.0  # added delay since reset
        self.slowdown = slowdown
        self._rng = random.Random(slowdown.seed if slowdown is not None else 0)
        self.factor = 1.0  # the current interval's transient factor
        self._weighted_s = 0.0  # sum of real compute x factor since reset
        self.unit_factor = 1.0  # the compute-weighted factor of the intervals before the last reset
        self._last_wait, self._reader = (self._waited(), _tid()) if self.stretches else (0.0, -1)

    @property
    def stretches(self) -> bool:
        """Whether it ever sleeps (a device slower than the host, or transient slowdowns): its
        intervals must then measure finished compute, not queued GPU work."""
        return self.speed < 1.0 or self.slowdown is not None

    def start(self) -> None:
        """Begin a compute interval (time before this is not counted); draws its slowdown."""
        if self.slowdown is not None:
            self.factor = self.slowdown.draw(self._rng)
        self._begin()

    def begin(self) -> None:
        """Begin a compute interval within the same unit (its transient factor kept): time since
        the last interval ended is not counted (e.g. a collective's wait before an update)."""
        self._begin()

    def _begin(self) -> None:
        if self.stretches:
            self._last_wait, self._reader = self._waited(), _tid()
        self._last = self._now()

    def _wait_since_begin(self) -> float:
        """The run-queue wait since the interval began, if this is the thread that began it (a
        CUDA backward's hooks run on autograd's device thread: another thread's counter, so 0)."""
        if _tid() != self._reader:
            return 0.0
        return self._waited() - self._last_wait

    def mark(self) -> float:
        """End the current interval: sleep to stretch it, start the next.  Returns the delay slept."""
        now = self._now()
        real = max(0.0, now - self._last)
        stretch = self.factor / self.speed
        delay = 0.0
        if stretch > 1.0:
            own = min(real, max(0.0, real - self._wait_since_begin()))  # (less the core waits)
            delay = max(0.0, own * stretch - real)
        if delay > 0:
            self._sleep(delay)
        self.compute_s += real
        self._weighted_s += real * self.factor
        self.slept_s += delay
        self._begin()
        return delay

    def reset_counters(self) -> tuple[float, float]:
        out = (self.compute_s, self.slept_s)
        self.unit_factor = self._weighted_s / self.compute_s if self.compute_s > 0 else self.factor
        self.compute_s = self.slept_s = self._weighted_s = 0.0
        return out

    def record_fields(self) -> dict[str, float]:
        """The per-step metrics fields of the emulation (``slowdown_factor``: the transient factor
        of the unit just counted, see the module doc), or none without a transient slowdown."""
        return {} if self.slowdown is None else {"slowdown_factor": round(self.unit_factor, 4)}
