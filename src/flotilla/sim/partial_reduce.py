"""Partial reduce in virtual time (``docs/simulator.md``, ``docs/partial_reduce.md``, SPEC §5).

An event-driven run (``core/events.EventQueue``) of every worker, with the runtime's own group
controller (``sync/pr_plan.GroupController``, unchanged) deciding every group:

- a worker **computes** one local step (``SimCluster.compute_s``, its own seeded draws
  ``rng_of(index)``), then sends ``pr_ready(version)``: the controller's ``ready`` one message
  later (a message, either way: ``SimCluster.message_s`` of a small body -- the link among all
  devices, as ``sim/ps.py`` places its servers, plus the message plane's own cost);
- after every batch of simultaneous events the simulator calls ``form(now)``, as the runtime's
  polling workers do; a worker still waiting gets a re-check at its ready time +
  ``group_timeout_s`` so the controller's timeout can form a smaller group;
- a group's members learn of it one message later, all-reduce the model's bytes
  (``ring_allreduce_s`` over ``cluster.link_among`` the members) and report success (``report``,
  one message later); the group commits and one message later every member holds the group's
  maximum version (a newcomer: the steps of the most advanced holder in it) and goes on;
- a solo assignment goes on when its reply arrives; ``done_for`` (its partners finished) ends
  that worker; a worker that did ``job.steps`` local steps calls ``finish``.

The job's ``steps`` is rank 0's (the lowest worker id not revoked, a holder of the model) as in
the runtime; ``completed``: some worker trained all its steps; ``time_s``: when the last worker
finished or was done; ``timeline``: (time, steps of the most advanced worker not revoked, devices
held) at each committed group; ``samples``: local steps x ``batch_per_worker`` (every local step
counts: an aborted group keeps it).

Revocations and arrivals (``sim/members.Members``): a revoked worker stops at once; its groups
cannot complete, and ``Recovery.detect_s`` later the controller drops it (``drop``): its open
groups abort and their other members keep their local step and go on (one message later).  Until
then the controller may still place it in a group, whose members then wait for the drop.  An
arrival is ready ``startup_s`` after it arrives, asks as a newcomer (``admit``: weight 0 in its
first group, the controller's rule), re-asks after an aborted group, and stops when no holder is
left (``lost_for``).  ``recoveries_s``: from each revocation of a training worker to the next
committed group (0 if the run ended first).

Not modelled: the group set-up cost of a new member set (``group_setup_s``), ``repair_s``, the
workers' polling interval, ``step_timeout_s``, the stop of the job by the coordinator, the
``pr_leave`` message's flight, a ready message in flight when its sender is revoked (counted as
never sent), evaluations and checkpoints (partial reduce keeps no job checkpoint).  A device is paid
until the end of the run even after its worker finished.  ``group_size`` is not checked against
the number of workers (the runtime refuses ``group_size >= workers``; here P' = min(P, live)).

Cost: one event per worker per step and message, one timeout check pending at a time (the
controller's timeout rule looks only at the oldest ready worker: a check at its timeout, scheduled
again after every ``form`` for the oldest still waiting, forms every group a check per worker
would), and the controller's ``form`` after each batch that changed its inputs.  1,024 workers x
1,000 steps under the AWS p3 trace: see ``docs/simulator.md``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from flotilla.cluster.comm_cost import ring_allreduce_s
from flotilla.core.events import EventQueue
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimJob, SimResult
from flotilla.sim.pr_spec import PRSpec, partial_reduce_of
from flotilla.sync.pr_plan import GroupController, GroupState

__all__ = ["PRSpec", "partial_reduce_of", "simulate_partial_reduce"]  # (the spec: sim/pr_spec.py)

_MESSAGE_BYTES = 256  # a controller message (pr_ready / pr_done and their replies)
# event kinds; simultaneous events are handled in this order, then the controller forms groups
_CHANGE, _DROP, _ARRIVE, _REPORT, _RESUME, _READY, _CHECK = range(7)
_Payload = tuple[int, int, int]  # (kind, worker or group id, flag)
# a worker's states: computing (or its ready message in flight), in the controller's queue, in an
# open group, told to go on (message in flight); then one of the ends
_COMPUTING, _WAITING, _GROUP, _RESUMING = "computing", "waiting", "group", "resuming"
_ENDS = frozenset({"finished", "done", "lost", "revoked"})


@dataclass(slots=True)
class _Worker:
    id: int
    device: SimDevice
    rng: random.Random
    steps: int = 0  # local steps done (a newcomer: from the step it joined at)
    version: int = 0
    newcomer: bool = False  # holds no model yet
    state: str = _COMPUTING
    joined_at: int = 0


def _at_least(since: float, wait: float) -> float:
    """The first float time ``t`` with ``t - since >= wait`` (the controller's timeout test)."""
    t = since + wait
    while t - since < wait:
        t = math.nextafter(t, math.inf)
    return t


class _Run:
    """One simulation's state and its event handlers."""

    def __init__(self, job: SimJob, cluster: SimCluster, spec: PRSpec, members: Members) -> None:
        self.job, self.cluster, self.spec, self.m = job, cluster, spec, members
        self.h = cluster.message_s(_MESSAGE_BYTES, cluster.devices())  # one message
        self.q: EventQueue[_Payload] = EventQueue()
        self.workers = {
            members.index[n]: _Worker(members.index[n], d, cluster.rng_of(members.index[n]))
            for n, d in members.live.items()
        }
        self.ids = {n: members.index[n] for n in members.live}  # device name -> its worker id
        self.ctrl = GroupController(spec.config(), sorted(self.workers))
        self.active = set(self.workers)  # not ended yet
        self.open: dict[int, tuple[int, ...]] = {}  # open group id -> members
        self.t, self.events, self.samples, self.top = 0.0, 0, 0, 0
        self.finished = False
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self._unrecovered: list[float] = []
        # waiting workers -> ready since, oldest first (entries of workers no longer waiting are
        # dropped lazily); one timeout check is pending, at the oldest's timeout (module doc)
        self._waiting: dict[int, float] = {}
        self._check_at = -1.0
        self._dropped = False  # a drop in this batch: waiting newcomers may be lost
        self._dirty = False  # the controller's inputs changed since its last form

    def start(self, changes: tuple[Change, ...] | list[Change]) -> None:
        for at in sorted({max(0.0, c.at_s) for c in changes}):
            self.q.push(at, (_CHANGE, -1, 0), priority=_CHANGE)
        for w in sorted(self.workers):
            self._compute(self.workers[w])

    def run(self) -> None:
        """Handle events, a batch of simultaneous ones at a time, then let the controller form."""
        handlers = (self.change, self.drop, self.arrive, self.report, self.resume, self.ready, self.check)
        while self.q and self.active:
            event = self.q.pop()
            self.t, self.events = event.time, self.events + 1
            kind, x, flag = event.payload
            handlers[kind](x, flag)
            if self._dirty and self.active and self.q.peek_time() != self.t:
                self.form()
        self.recoveries += [0.0 for _ in self._unrecovered]  # (the run ended first)
        self.m.close(self.t)

    # ------------------------------------------------------------------ a worker's loop
    def _compute(self, wk: _Worker) -> None:
        wk.state = _COMPUTING
        compute = self.cluster.compute_s(self.job.step_s, wk.device, wk.rng)
        self.q.push(self.t + compute + self.h, (_READY, wk.id, 0), priority=_READY, tie=wk.id)

    def _end(self, wk: _Worker, why: str) -> None:
        wk.state = why
        self.active.discard(wk.id)
        if why == "finished":
            self.finished = True
        elif why == "revoked" and wk.steps >= self.top:
            self.top = max((v.steps for v in self.workers.values() if v.state != "revoked"), default=0)

    def ready(self, w: int, _: int) -> None:
        """Its ready reaches the controller (a newcomer's first asks to be admitted)."""
        wk = self.workers[w]
        if wk.state != _COMPUTING:  # (revoked meanwhile: counted as never sent)
            return
        if wk.newcomer:
            if w not in self.ctrl.live:
                self.ctrl.admit(w)
        else:
            wk.steps, wk.version = wk.steps + 1, wk.version + 1
            self.samples += self.job.batch_per_worker
            self.top = max(self.top, wk.steps)
        self.ctrl.ready(w, wk.version, self.t)
        wk.state = _WAITING
        self._waiting.pop(w, None)
        self._waiting[w] = self.t
        self._dirty = True
        if self.ctrl.lost_for(w):
            self._lose(wk)

    def _lose(self, wk: _Worker) -> None:
        self._end(wk, "lost")
        self.ctrl.drop(wk.id)  # (it stops with an error; the coordinator drops it)

    def resume(self, w: int, done: int) -> None:
        """It learnt its group's (or solo step's) end: go on, finish, or stop (done)."""
        wk = self.workers[w]
        if wk.state != _RESUMING:
            return
        if wk.steps >= self.job.steps or done:  # (done at its last step: it finished)
            self.ctrl.finish(w)
            self._end(wk, "finished" if wk.steps >= self.job.steps else "done")
            self._dropped = self._dirty = True
        elif wk.newcomer:  # (its group aborted: it asks again)
            wk.state = _COMPUTING
            self.q.push(self.t + self.h, (_READY, w, 0), priority=_READY, tie=w)
        else:
            self._compute(wk)

    def _go_on(self, w: int, done: bool = False) -> None:
        wk = self.workers[w]
        if wk.state in _ENDS:
            return
        wk.state = _RESUMING
        self.q.push(self.t + self.h, (_RESUME, w, int(done)), priority=_RESUME, tie=w)

    # ------------------------------------------------------------------ the controller
    def check(self, w: int, _: int) -> None:
        """The oldest waiting worker's group timeout has passed (it, or one that became the oldest
        since, with the same ready time, may time out now): the controller forms again."""
        self._dirty = True

    def form(self) -> None:
        self._dirty = False
        if self._dropped:
            self._dropped = False
            for w in sorted(self.active):
                wk = self.workers[w]
                if wk.newcomer and wk.state == _WAITING and self.ctrl.lost_for(w):
                    self._lose(wk)
        for a in self.ctrl.form(self.t):
            if a.solo:
                self._go_on(a.members[0], done=self.ctrl.done_for(a.members[0]))
                continue
            self.open[a.group_id] = a.members
            for m in a.members:
                if self.workers[m].state == _WAITING:  # (not a revoked one the controller still counts)
                    self.workers[m].state = _GROUP
            link = self.cluster.link_among([self.workers[m].device for m in a.members])
            ar = ring_allreduce_s(len(a.members), self.job.model_bytes, link)
            self.q.push(self.t + 2 * self.h + ar, (_REPORT, a.group_id, 0), priority=_REPORT)
        stale = []
        for w, since in self._waiting.items():  # (the oldest still waiting: its timeout is next)
            if self.workers[w].state != _WAITING:
                stale.append(w)
                continue
            at = _at_least(since, self.spec.group_timeout_s)
            if at > self.t and at != self._check_at:
                self._check_at = at
                self.q.push(at, (_CHECK, w, 0), priority=_CHECK)
            break
        for w in stale:
            del self._waiting[w]

    def report(self, gid: int, _: int) -> None:
        """The members' reports reach the controller; committed: every member takes the result."""
        members = self.open.get(gid)
        if members is None:  # (aborted meanwhile)
            return
        state = GroupState.OPEN
        for m in members:
            if self.workers[m].state == _GROUP:
                state = self.ctrl.report(m, gid, True)
        if state is not GroupState.COMMITTED:  # (a revoked member: the group waits for its drop)
            return
        del self.open[gid]
        self._dirty = True  # (the members' knowledge changed: a bridging group may form)
        holders = [self.workers[m] for m in members if not self.workers[m].newcomer]
        version, at = max(h.version for h in holders), max(h.steps for h in holders)
        for m in members:
            wk = self.workers[m]
            wk.version = version
            if wk.newcomer:
                wk.newcomer, wk.steps, wk.joined_at = False, at, at
            self._go_on(m)
        self.timeline.append((self.t, self.top, len(self.m.live)))
        self.recoveries += [self.t - at_s for at_s in self._unrecovered]
        self._unrecovered = []

    # ------------------------------------------------------------------ membership
    def change(self, _: int, __: int) -> None:
        """Apply the changes due: revoke workers (dropped later), schedule the arrivals."""
        arriving = set(self.m.arriving)
        for c in self.m.advance(self.t):
            wk = self.workers[self.ids.pop(c.name)]
            if wk.state in _ENDS:
                continue
            self._end(wk, "revoked")
            if c.since_s not in self._unrecovered[-1:]:  # (one recovery per revocation instant)
                self._unrecovered.append(c.since_s)
            self.q.push(self.t + self.m.recovery.detect_s, (_DROP, wk.id, 0), priority=_DROP)
        for name, (_device, ready_at) in self.m.arriving.items():
            if name not in arriving:
                self.q.push(max(self.t, ready_at), (_ARRIVE, -1, 0), priority=_ARRIVE)

    def drop(self, w: int, _: int) -> None:
        """The revoked worker is declared dead: its open groups abort, their members go on."""
        for gid in self.ctrl.drop(w):
            for m in self.open.pop(gid, ()):
                self._go_on(m)
        self._dropped = self._dirty = True

    def arrive(self, _: int, __: int) -> None:
        """The arrivals that finished starting up ask for a group as newcomers."""
        names = self.m.ready(self.t)
        self.m.admit(names)
        for name in names:
            w = self.m.index[name]
            wk = _Worker(w, self.m.live[name], self.cluster.rng_of(w), newcomer=True)
            self.workers[w], self.ids[name] = wk, w
            self.active.add(w)
            self.q.push(self.t + self.h, (_READY, w, 0), priority=_READY, tie=w)

    def rank0_steps(self) -> int:
        holders = [w for w, wk in self.workers.items() if wk.state not in ("revoked", "lost")]
        holders = [w for w in holders if not self.workers[w].newcomer]
        if holders:
            return self.workers[min(holders)].steps
        return max((wk.steps for wk in self.workers.values()), default=0)


def _run(
    job: SimJob, cluster: SimCluster, spec: PRSpec, changes: tuple[Change, ...] | list[Change],
    recovery: Recovery,
) -> _Run:  # fmt: skip
    run = _Run(job, cluster, spec, Members(cluster, changes, recovery))
    run.start(changes)
    run.run()
    return run


def simulate_partial_reduce(
    job: SimJob,
    cluster: SimCluster,
    spec: PRSpec,
    *,
    changes: tuple[Change, ...] | list[Change] = (),
    recovery: Recovery = Recovery(),
) -> SimResult:
    """Simulate ``job`` under partial reduce (see the module doc)."""
    run = _run(job, cluster, spec, changes, recovery)
    note = ""
    if not run.finished:
        note = (
            "every worker holding the model was revoked (partial reduce keeps no job checkpoint)"
            if not run.active
            else "the workers stalled: no group could form"
        )
    return SimResult(
        strategy=spec.name,
        steps=run.rank0_steps(),
        time_s=run.t,
        completed=run.finished,
        device_s=run.m.device_s,
        cost=run.m.cost,
        samples=run.samples,
        timeline=run.timeline,
        recoveries_s=run.recoveries,
        events=run.events,
        note=note,
    )
