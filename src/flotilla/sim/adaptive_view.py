"""What the adaptive policy sees of a simulated run, and where a new segment starts (pure; no torch,
no threads, no clock; ``sim/adaptive.py`` drives it, ``docs/simulator.md``).

:class:`Roster` replays a run's :class:`~flotilla.sim.model.Change` list once, on the run's own
clock, as one *stint* per process (a device from its start -- 0, or its arrival -- to its
revocation), with the same rules as ``sim/members.Members`` (a revocation of a name that is
neither live nor starting is ignored, an arrival of a live or starting name too; a returning name
is a new process).  From it, the coordinator's snapshot (``roles/coordinator_progress._snapshot``)
at any instant:

- **live** (``IN_PLAY``): a process from its join -- ``Recovery.startup_s`` after it arrived (0 for
  the initial devices) -- until ``detect_s`` after its revocation (the coordinator suspects or
  declares it dead then; a process revoked while starting never joined);
- **its time per unit** (``compute_s``: the records' compute plus emulated slowness, its device's
  pace ``step_s / speed``) from the end of its first step on; before that it is *unmeasured*, and
  ``AdaptiveService._unmeasured`` holds the policy for at most ``grace_s`` after it joined;
- **losses** (``lost_at_s``): each joined process's declaration as dead, ``detect_s`` after its
  revocation.

The metrics are then the runtime's own functions of that snapshot
(``cluster/adaptive_policy.straggler_ratio``, ``revocation_rate``; ``AdaptiveService.metrics``), and
they change only at those instants (and when a loss leaves the window): :meth:`Roster.instants`.

The policy's looks (:func:`next_switch`): at the ticks ``k * every_s`` just after those instants
and where the dwell ends, ``decide`` on the snapshot and the most advanced step (the segment's
timeline, :class:`Segment`); a switch is announced for ``switch_announce.announce_step`` and taken
at the first unit boundary at or past it that began once the news was known.  The figures of the
coordinator it depends on are :class:`Coordinator`'s (the runtime's, checked by a test).

A new segment (:meth:`Roster.segment`) runs on the devices live at the switch, as a
:class:`LiveCluster` (the original cluster with :meth:`~LiveCluster.devices` narrowed to them, so
their names, nodes and speeds are kept); devices still starting up come as arrivals at their
original arrival instant (negative on the segment's clock: their ready time is kept), later changes
shifted onto the segment's clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.cluster import adaptive_policy as policy
from flotilla.cluster import switch_announce
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimResult

__all__ = [
    "Coordinator",
    "Found",
    "LiveCluster",
    "PolicySpec",
    "Roster",
    "Segment",
    "Stint",
    "next_switch",
]

_REPLY_BYTES = 256  # a heartbeat reply's header, carrying the announced switches


@dataclass(slots=True)
class Stint:
    """One process on ``device``: arrived at ``start_s``, joined at ``ready_s``, revoked at ``end_s``."""

    device: SimDevice
    start_s: float
    ready_s: float
    end_s: float = math.inf

    @property
    def joined(self) -> bool:
        return self.ready_s < self.end_s


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveCluster(SimCluster):
    """``SimCluster`` whose devices are ``live`` (those alive at a switch); an arrival of a name
    the run knew (``known``) is that device again, any other a spare of the first class."""

    live: tuple[SimDevice, ...] = ()
    known: tuple[SimDevice, ...] = ()

    def devices(self) -> tuple[SimDevice, ...]:
        return self.live

    def spare(self, name: str) -> SimDevice:
        for d in self.known:
            if d.name == name:
                return d
        return SimCluster.spare(self, name)


class Roster:
    """The run's processes, replayed from ``changes`` (see the module doc)."""

    def __init__(
        self, cluster: SimCluster, changes: Sequence[Change], recovery: Recovery, *, step_s: float
    ) -> None:
        self.cluster, self.recovery, self.step_s = cluster, recovery, step_s
        self.stints = [Stint(d, 0.0, 0.0) for d in cluster.devices()]
        self.known = {d.name: d for d in cluster.devices()}
        running = {s.device.name: s for s in self.stints}
        for c in sorted(changes, key=lambda c: c.at_s):  # (the order Members applies them in)
            s = running.get(c.name)
            if c.kill and s is not None:
                s.end_s = c.at_s
                del running[c.name]
            elif not c.kill and s is None:
                device = self.known.get(c.name) or cluster.spare(c.name)
                self.known[c.name] = device
                s = running[c.name] = Stint(device, c.at_s, c.ready_at(recovery))
                self.stints.append(s)

    # ------------------------------------------------------------------ the coordinator's snapshot
    def pace_s(self, s: Stint) -> float:
        return self.step_s / s.device.speed

    def in_play(self, t: float) -> list[Stint]:
        return [s for s in self.stints if s.joined and s.ready_s <= t < s.end_s + self.recovery.detect_s]

    def holds(self, t: float, grace_s: float) -> bool:
        """``AdaptiveService._unmeasured``: a live process has no time per unit yet, within its grace."""
        return any(t < s.ready_s + self.pace_s(s) and t - s.ready_s < grace_s for s in self.in_play(t))

    def metrics(self, t: float, window_s: float) -> policy.Metrics:
        """``AdaptiveService.metrics`` of the snapshot at ``t``.  (Each measured process reports its
        pace; the ratio is scale-free, so ``1 / speed`` -- the start's ``initial_metrics`` -- is
        used: the same value to the bit before and after the first records.)"""
        live = self.in_play(t)
        measured = {i: [1.0 / s.device.speed] for i, s in enumerate(live) if t >= s.ready_s + self.pace_s(s)}
        lost = [s.end_s + self.recovery.detect_s for s in self.stints if s.joined and s.end_s < math.inf]
        return policy.Metrics(
            num_workers=len(live),
            straggler_ratio=policy.straggler_ratio(measured),
            revocation_rate=policy.revocation_rate(lost, now_s=t, window_s=window_s),
        )

    def instants(self, *, grace_s: float, window_s: float) -> list[float]:
        """Every instant the snapshot's metrics (or the hold) may change."""
        out: list[float] = []
        detect = self.recovery.detect_s
        for s in self.stints:
            if not s.joined:
                continue
            out += [s.ready_s, s.ready_s + self.pace_s(s), s.ready_s + grace_s]
            if s.end_s < math.inf:  # (a loss counts up to now - window_s inclusive: just after it)
                out += [s.end_s + detect, math.nextafter(s.end_s + detect + window_s, math.inf)]
        return out

    # ------------------------------------------------------------------ a new segment
    def alive(self, t: float) -> list[SimDevice]:
        """The devices of the processes that joined by ``t`` and are not revoked."""
        return [s.device for s in self.stints if s.ready_s <= t < s.end_s]

    def segment(
        self, changes: Sequence[Change], *, switch_s: float, start_s: float
    ) -> tuple[LiveCluster, list[Change]]:
        """The cluster and the changes of a segment that starts at ``start_s`` on the devices alive
        at ``switch_s`` (the module doc); a revocation between the two happens at its start."""
        c = self.cluster
        cluster = LiveCluster(
            classes=c.classes, intra_node=c.intra_node, inter_node=c.inter_node, slowdown=c.slowdown,
            message_plane=c.message_plane, live=tuple(self.alive(switch_s)), known=tuple(self.known.values()),
        )  # fmt: skip
        starting = [
            Change(s.start_s - start_s, False, s.device.name)
            for s in self.stints
            if s.start_s <= switch_s < s.ready_s and switch_s < s.end_s
        ]
        later = [  # (an arrival keeps its ready time; a revocation during the switch breaks the first unit)
            Change(max(0.0, x.at_s - start_s) if x.kill else x.at_s - start_s, x.kill, x.name)
            for x in changes
            if x.at_s > switch_s
        ]
        return cluster, starting + later


