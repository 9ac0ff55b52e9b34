"""HetPipe's virtual workers in virtual time (``strategy: {kind: hetpipe}``; ``docs/simulator.md``,
``docs/hetpipe.md``).

The code the runtime runs, with modelled times:

- **the placement**: the launcher's own over the live devices (``sim/hetpipe_place.py``); each
  VW's wave: its pipeline's compute for ``W = s_local + 1`` minibatches and its stages' push and
  pull (``VirtualWorker.wave_compute_s`` / ``wave_sync_s``: the planner's cost model);
- **the gate**: the servers' clock table and WSP gate (``ps/consistency.ClockTable``,
  ``may_serve_pull``), driven event by event.

A VW's wave u (0-based) ends when its last minibatch's update is applied: at the later of its
previous wave's end plus the wave's compute (the ``W`` minibatches, one per ``minibatch_s``) and
the answer to its pull of clock u plus that minibatch alone through the whole pipeline
(``VirtualWorker.gated_s``: the gate holds the forward of a full wave's last minibatch,
``sync/hetpipe_plan``, which then meets no other in the pipeline). At a wave's end the VW pushes
it (the servers apply it half a sync later: ``table.advance``) and asks for the pull of clock
u + 1, answered half a sync after the gate allows it (``c_global >= u + 1 - D``). Every VW trains
every step (its share of each batch); the job is done when every VW pushed all ``ceil(steps / W)``
waves; ``steps`` done at a time is the slowest live VW's. Transient slowdowns scale a wave's
compute by the largest factor its devices draw.

Revocations (the runtime's launcher and hosted servers): a VW one of whose devices is revoked
stops at once (its pushes not yet applied are lost); ``detect_s`` later its other stages are
stopped and the servers evict it (``ClockTable.without_worker``), so the others' pulls no longer
wait on it.  From the data view without it (``ps/data_views``: the table's top clock + 2) the
survivors split every batch among themselves -- each wave's compute is its pipeline's per sample
times its part -- so their waves grow by about ``k / (k - 1)``; its slices of the waves in
between are dropped (``SimResult.note``).  The runtime brings a lost VW back on the same
devices (its stage processes started again: ``docs/hetpipe.md``), or with ``strategy.reform``
(``flotilla run``) forms it again without the device it lost, as ``reform`` below does (a
schedule's ``add`` making a device free for it); a revoked device does not come back here, so
by default a lost VW stays out: its surviving devices stay held (and paid for) until the end,
and arrivals are not used.  With no VW left the job ends incomplete (the runtime would resume it
from its servers' snapshots with `--resume`: not modelled).

With ``HetPipeSpec.reform`` (the runtime's ``strategy.reform``), an evicted VW's surviving
devices wait to be **formed again** (``pipeline/vw_reform.reform``: with as few free devices --
ones no VW uses, arrivals once ready -- as hold the model and make the job faster than without
it), tried at each eviction and each arrival; the new VW's stages start (``startup_s``), then it
joins the servers as a new worker (``ps/clock_rules.hello``: at the first clock of the next data
view) and pulls that clock.  A device of it revoked while it starts sends its others back to
waiting (and they are tried again at once).  The note says how many were formed again, and why
the others were not.

Not modelled: the servers' own transfer queue per wave (``vw_placement.job_estimate``'s servers
term: it bounds the wave when the servers' link is thin), the first profile's re-placement at the
chosen count's share (the share is the chosen count's from the start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flotilla.core.events import EventQueue
from flotilla.ps import clock_rules, data_views
from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.consistency import WSP, ClockTable, may_serve_pull
from flotilla.ps.data_views import DataViews
from flotilla.sim.hetpipe_place import part, place, reform_vw
from flotilla.sim.hetpipe_spec import HetPipeSpec, hetpipe_of
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimJob, SimResult, layers_of

__all__ = ["HetPipeSpec", "hetpipe_of", "simulate_hetpipe"]  # (the spec: sim/hetpipe_spec.py)


@dataclass(kw_only=True)
class _VW:
    index: int
    devices: tuple[SimDevice, ...]
    compute_s: float  # its pipeline's compute per sample of a minibatch (as placed)
    gated_s: float  # a wave's last minibatch through its whole pipeline, per sample (as placed)
    sync_s: float  # a wave's push and pull (both transfers)
    waves: int = 0  # waves ended (pushed)
    applied: int = 0  # waves the servers applied
    ended_at: float = 0.0  # its last wave's end
    alive: bool = True
    starting: bool = False  # (formed again: its stage processes start, then it joins the servers)


class _Run:
    def __init__(self, job: SimJob, cluster: SimCluster, spec: HetPipeSpec, members: Members) -> None:
        self.job, self.cluster, self.spec, self.m = job, cluster, spec, members
        self.wsp = WSP(s_local=spec.s_local, clock_distance=spec.clock_distance)
        self.W = spec.wave_size
        self.num_waves = math.ceil(job.steps / self.W)
        placement, share = place(job, cluster, spec, list(members.live.values()))
        self.placement = placement
        live = members.live
        self.vws = [
            _VW(
                index=k,
                devices=tuple(live[n] for n in vw.devices),
                compute_s=vw.wave_compute_s / self.W / share,  # (per sample)
                gated_s=vw.gated_s / share,  # (per sample)
                sync_s=vw.wave_sync_s,
            )
            for k, vw in enumerate(placement.vws)
        ]
        self.table = ClockTable.start(range(len(self.vws)))
        # shard 0's data views (ps/data_views, the servers' own code): which VWs split each wave
        self.views = data_views.first_view(DataViews(), range(len(self.vws)), 0)
        self.pending: dict[int, tuple[int, float]] = {}  # vw -> (the clock its pull asks, since)
        self.rngs = {n: cluster.rng_of(i) for n, i in members.index.items()}
        self.queue: EventQueue[tuple[str, int, int]] = EventQueue()
        self.t, self.events, self.samples, self.dropped = 0.0, 0, 0, 0
        self.gate_wait_s = 0.0
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self._unrecovered: list[float] = []
        self._done = 0  # the waves every live VW has applied
        self.waiting: list[tuple[str, ...]] = []  # lost VWs' surviving devices, to form again (reform)
        self.reformed, self.reform_why = 0, ""

    # ------------------------------------------------------------------ waves
    def _member(self, vw: _VW, wave: int) -> bool:
        got = data_views.split_of(self.views.views, wave, vw.index)
        return got is not None and got[0] >= 0

    def _share(self, vw: _VW, wave: int) -> int:
        """``vw``'s samples of each batch of ``wave``: its part in the data view covering it."""
        got = data_views.split_of(self.views.views, wave, vw.index)
        assert got is not None and got[0] >= 0, (vw.index, wave, self.views)
        return part(self.job.global_batch, got[0], got[1])

    def _compute(self, vw: _VW, wave: int) -> tuple[float, float]:
        """(the wave's compute, its last minibatch alone through the pipeline), its share and its
        devices' slowdown draws."""
        slow = max(self.cluster.compute_s(1.0, d, self.rngs[d.name]) * d.speed for d in vw.devices)
        share = self._share(vw, wave)
        n = min(self.W, self.job.steps - wave * self.W)
        return n * vw.compute_s * share * slow, vw.gated_s * share * slow

    def _schedule_end(self, vw: _VW, answered_at: float) -> None:
        """Wave ``vw.waves`` ends: its compute after the previous end, its last minibatch through
        the whole pipeline after the pull's answer (module doc)."""
        wave, (compute, alone) = vw.waves, self._compute(vw, vw.waves)
        end = max(vw.ended_at + compute, answered_at + alone)
        self.queue.push(end, ("end", vw.index, wave))

    def _serve(self, now: float) -> None:
        """Answer every pending pull the gate allows now (half a sync to reach its VW);
        ``gate_wait_s`` adds up how long the gate held them (other VWs behind)."""
        for k, (clock, since) in sorted(self.pending.items()):
            vw = self.vws[k]
            if vw.alive and may_serve_pull(self.wsp, self.table, k, clock):
                del self.pending[k]
                self.gate_wait_s += now - since
                self._schedule_end(vw, now + vw.sync_s / 2)

    def on_end(self, k: int, wave: int) -> None:
        vw = self.vws[k]
        if not vw.alive or wave != vw.waves:
            return
        vw.waves, vw.ended_at = wave + 1, self.t
        self.queue.push(self.t + vw.sync_s / 2, ("applied", k, wave))

    def _samples(self, vw: _VW, wave: int) -> int:
        return min(self.W, self.job.steps - wave * self.W) * self._share(vw, wave)

    def on_applied(self, k: int, wave: int) -> None:
        vw = self.vws[k]
        if not vw.alive:
            return  # (its push died with it: never applied)
        self.table = self.table.advance(k, wave)
        vw.applied = wave + 1
        self.samples += self._samples(vw, wave)
        done = min(v.applied for v in self.vws if v.alive)
        if done > self._done:  # (the job's steps grew: every live VW applied one more wave)
            self._done = done
            self.recoveries += [self.t - at for at in self._unrecovered]
            self._unrecovered = []
        self.timeline.append((self.t, min(self.job.steps, done * self.W), len(self.m.live)))
        if vw.waves < self.num_waves:
            self.pending[k] = (vw.waves, self.t)
        self._serve(self.t)

    # ------------------------------------------------------------------ revocations
    def on_revoked(self, name: str) -> None:
        self.waiting = [tuple(n for n in w if n != name) for w in self.waiting]
        vw = next(
            (v for v in self.vws if (v.alive or v.starting) and any(d.name == name for d in v.devices)), None
        )
        if vw is None:
            return  # (a device no VW uses)
        if vw.starting:  # (formed again, not in yet: its other devices wait again, tried at once)
            vw.starting = False
            self.waiting.append(tuple(d.name for d in vw.devices if d.name != name))
            self._try_reform()
            return
        vw.alive = False
        self._unrecovered.append(self.t)
        self.queue.push(self.t + self.m.recovery.detect_s, ("evict", vw.index, 0))

    def on_evict(self, k: int) -> None:
        """The servers evict VW ``k``; the survivors split the batches from the next data view."""
        vw = self.vws[k]
        self.pending.pop(k, None)
        self.table = self.table.without_worker(k)
        if self.spec.reform:
            self.waiting.append(tuple(d.name for d in vw.devices if d.name in self.m.live))
        live = [v for v in self.vws if v.alive]
        if not live:
            self._try_reform()
            return
        # the servers' rule (ps/clock_rules.remove): a data view without it from the next start,
        # its slices of the waves in between used by no push
        top, at = max(c for _, c in self.table.entries), vw.applied
        stop = data_views.start_of_next(self.views, top, after=at)
        held = [w for w in range(at, min(stop, self.num_waves)) if self._member(vw, w)]  # (as drop())
        self.dropped += sum(self._samples(vw, w) for w in held)
        views = data_views.drop(self.views, k, at, stop, "evicted")
        self.views = data_views.change(views, [v.index for v in live], top, after=at)
        self._try_reform()
        self._serve(self.t)

    # ------------------------------------------------------------------ a lost VW formed again
    def _try_reform(self) -> None:
        """Each lost VW waiting (``spec.reform``) formed again from its surviving devices and free
        ones (``pipeline/vw_reform``); it joins the servers once its stages started (module doc)."""
        for lost in list(self.waiting):
            held = {d.name for v in self.vws if v.alive or v.starting for d in v.devices}
            held |= {n for w in self.waiting for n in w}
            free = [d for n, d in self.m.live.items() if n not in held]
            survivors = [self.m.live[n] for n in lost]
            others = [list(v.devices) for v in self.vws if v.alive or v.starting]
            got = reform_vw(self.job, self.cluster, self.spec, survivors, free, others)
            if isinstance(got, str):
                self.reform_why = got
                continue
            share = max(1, self.job.global_batch // (len(others) + 1))  # (the VW's, as planned)
            self.waiting.remove(lost)
            used = tuple(self.m.live[n] for n in got.vw.devices if n not in got.released)
            vw = _VW(
                index=len(self.vws), devices=used, compute_s=got.vw.wave_compute_s / self.W / share,
                gated_s=got.vw.gated_s / share, sync_s=got.vw.wave_sync_s, alive=False, starting=True,
            )  # fmt: skip
            self.vws.append(vw)
            self.queue.push(self.t + self.m.recovery.startup_s, ("join", vw.index, 0))

    def on_join(self, k: int) -> None:
        """VW ``k``, formed again, joins the servers as a new worker (``ps/clock_rules.hello``: at
        the first clock of the next data view, at least c_global) and pulls that clock."""
        vw = self.vws[k]
        if not vw.starting:
            return  # (one of its devices was revoked while it started)
        state = ShardClocks(
            num_workers=1, table=self.table, joined=frozenset(range(k)), keeps_views=True, views=self.views
        )
        state, at = clock_rules.hello(state, k, 0, resync=False)
        for d in state.views.dropped[len(self.views.dropped) :]:  # (its slices before its clock)
            self.dropped += sum(self._samples(vw, w) for w in range(d.first, min(d.stop, self.num_waves)))
        self.table, self.views = state.table, state.views
        vw.starting, vw.alive, self.reformed = False, True, self.reformed + 1
        vw.waves = vw.applied = at
        vw.ended_at = self.t
        if at < self.num_waves:
            self.pending[k] = (at, self.t)
        self._serve(self.t)

    # ------------------------------------------------------------------ the run
    def run(self) -> bool:
        for vw in self.vws:  # (wave 0 needs no pull: clock 0 is the initial weights)
            self._schedule_end(vw, 0.0)
        while True:
            live = [v for v in self.vws if v.alive]
            if not live and not (self.waiting or any(v.starting for v in self.vws)):
                return False
            if live and all(v.waves >= self.num_waves for v in live) and not self.queue:
                return True
            nxt = self.queue.peek_time() if self.queue else None
            change = self.m.next_change_at()
            if change is not None and (nxt is None or change <= nxt):
                self.t = max(self.t, change)
                arriving = set(self.m.arriving)
                for c in self.m.advance(change):
                    self.on_revoked(c.name)
                for name, (_, ready_at) in self.m.arriving.items():  # (a device for a lost VW)
                    if self.spec.reform and name not in arriving:
                        self.queue.push(max(self.t, ready_at), ("ready", -1, 0))
                continue
            if nxt is None:
                return bool(live) and all(v.waves >= self.num_waves for v in live)
            event = self.queue.pop()
            kind, k, wave = event.payload
            if kind in ("end", "applied") and not self.vws[k].alive:
                continue  # (a revoked VW's wave: it never ends, and does not move the clock)
            self.t, self.events = event.time, self.events + 1
            if kind == "end":
                self.on_end(k, wave)
            elif kind == "applied":
                self.on_applied(k, wave)
            elif kind == "join":
                self.on_join(k)
            elif kind == "ready":
                names = self.m.ready(self.t)
                self.m.admit(names)
                self.rngs.update({n: self.cluster.rng_of(self.m.index[n]) for n in names})
                self._try_reform()
            else:
                self.on_evict(k)


def simulate_hetpipe(
    job: SimJob,
    cluster: SimCluster,
    spec: HetPipeSpec = HetPipeSpec(),
    *,
    changes: tuple[Change, ...] | list[Change] = (),
    recovery: Recovery = Recovery(),
) -> SimResult:
    """Simulate ``job`` as HetPipe's virtual workers (see the module doc)."""
    layers_of(job, "HetPipe")
    members = Members(cluster, changes, recovery)
    run = _Run(job, cluster, spec, members)
    completed = run.run()
    members.close(run.t)
    vws = "; ".join(",".join(d.name for d in v.devices) for v in run.vws[:4])
    vws += "; ..." if len(run.vws) > 4 else ""
    lost = [v.index for v in run.vws if not v.alive]
    note = (
        f"placement {run.placement.policy}: {len(run.vws)} VW(s) ({vws}); gate waits {run.gate_wait_s:.3g} s"
        + (f"; VW(s) {lost} lost, {run.dropped} samples dropped" if lost else "")
        + (f"; {run.reformed} formed again from other devices" if run.reformed else "")
        + (f"; {len(run.waiting)} not formed again: {run.reform_why}" if run.waiting else "")
    )
    steps = min((v.applied for v in run.vws if v.alive), default=0) * run.W
    return SimResult(
        strategy=f"{spec.name} ({run.placement.policy}, s_local {spec.s_local}, D {spec.clock_distance})",
        steps=min(job.steps, steps),
        time_s=run.t,
        completed=completed,
        device_s=members.device_s,
        cost=members.cost,
        samples=run.samples,
        timeline=run.timeline,
        recoveries_s=run.recoveries,
        events=run.events,
        note=note,
    )
