"""The parameter server under BSP / SSP / ASP / WSP in virtual time (``docs/simulator.md``, ``docs/ps.md``).

An event-driven run (``core/events.EventQueue``) of every worker's loop, with the servers' clock
table (``ps/consistency.ClockTable``) and the real pull gate (``ps/consistency.may_serve_pull``):

- a worker **pulls** for clock c (its first for clock 0); the pull is answered only when
  ``may_serve_pull`` says so -- waiting pulls are re-checked whenever the table changes -- and the
  weights reach it the *pull half* of ``ps_round_s`` later (``cluster/comm_cost.py``, over
  ``cluster.link_among`` all devices, with ``SimCluster.message_plane``'s own cost);
- it **computes** one step (``SimCluster.compute_s``, its own seeded draws ``rng_of(index)``);
- it **pushes** clock c: its own link sends for the *push half* of ``ps_round_s``, while every
  shard receives its share one push after another (a FIFO, ``shard_service_s`` per push); the push
  is applied (``table.advance``) when both are done.  The bytes are split evenly and every push
  reaches every shard in the same order, so the shards' queues are identical: one stands for all;
- then it pulls for c + 1, until it has pushed the job's clocks (``job.steps``; under WSP
  ``ceil(job.steps / wave)``, below).  The job's ``steps`` are those of ``c_global`` clocks (the
  clocks every worker pushed); it completes when ``c_global`` reaches the job's clocks;
  ``timeline`` gets (time, steps, live workers) whenever ``c_global`` grows; ``samples`` = the
  steps of the applied pushes x ``batch_per_worker``.

Revocations and arrivals (``sim/members.Members``): a revoked worker stops at once and its
unapplied push is lost (the PS drops an unacknowledged push); the servers evict it from the table
(``without_worker``) ``Recovery.detect_s`` later, when the survivors' peer watch declares it dead
-- until then BSP/SSP pulls may wait on it.  An arrival, ready ``startup_s`` after it arrives,
joins at ``c_global`` (``with_worker``) and trains until its clock reaches the job's clocks.  The
servers hold the model, so a run ends incomplete only when no worker is left and none can arrive.
``recoveries_s``: from each revocation to the next growth of ``c_global`` (0 if the job ended).

**Aggregation** (``aggregate``; by default exactly when the cluster has no slowdown and there are
no changes): identical devices behave identically, so one representative worker per device class
stands for the class -- one clock-table entry, one push occupying the shards for ``count`` pushes'
service, ``count`` x the samples.  Exact under BSP, and when no push ever waits in the shard
queue.  Under SSP/ASP with a busy shard the per-worker run staggers a class's workers in the
queue, each computing while its classmates' pushes are served; the batch cannot overlap them,
so the aggregated time is pessimistic: measured +0.4 % to +5 % on small mixed clusters, +46 % for
one class of 8 whose queue is comparable to a step, +1.7 % for 1,024 workers whose queue
dominates (``tests/unit/test_sim_ps.py``).  It exists because ``ClockTable.advance`` copies the
table (tuple slices, O(workers) per push): slow per worker for 1,000s.

The pending pulls are kept ordered by clock and served from the lowest while the gate says yes:
this relies only on the gate being monotone in the clock (a pull for c servable => any pull for
c' <= c is), true of every model it accepts.

**WSP** (``consistency: {kind: wsp, s_local, clock_distance}``): a clock is a wave of
``s_local + 1`` steps (the runtime's ``sync/via_ps``: local steps inside the wave, one push at its
end, then the blocking pull of the next clock), each step's compute drawn on its own; the gate is
``c_global >= c - D``; ``steps`` done = the clocks applied everywhere x the wave (the last wave
may be shorter).  With ``s_local = 0`` it is SSP(D) exactly (BSP at D = 0).

Not modelled: read-ahead pulls (``max_pull_ahead``), the two-phase push of
multi-shard runs (one more round trip), the shards' sending of pulls (full duplex: only the
pushes queue), the servers' update compute, the parked pulls' one-second re-issue, evaluations and
checkpoints (``SimJob.eval_s`` / ``checkpoint_s``), a server's failure.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Any

from flotilla.cluster.comm_cost import ps_round_s, shard_service_s
from flotilla.core.events import EventQueue
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, ClockTable, may_serve_pull
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimJob, SimResult

__all__ = ["PSSpec", "ps_of", "simulate_ps"]

# event kinds; simultaneous events are handled in this order
_CHANGE, _EVICT, _READY, _APPLIED, _COMPUTED = range(5)
_Payload = tuple[int, int, int]  # (kind, worker id, clock)


@dataclass(frozen=True, kw_only=True, slots=True)
class PSSpec:
    """``consistency`` (BSP, SSP or ASP); ``num_servers``: the shards the model is split over;
    ``name``: the strategy's kind in the result."""

    consistency: BSP | SSP | ASP | WSP
    num_servers: int = 1
    name: str = "ps"

    def __post_init__(self) -> None:
        if not isinstance(self.consistency, BSP | SSP | ASP | WSP):
            raise ValueError(
                "PSSpec.consistency must be BSP(), SSP(staleness=s), ASP() or "
                f"WSP(s_local=l, clock_distance=d), got {self.consistency!r}"
            )
        n = self.num_servers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"PSSpec.num_servers must be an integer >= 1, got {n!r}")

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        return simulate_ps(job, cluster, self, changes=changes, recovery=recovery)