# ---------------------------------------------------------------------- the policy's looks
@dataclass(frozen=True, kw_only=True, slots=True)
class Coordinator:
    """The runtime's figures the policy's timing depends on (``tests/unit/test_sim_adaptive.py``
    checks they are the runtime's): ``lead_s`` ``roles/coordinator.SWITCH_LEAD_S``, ``heartbeat_s``
    ``roles/link.HEARTBEAT_S``, ``grace_s`` ``sync/adaptive.UNMEASURED_GRACE_S``, ``max_switches``
    ``roles/coordinator_switch.MAX_SWITCHES``."""

    lead_s: float = 2.0
    heartbeat_s: float = 0.25
    grace_s: float = 30.0
    max_switches: int = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicySpec:
    """``AdaptiveStrategy``'s policy: ``rules`` (``cluster/adaptive_policy.Rule``), the dwell in
    steps, the policy's period and the metrics' window; ``coordinator``: the runtime's figures."""

    rules: tuple[policy.Rule, ...]
    dwell_steps: int = 50
    every_s: float = 2.0
    window_s: float = 30.0
    coordinator: Coordinator = Coordinator()

    def __post_init__(self) -> None:
        if not self.rules:
            raise ValueError("PolicySpec.rules: at least one rule (the last one 'otherwise')")
        if not isinstance(self.dwell_steps, int) or self.dwell_steps < 0:
            raise ValueError(f"PolicySpec.dwell_steps must be an integer >= 0, got {self.dwell_steps!r}")
        for name in ("every_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PolicySpec.{name} must be > 0, got {getattr(self, name)!r}")


