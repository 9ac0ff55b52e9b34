"""Pure discrete-tick model of HetPipe virtual workers under WSP (SPEC §2), and its checkers.

Model (one tick = one unit of modelled time; minibatches are numbered from 1 per VW; W = s_local+1):
- VW v runs a pipeline with at most ``N_m = W`` minibatches in flight: minibatch p may start
  only once minibatch p - W has completed (local staleness s_local), and at least
  ``period_ticks`` (+ seeded jitter) after minibatch p - 1 started; it completes, and its update
  is applied to the VW's local weights, ``latency_ticks`` after it starts (so in order).
- Wave u = minibatches uW+1 … (u+1)W.  When minibatch (u+1)W completes the VW pushes the
  aggregated update of wave u tagged clock u (its local clock becomes u + 1) and, if more waves
  follow, pulls for clock u + 1.  The servers' :class:`ClockTable` and gate
  (:func:`flotilla.ps.consistency.may_serve_pull`, ``c_global >= c - D``) decide when the pull is
  answered; the answer is the global state at that tick (every wave pushed so far).
- While that pull waits the VW keeps going with the first s_local minibatches of wave u + 1; the
  last one, (u+2)W, may not start before the pull for clock u + 1 was answered.
- The weights minibatch p starts with = the latest answered pull's global state + the VW's own
  completed minibatches (``MinibatchRecord``).

So no VW waits on the PS before minibatch (D+1)(s_local+1) + s_local + 1, and a VW whose local
clock is c (waves 0 … c-1 done, "finishing clock c" in SPEC §2) needs every VW's waves
0 … c-D-1 before the last minibatch of wave c.  A VW pulls at every clock (a pull the gate allows
at once costs nothing here), which only makes weights fresher than HetPipe's minimum.

Tick order: completions (and pushes) of every VW, then serving pulls, then starts.  The ticks are
events of :class:`flotilla.core.events.EventQueue`; ticks where nothing can change are skipped.

Checkers: :func:`check_sglobal_bound` states SPEC §2's bound (every minibatch
p > (D+1)(s_local+1)+s_local sees all global updates of minibatches 1 … p-(s_global+1));
:func:`check_slocal_bound` the local one.  Both return violations rather than raising.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flotilla.core.events import EventQueue
from flotilla.ps.consistency import (
    WSP,
    ClockTable,
    ConsistencyConfigError,
    ConsistencyModel,
    may_serve_pull,
    s_global,
)

Gate = Callable[[ConsistencyModel, ClockTable, int, int], bool]


@dataclass(frozen=True, kw_only=True, slots=True)
class VWTiming:
    """Speed of one virtual worker, in ticks (a pipeline: throughput and latency)."""

    period_ticks: int
    latency_ticks: int
    jitter_ticks: int = 0

    def __post_init__(self) -> None:
        for name in ("period_ticks", "latency_ticks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConsistencyConfigError(f"VWTiming.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.jitter_ticks, int) or self.jitter_ticks < 0:
            raise ConsistencyConfigError(
                f"VWTiming.jitter_ticks must be an int >= 0, got {self.jitter_ticks!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class MinibatchRecord:
    """What the weights minibatch ``minibatch`` of ``vw`` started with.

    ``global_waves[v]`` = number of waves of VW v (waves 0 … n-1) in the pulled global state;
    ``local_done`` = own minibatches 1 … local_done applied locally.
    """

    vw: int
    minibatch: int
    wave_size: int
    start_tick: int
    global_waves: tuple[int, ...]
    local_done: int

    @property
    def wave(self) -> int:
        return (self.minibatch - 1) // self.wave_size

    @property
    def global_updates(self) -> frozenset[tuple[int, int]]:
        """The ``(vw, wave)`` global updates in the weights."""
        return frozenset((v, u) for v, n in enumerate(self.global_waves) for u in range(n))

    @property
    def local_updates(self) -> frozenset[int]:
        """Own minibatch updates in the weights beyond those already in the global state."""
        return frozenset(range(self.global_waves[self.vw] * self.wave_size + 1, self.local_done + 1))

    @property
    def included_prefix(self) -> int:
        """Largest m such that updates of minibatches 1 … m of *every* VW are in the weights."""
        own = max(self.global_waves[self.vw] * self.wave_size, self.local_done)
        others = [n * self.wave_size for v, n in enumerate(self.global_waves) if v != self.vw]
        return min([own, *others])

    @property
    def observed_staleness(self) -> int:
        """Missing recent minibatches: ``minibatch - 1 - included_prefix`` (<= s_global under WSP)."""
        return self.minibatch - 1 - self.included_prefix


@dataclass(frozen=True, kw_only=True, slots=True)
class Violation:
    """A minibatch whose weights miss updates the bound requires (``missing``: (vw, wave))."""

    vw: int
    minibatch: int
    kind: str  # "global" | "local"
    missing: tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class WSPTrace:
    """Result of :func:`simulate_wsp`.  ``pushes``/``pulls_served``: ``(tick, vw, clock)``."""

    records: tuple[MinibatchRecord, ...]
    pushes: tuple[tuple[int, int, int], ...]
    pulls_served: tuple[tuple[int, int, int], ...]
    deadlocked: bool
    num_ticks: int

    def record(self, vw: int, minibatch: int) -> MinibatchRecord:
        for r in self.records:
            if r.vw == vw and r.minibatch == minibatch:
                return r
        raise KeyError((vw, minibatch))


@dataclass(kw_only=True)
class _VW:
    timing: VWTiming
    next_mb: int = 1
    last_start: int | None = None
    gap: int = 0
    in_flight: deque[tuple[int, int]] = field(default_factory=deque)  # (done_tick, minibatch)
    local_done: int = 0
    served_clock: int = 0
    global_view: tuple[int, ...] = ()


def needed_clock(p: int, wave_size: int) -> int:
    """The pull clock minibatch p waits for: the last minibatch of wave u waits for clock u."""
    return (p - 1) // wave_size if p % wave_size == 0 else 0


def _complete(vw: _VW, now: int, ws: int) -> list[int]:
    """Retire minibatches finishing at ``now``; return the waves they complete."""
    waves = []
    while vw.in_flight and vw.in_flight[0][0] == now:
        _, p = vw.in_flight.popleft()
        vw.local_done = p
        if p % ws == 0:
            waves.append(p // ws - 1)
    return waves


def _can_start(vw: _VW, now: int, ws: int, total: int) -> bool:
    p = vw.next_mb
    return (
        p <= total
        and len(vw.in_flight) < ws
        and (vw.last_start is None or now >= vw.last_start + vw.gap)
        and vw.served_clock >= needed_clock(p, ws)
    )


class _Sim:
    """Mutable state of one :func:`simulate_wsp` run (private; the function is pure)."""

    def __init__(self, wsp: WSP, timings: Sequence[VWTiming], num_waves: int, seed: int, gate: Gate) -> None:
        self.wsp, self.gate, self.num_waves = wsp, gate, num_waves
        self.ws, self.total = wsp.wave_size, num_waves * wsp.wave_size
        self.rng = random.Random(seed)
        self.vws = [_VW(timing=t, global_view=(0,) * len(timings)) for t in timings]
        self.table, self.pushed = ClockTable.start(range(len(timings))), [0] * len(timings)
        self.pending: dict[int, int] = {}
        self.records: list[MinibatchRecord] = []
        self.pushes: list[tuple[int, int, int]] = []
        self.served: list[tuple[int, int, int]] = []

    def complete_and_push(self, now: int) -> None:
        for v, vw in enumerate(self.vws):
            for u in _complete(vw, now, self.ws):
                self.table, self.pushed[v] = self.table.advance(v, u), self.pushed[v] + 1
                self.pushes.append((now, v, u))
                if u + 1 < self.num_waves:
                    self.pending[v] = u + 1

    def serve_pulls(self, now: int) -> None:
        for v, c in sorted(self.pending.items()):
            if self.gate(self.wsp, self.table, v, c):
                del self.pending[v]
                self.vws[v].served_clock, self.vws[v].global_view = c, tuple(self.pushed)
                self.served.append((now, v, c))

    def start_minibatches(self, now: int) -> None:
        for v, vw in enumerate(self.vws):
            if not _can_start(vw, now, self.ws, self.total):
                continue
            p = vw.next_mb
            self.records.append(
                MinibatchRecord(
                    vw=v,
                    minibatch=p,
                    wave_size=self.ws,
                    start_tick=now,
                    global_waves=vw.global_view,
                    local_done=vw.local_done,
                )
            )
            vw.in_flight.append((now + vw.timing.latency_ticks, p))
            vw.next_mb, vw.last_start = p + 1, now
            vw.gap = vw.timing.period_ticks + self.rng.randint(0, vw.timing.jitter_ticks)

    def wakeups(self, now: int) -> set[int]:
        """Later ticks at which a VW's state may change: completions and ends of start gaps (the
        state is constant in between, so the ticks skipped would have done nothing)."""
        out: set[int] = set()
        for vw in self.vws:
            out.update(done for done, _ in vw.in_flight)
            if vw.last_start is not None and vw.last_start + vw.gap > now:
                out.add(vw.last_start + vw.gap)
        return out

    def finished(self) -> bool:
        return all(vw.local_done == self.total for vw in self.vws)

    def stuck(self) -> bool:
        """Nothing in flight and every unfinished VW waits on a pull the gate refused."""
        return all(not vw.in_flight for vw in self.vws) and all(
            vw.local_done == self.total or vw.served_clock < needed_clock(vw.next_mb, self.ws)
            for vw in self.vws
        )

    def trace(self, now: int, deadlocked: bool) -> WSPTrace:
        return WSPTrace(
            records=tuple(self.records),
            pushes=tuple(self.pushes),
            pulls_served=tuple(self.served),
            deadlocked=deadlocked,
            num_ticks=now,
        )


def simulate_wsp(
    wsp: WSP,
    timings: Sequence[VWTiming],
    *,
    num_waves: int,
    seed: int = 0,
    gate: Gate = may_serve_pull,
) -> WSPTrace:
    """Run ``len(timings)`` VWs for ``num_waves`` waves each (see the module doc).

    ``gate`` defaults to the real server gate; tests pass a deliberately broken one.
    Deterministic for a given seed.  Stops with ``deadlocked=True`` if no VW can ever move again.
    """
    if not isinstance(wsp, WSP):
        raise ConsistencyConfigError(f"wsp must be a WSP model, got {wsp!r}")
    if not timings or not isinstance(num_waves, int) or num_waves < 1:
        raise ConsistencyConfigError("timings must be non-empty and num_waves an int >= 1")
    sim, now = _Sim(wsp, timings, num_waves, seed, gate), 0
    ticks: EventQueue[None] = EventQueue()  # the ticks at which something may happen
    ticks.push(0, None)
    scheduled = {0}
    for event in ticks.drain():
        now = int(event.time)
        sim.complete_and_push(now)
        sim.serve_pulls(now)
        sim.start_minibatches(now)
        if sim.finished() or sim.stuck():
            break
        for t in sim.wakeups(now) - scheduled:
            ticks.push(t, None)
            scheduled.add(t)
    return sim.trace(now, deadlocked=not sim.finished())


def _missing_global(r: MinibatchRecord, m: int) -> tuple[tuple[int, int], ...]:
    """(vw, wave) pairs holding minibatches <= m that ``r``'s weights lack."""
    missing: list[tuple[int, int]] = []
    for v, n in enumerate(r.global_waves):
        have = max(n * r.wave_size, r.local_done) if v == r.vw else n * r.wave_size
        if have < m:
            missing.extend((v, u) for u in range(have // r.wave_size, (m - 1) // r.wave_size + 1))
    return tuple(missing)


def check_sglobal_bound(records: Sequence[MinibatchRecord], wsp: WSP) -> list[Violation]:
    """SPEC §2: every minibatch p > (D+1)(s_local+1) + s_local must start with weights holding
    all global updates (of every VW; own ones may be local) of minibatches 1 … p - (s_global+1).

    A wave is pushed as a whole, so another VW's minibatch counts only with its whole wave.
    """
    first = (wsp.clock_distance + 1) * wsp.wave_size + wsp.s_local + 1
    out = []
    for r in records:
        if r.wave_size != wsp.wave_size:
            raise ConsistencyConfigError(
                f"record wave_size {r.wave_size} does not match WSP s_local {wsp.s_local}"
            )
        if r.minibatch < first:
            continue
        missing = _missing_global(r, r.minibatch - (s_global(wsp) + 1))
        if missing:
            out.append(Violation(vw=r.vw, minibatch=r.minibatch, kind="global", missing=missing))
    return out


def check_slocal_bound(records: Sequence[MinibatchRecord], wsp: WSP) -> list[Violation]:
    """Minibatch p must start with the VW's own updates of minibatches 1 … p - (s_local+1)."""
    out = []
    for r in records:
        need = r.minibatch - wsp.wave_size
        if max(r.local_done, r.global_waves[r.vw] * r.wave_size) < need:
            lacking = range(r.local_done // r.wave_size, (need - 1) // r.wave_size + 1)
            out.append(
                Violation(
                    vw=r.vw, minibatch=r.minibatch, kind="local", missing=tuple((r.vw, u) for u in lacking)
                )
            )
    return out


def max_observed_staleness(records: Sequence[MinibatchRecord]) -> int:
    """The largest ``observed_staleness`` of a run (the run-time estimate of s_global)."""
    return max((r.observed_staleness for r in records), default=0)