def ps_of(settings: Any) -> PSSpec:
    """``strategy: {kind: ps, consistency: {kind: bsp | ssp | asp}, num_servers: n}``
    (``StrategySpec.simulated``; the settings read by name)."""
    c = settings.consistency
    model: BSP | SSP | ASP | WSP
    if c.kind == "bsp":
        model = BSP()
    elif c.kind == "asp":
        model = ASP()
    elif c.kind == "ssp":
        model = SSP(staleness=int(c.staleness))
    elif c.kind == "wsp":
        model = WSP(s_local=int(c.s_local), clock_distance=int(c.clock_distance))
    else:
        raise ValueError(f"strategy.consistency: {c.kind} is not simulated (bsp, ssp, asp and wsp are)")
    return PSSpec(consistency=model, num_servers=int(settings.num_servers))


@dataclass(slots=True)
class _Worker:
    """A simulated worker: ``weight`` identical devices (1; a class's count when aggregated)."""

    device: SimDevice
    rng: random.Random
    weight: int = 1


class _Run:
    """One simulation's state and its event handlers."""

    def __init__(self, job: SimJob, cluster: SimCluster, spec: PSSpec, members: Members) -> None:
        self.job, self.cluster, self.spec, self.m = job, cluster, spec, members
        link = cluster.link_among(cluster.devices())
        sw = cluster.message_plane
        self.half = ps_round_s(job.model_bytes, link, sw) / 2  # one way of a worker's round
        self.service = shard_service_s(job.model_bytes, spec.num_servers, link, sw)
        self.q: EventQueue[_Payload] = EventQueue()
        self.workers: dict[int, _Worker] = {}  # live (not revoked) workers by id
        self.ids: dict[str, int] = {}  # device name -> its live worker's id
        self.table = ClockTable()
        self.c_global = 0  # the table's (cached: computing it is O(workers))
        self.pending: list[tuple[int, int]] = []  # heap of waiting pulls (clock, worker id)
        self.shards_free = 0.0  # when the shards' push queue is next idle
        self.t, self.events, self.samples = 0.0, 0, 0
        c = spec.consistency
        self.wave = c.wave_size if isinstance(c, WSP) else 1  # (steps per clock)
        self.clocks = math.ceil(job.steps / self.wave)
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self._unrecovered: list[float] = []  # revocations waiting for c_global to grow

    @property
    def done(self) -> bool:
        return self.c_global >= self.clocks

    def steps_of(self, clocks: int) -> int:
        """The steps of the job's first ``clocks`` clocks."""
        return min(self.job.steps, clocks * self.wave)

    def start(self, workers: dict[str, _Worker], changes: tuple[Change, ...] | list[Change]) -> None:
        """Every worker at clock 0, pulling for clock 0; one event per change time."""
        for name, w in workers.items():
            self.ids[name] = self.m.index[name]
            self.workers[self.m.index[name]] = w
        self.table = ClockTable.start(self.workers)
        for at in sorted({max(0.0, c.at_s) for c in changes}):
            self.q.push(at, (_CHANGE, -1, -1), priority=_CHANGE)
        self.pending = [(0, w) for w in sorted(self.workers)]
        self.serve()

    def serve(self) -> None:
        """Answer the waiting pulls the gate allows; each starts that worker's compute."""
        while self.pending:
            clock, w = self.pending[0]
            worker = self.workers.get(w)
            if worker is None:  # revoked: its pull is dropped
                heapq.heappop(self.pending)
                continue
            if not may_serve_pull(self.spec.consistency, self.table, w, clock):
                return
            heapq.heappop(self.pending)
            steps = self.steps_of(clock + 1) - self.steps_of(clock)  # (a wave under WSP)
            compute = sum(
                self.cluster.compute_s(self.job.step_s, worker.device, worker.rng) for _ in range(steps)
            )
            self.q.push(self.t + self.half + compute, (_COMPUTED, w, clock), priority=_COMPUTED, tie=w)

    def computed(self, w: int, clock: int) -> None:
        """The push leaves: the worker's link and the shards' FIFO; applied when both are done."""
        worker = self.workers.get(w)
        if worker is None:
            return
        self.shards_free = max(self.t, self.shards_free) + worker.weight * self.service
        applied = max(self.t + self.half, self.shards_free)
        self.q.push(applied, (_APPLIED, w, clock), priority=_APPLIED, tie=w)

    def applied(self, w: int, clock: int) -> None:
        worker = self.workers.get(w)
        if worker is None:  # revoked before its push was acknowledged: lost
            return
        self.table = self.table.advance(w, clock)
        self.samples += (
            worker.weight * self.job.batch_per_worker * (self.steps_of(clock + 1) - self.steps_of(clock))
        )
        if clock + 1 < self.clocks:
            heapq.heappush(self.pending, (clock + 1, w))
        self.table_changed()

    def table_changed(self) -> None:
        c_global = self.table.c_global
        if c_global > self.c_global:
            self.c_global = c_global
            self.timeline.append((self.t, self.steps_of(c_global), len(self.m.live)))
            self.recoveries += [self.t - at for at in self._unrecovered]
            self._unrecovered = []
        if not self.done:
            self.serve()

    def change(self) -> None:
        """Apply the changes due: revoke workers (evicted later), schedule the arrivals' joins."""
        arriving = set(self.m.arriving)
        for c in self.m.advance(self.t):
            w = self.ids.pop(c.name)
            del self.workers[w]
            if c.since_s not in self._unrecovered[-1:]:  # (one recovery per revocation instant)
                self._unrecovered.append(c.since_s)
            self.q.push(self.t + self.m.recovery.detect_s, (_EVICT, w, -1), priority=_EVICT)
        for name, (_, ready_at) in self.m.arriving.items():
            if name not in arriving:
                self.q.push(max(self.t, ready_at), (_READY, -1, -1), priority=_READY)

    def evict(self, w: int) -> None:
        self.table = self.table.without_worker(w)
        self.table_changed()

    def ready(self) -> None:
        """The arrivals ready now join at c_global and pull for it."""
        names = self.m.ready(self.t)
        self.m.admit(names)
        for name in names:
            w = self.m.index[name]
            self.ids[name] = w
            self.workers[w] = _Worker(self.m.live[name], self.cluster.rng_of(w))
            self.table = self.table.with_worker(w)
            heapq.heappush(self.pending, (self.c_global, w))  # (joining does not move it)
        self.serve()

    def run(self, last_arrival_s: float) -> str:
        """Handle events until the job is done (or cannot be: a note), then close the books."""
        while self.q and not self.done:
            event = self.q.pop()
            self.t, self.events = event.time, self.events + 1
            kind, w, clock = event.payload
            if kind == _CHANGE:
                self.change()
            elif kind == _EVICT:
                self.evict(w)
            elif kind == _READY:
                self.ready()
            elif kind == _APPLIED:
                self.applied(w, clock)
            else:
                self.computed(w, clock)
            if not self.workers and not self.m.arriving and self.t >= last_arrival_s:
                break
        self.recoveries += [0.0 for _ in self._unrecovered]  # (the job ended first)
        self.m.close(self.t)
        if self.done:
            return ""
        return "every worker was revoked and none arrived to go on (the servers keep the model)"