def _tick(x: float, every_s: float) -> float:
    """The policy's first look at or after ``x`` (it sleeps ``every_s``, then looks)."""
    k = max(1, math.ceil(x / every_s))
    while k * every_s < x:
        k += 1
    return k * every_s


@dataclass(frozen=True, slots=True)
class Found:
    """A switch the policy announces: its decision (and the target), the metrics it saw at
    ``decided_s``, the step announced and the segment's boundary that takes it."""

    decision: policy.Decision
    target: int  # (the decision's)
    metrics: policy.Metrics
    decided_s: float
    announced: int
    at_step: int  # the segment's boundary that takes it


class Segment:
    """A segment's timeline on the run's clock: (times, steps)."""

    def __init__(self, result: SimResult, t0: float, s0: int) -> None:
        self.t0, self.s0, self.end = t0, s0, t0 + result.time_s
        self.times = [t0 + t for t, _, _ in result.timeline]
        self.steps = [s0 + s for _, s, _ in result.timeline]

    def steps_at(self, t: float) -> int:
        i = bisect.bisect_right(self.times, t)
        return self.steps[i - 1] if i else self.s0

    def rate_at(self, t: float, units: int = 5) -> float:
        """Steps per second over the last ``units`` units before ``t`` (0: none yet)."""
        k = bisect.bisect_right(self.times, t) - 1
        if k < 0:
            return 0.0
        j = k - units
        t_j, s_j = (self.times[j], self.steps[j]) if j >= 0 else (self.t0, self.s0)
        return (self.steps[k] - s_j) / (self.times[k] - t_j) if self.times[k] > t_j else 0.0

    def reached(self, step: int, known_s: float = -math.inf) -> tuple[float, int] | None:
        """The first boundary at or past ``step`` that ends a unit started once the workers knew
        of it at ``known_s`` (a worker reads the announcements when it polls, before a unit)."""
        for i in range(bisect.bisect_left(self.steps, step), len(self.steps)):
            if (self.times[i - 1] if i else self.t0) >= known_s:
                return self.times[i], self.steps[i]
        return None


def next_switch(
    spec: PolicySpec, roster: Roster, seg: Segment, *, running: int, last: int | None, total_steps: int,
    cluster: SimCluster,
) -> Found | None:  # fmt: skip
    """The policy's next announced switch during ``seg`` (None: it runs to the end)."""
    c = spec.coordinator
    xs = [*roster.instants(grace_s=c.grace_s, window_s=spec.window_s), seg.t0]
    if last is not None and (dwelt := seg.reached(last + spec.dwell_steps)) is not None:
        xs.append(dwelt[0])
    for tau in sorted({_tick(max(x, seg.t0), spec.every_s) for x in xs}):
        if tau >= seg.end:
            break
        live = roster.in_play(tau)
        if not live or roster.holds(tau, c.grace_s):
            continue
        m, step = roster.metrics(tau, spec.window_s), seg.steps_at(tau)
        d = policy.decide(
            spec.rules, m, running=running, step=step, last_switch_step=last, dwell_steps=spec.dwell_steps
        )
        if d.target is None:
            continue
        progress = dict.fromkeys(range(len(live)), switch_announce.Progress(step, seg.rate_at(tau)))
        try:  # (refused at the end: every later look is refused too)
            announced = switch_announce.announce_step(progress, lead_s=c.lead_s, total_steps=total_steps)
        except switch_announce.SwitchRefused:
            return None
        if last is not None and announced <= last:  # (SwitchAnnouncer keeps the announcements' order)
            announced = last + 1
        news = tau + c.heartbeat_s + cluster.message_s(_REPLY_BYTES, [s.device for s in live])
        taken = seg.reached(announced, known_s=news) if announced < total_steps else None
        if taken is None or taken[1] >= total_steps:
            return None
        return Found(d, d.target, m, tau, announced, taken[1])
    return None