def _representatives(cluster: SimCluster, members: Members) -> dict[str, _Worker]:
    """One worker per device class (its first device) standing for the class's ``count``."""
    out: dict[str, _Worker] = {}
    for c in cluster.classes:
        name = f"{c.type}-0"
        out[name] = _Worker(members.live[name], cluster.rng_of(members.index[name]), c.count)
    return out


def simulate_ps(
    job: SimJob,
    cluster: SimCluster,
    spec: PSSpec,
    *,
    changes: tuple[Change, ...] | list[Change] = (),
    recovery: Recovery = Recovery(),
    aggregate: bool | None = None,
) -> SimResult:
    """Simulate ``job`` on a parameter server (see the module doc)."""
    if aggregate is None:
        aggregate = cluster.slowdown is None and not changes
    elif aggregate and (cluster.slowdown is not None or changes):
        raise ValueError("aggregate=True needs a cluster without slowdown and no changes")
    members = Members(cluster, changes, recovery)
    run = _Run(job, cluster, spec, members)
    if aggregate:
        workers = _representatives(cluster, members)
    else:
        workers = {n: _Worker(d, cluster.rng_of(members.index[n])) for n, d in members.live.items()}
    run.start(workers, changes)
    note = run.run(max((c.at_s for c in changes if not c.kill), default=0.0))
    return SimResult(
        strategy=spec.name,
        steps=run.steps_of(run.c_global),
        time_s=run.t,
        completed=run.done,
        device_s=members.device_s,
        cost=members.cost,
        samples=run.samples,
        timeline=run.timeline,
        recoveries_s=run.recoveries,
        events=run.events,
        note=note,
    )
