"""AD-PSGD (``sync/adpsgd.py``, ``docs/adpsgd.md``) in virtual time (``docs/simulator.md``).

An event-driven run (``core/events.EventQueue``) of every worker's loop taking the runtime's own
pure decisions (``sync/adpsgd_plan.py``): who may average with whom (``candidates``: the
bipartition ``roles``, minus the peers tried this step), the seeded peer choice (``choose_peer``,
the runtime's seed, worker id, step and attempt) and each worker's exchange slot (a real ``Slot``:
``take`` / ``prepare`` / ``commit`` / ``abort``, the simulated time as ``now``).

A step of worker ``w`` (``T``, ``T0``: ``SimCluster.message_s`` of the model's bytes, of 0 bytes,
between ``w`` and its peer: their link plus the message plane's own cost; ``cluster/comm_cost.py``):
it computes (``compute_s``, its
draws ``rng_of(index)``; the update is part of ``step_s``) and takes its slot, waiting while a
peer's exchange is prepared on it (the runtime's ``_take``); if active, it tries up to
``attempts`` passive peers: the prepare carries its model (``T``); on arrival the peer's slot
decides -- ``prepared``: the average comes back (``T``), the commit goes and is answered (``T0``
each; the peer's slot held from the prepare's arrival to the commit's): ``2 T + 2 T0``; ``busy``
(or ``closed``) comes back (``T0``): ``T + T0`` lost, next attempt.  No candidate (passive) or no
attempt left: it trains alone.  It frees its slot: the step is done.  A passive's own step holds
its slot for no simulated time (the runtime holds it for the optimizer step, inside ``step_s``).

End (the runtime's ``training_done``): a worker finishes after ``job.steps`` steps or, lagging, at
the end of a step once every other known-live member finished.  ``steps``: rank 0's count (the
lowest live id; below ``job.steps`` when it lagged -- rank 0 is always active: it pays the
exchanges); ``completed``: the run ended so, a replica left.  ``time_s``: the last end plus one
final consensus, ``ring_allreduce_s`` of the model over the finished replicas (the runtime's rank
0 fetches them one by one: the ring is the optimistic bound).  ``timeline``: (time, rank 0's
steps, live devices) at each step of rank 0 and each revocation or admission; ``samples``: all
steps x ``batch_per_worker``; ``note``: ``exchanges=.., busy=.., aborted=..`` (committed, busy
answers, aborted on a passive).

Revocations and arrivals (``sim/members.Members``): a revoked worker stops; all learn of it
``detect_s`` later (it leaves the roles then).  Its exchange in flight applies nothing: a dead
active's prepared exchange is aborted on the passive at revocation + ``detect_s`` (unless its
commit was sent); a dead passive's fails on the active then (next attempt).  ``recoveries_s``:
from each revocation to the next committed exchange (0: none followed).  An arrival, ready
``startup_s`` after it arrives, asks the running workers in id order for their state (``T0``;
busy: ``T0`` back); the first free lends it (its slot taken and given back at once, as the
runtime's export) and it comes (``T``): the joiner starts at the lender's step (none: at 0)
(``sim/adpsgd_join.py``: the workers, the events and a joiner's handlers).

Not modelled: ``exchange_timeout_s`` (the runtime frees a dead active's slot at the prepare's
deadline and fails a call to a dead passive at its timeout; here both at detection),
``status_every`` (finishes and joins are known at once), evaluations and checkpoints, a joiner's
optimizer state, contention on shared links, ``unknown`` (half-applied) exchanges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flotilla.cluster.comm_cost import ring_allreduce_s
from flotilla.core.events import EventQueue
from flotilla.sim.adpsgd_join import (
    _ABORT,
    _ANSWER,
    _ARRIVE,
    _CHANGE,
    _COMMIT,
    _COMPUTED,
    _DEAD,
    _DETECT,
    _DONE,
    _FAIL,
    _FINISHED,
    _JOIN,
    _JOINED,
    _JOINING,
    _READY,
    _RUNNING,
    Joining,
    _Payload,
    _Worker,
)  # fmt: skip
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimJob, SimResult
from flotilla.sync.adpsgd_plan import candidates_of, choose_peer, roles

__all__ = ["ADPSGDSpec", "Exchange", "adpsgd_of", "simulate_adpsgd"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ADPSGDSpec:
    """``seed``: of the peer choice; ``attempts``: passive peers tried per step; ``name``: the
    strategy's kind in the result."""

    seed: int = 0
    attempts: int = 2
    name: str = "adpsgd"

    def __post_init__(self) -> None:
        for name, least in (("seed", 0), ("attempts", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"ADPSGDSpec.{name} must be an integer >= {least}, got {v!r}")

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        return simulate_adpsgd(job, cluster, self, changes=changes, recovery=recovery)


def adpsgd_of(settings: Any) -> ADPSGDSpec:
    """``strategy: {kind: adpsgd, seed: s, attempts: a}`` (``StrategySpec.simulated``; read by name)."""
    return ADPSGDSpec(seed=int(settings.seed), attempts=int(settings.attempts))


@dataclass(slots=True)
class Exchange:
    """``active`` chose ``passive`` at ``t`` (``live``: the live members then, when recorded);
    ``done``: committed on both sides (``simulate_adpsgd(record=...)`` gets the committed ones)."""

    key: int
    xid: str
    active: int
    passive: int
    t: float
    live: tuple[int, ...]
    T: float  # a model's transfer over their link
    T0: float  # an empty message's
    state: str = "sent"  # -> prepared -> committed, or failed
    prepared_at: float = math.inf
    done: float = math.inf


class _Run(Joining):
    """One simulation's state and its event handlers (a joiner's: ``sim/adpsgd_join.py``)."""

    def __init__(
        self, job: SimJob, cluster: SimCluster, spec: ADPSGDSpec, members: Members,
        record: list[Exchange] | None,
    ) -> None:  # fmt: skip
        self.job, self.cluster, self.spec, self.m, self.record = job, cluster, spec, members, record
        self.q: EventQueue[_Payload] = EventQueue()
        self.w: dict[int, _Worker] = {}
        self.ids: dict[str, int] = {}  # device name -> its worker id
        self.members: set[int] = set()  # the ids everyone knows (initial and joined)
        self.gone: set[int] = set()  # known dead
        self.finished: set[int] = set()
        self.unseen: set[int] = set()  # revoked while training, not known dead yet
        self.x: dict[int, Exchange] = {}  # exchanges in flight
        self._among: dict[tuple[int, frozenset[int]], tuple[int, ...]] = {}  # (cleared on any change)
        self._roles: tuple[frozenset[int], tuple[int, ...]] | None = None  # (active, passive) meanwhile
        self.seq, self.rank0, self.last0, self.t, self.events, self.samples = 0, -1, 0, 0.0, 0, 0
        self.exchanges = self.busy = self.aborted = 0
        self.training = self.open = 0  # workers running or joining; members not known dead nor finished
        self.reached = False  # some worker trained the job's steps
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self.unrecovered: list[float] = []

    def push(self, at: float, kind: int, w: int, ref: int = -1) -> None:
        self.q.push(at, (kind, w, ref), priority=kind, tie=w)

    def costs(self, a: _Worker, b: _Worker) -> tuple[float, float]:
        pair = [a.device, b.device]  # (exchanges travel on the message plane)
        return self.cluster.message_s(self.job.model_bytes, pair), self.cluster.message_s(0, pair)

    def holders(self) -> list[int]:
        """The workers holding a replica (running or finished, not revoked), in id order."""
        return sorted(i for i, w in self.w.items() if w.state in (_RUNNING, _FINISHED))

    def compute(self, w: _Worker) -> None:
        self.push(self.t + self.cluster.compute_s(self.job.step_s, w.device, w.rng), _COMPUTED, w.id)

    def start(self, changes: tuple[Change, ...] | list[Change]) -> None:
        for name, device in self.m.live.items():
            i = self.ids[name] = self.m.index[name]
            self.w[i] = _Worker(i, device, self.cluster.rng_of(i))
        self.members = set(self.w)
        self.training = self.open = len(self.w)
        self.rank0 = min(self.w)
        for at in sorted({max(0.0, c.at_s) for c in changes}):
            self.push(at, _CHANGE, -1)
        for w in self.w.values():
            self.compute(w)

    def membership_changed(self) -> None:
        """Members, the known dead or the finished changed: the roles are worked out again."""
        self._roles = None
        self._among.clear()

    def take(self, w: _Worker) -> None:
        w.waiting = not w.slot.take(self.t)
        if not w.waiting:
            w.attempt, w.tried = 0, set()
            self.try_peer(w)

    def freed(self, w: _Worker) -> None:
        """``w``'s slot was freed by a commit or an abort: its own waiting step goes first."""
        if w.waiting and w.state == _RUNNING:
            self.take(w)

    def try_peer(self, w: _Worker) -> None:
        """The runtime's ``_exchange``: attempt ``w.attempt``, or the step alone."""
        peer = None
        if w.attempt < self.spec.attempts:
            key = (w.id, frozenset(w.tried))
            among = self._among.get(key)
            if among is None:  # (the real rule; its inputs change rarely: remembered meanwhile)
                if self._roles is None:
                    active, passive = roles(self.members, self.gone, self.finished)
                    self._roles = (frozenset(active), passive)
                among = self._among[key] = candidates_of(w.id, *self._roles, w.tried)
            peer = choose_peer(self.spec.seed, w.id, w.done, w.attempt, among)
        if peer is None:
            self.step_done(w)
            return
        w.tried.add(peer)
        self.seq += 1
        T, T0 = self.costs(w, self.w[peer])
        live = tuple(sorted(self.members - self.gone - self.finished)) if self.record is not None else ()
        self.x[self.seq] = Exchange(self.seq, f"{w.id}:{self.seq}", w.id, peer, self.t, live, T, T0)
        self.push(self.t + T, _ARRIVE, peer, self.seq)

    def step_done(self, w: _Worker) -> None:
        w.slot.release()
        w.done += 1
        self.samples += self.job.batch_per_worker
        if w.id == self.rank0:
            self.last0 = w.done
            self.timeline.append((self.t, w.done, len(self.m.live)))
        if w.done >= self.job.steps or (self.finished and self.open == 1):  # (1: this worker)
            self.reached = self.reached or w.done >= self.job.steps
            w.state, w.slot.closed = _FINISHED, True
            self.finished.add(w.id)
            self.membership_changed()
            self.training, self.open = self.training - 1, self.open - 1
        else:
            self.compute(w)

    def arrive(self, x: Exchange) -> None:
        """The prepare reaches the passive: its slot decides."""
        if x.state != "sent":
            return
        p = self.w[x.passive]
        if p.state == _DEAD:  # (revoked since: the active learns it when the death is known)
            del self.x[x.key]
            self.push(max(self.t, p.revoked_at + self.m.recovery.detect_s), _FAIL, x.active)
            return
        status = p.slot.prepare(x.xid, x.active, self.t, math.inf)
        if status == "prepared":
            x.state, x.prepared_at = "prepared", self.t
            self.push(self.t + x.T + x.T0, _COMMIT, x.passive, x.key)
        else:
            self.busy += 1 if status == "busy" else 0
            del self.x[x.key]
            self.push(self.t + x.T0, _ANSWER, x.active)

    def commit(self, x: Exchange) -> None:
        if x.state != "prepared":
            return
        p = self.w[x.passive]
        if p.slot.commit(x.xid) != "committed":
            raise AssertionError(f"simulate_adpsgd: exchange {x.xid} could not commit")
        x.state = "committed"
        self.push(self.t + x.T0, _DONE, x.active, x.key)
        self.freed(p)

    def done(self, x: Exchange) -> None:
        del self.x[x.key]
        a = self.w[x.active]
        if a.state != _RUNNING:
            return
        self.exchanges += 1
        x.done = self.t
        if self.record is not None:
            self.record.append(x)
        self.recoveries += [self.t - at for at in self.unrecovered]
        self.unrecovered = []
        self.step_done(a)

    def abort(self, x: Exchange) -> None:
        """A dead active's prepared exchange is aborted on the passive (nothing applied)."""
        del self.x[x.key]
        p = self.w[x.passive]
        if p.state != _DEAD and p.slot.abort(x.xid) == "aborted":
            self.aborted += 1
            self.freed(p)

    def change(self) -> None:
        arriving = set(self.m.arriving)
        killed = self.m.advance(self.t)
        if killed:
            self.timeline.append((self.t, self.last0, len(self.m.live)))
        for c in killed:
            d = self.w[self.ids.pop(c.name)]
            if d.state in (_RUNNING, _JOINING):
                self.training -= 1
                self.unseen.add(d.id)
            d.state, d.revoked_at = _DEAD, self.t
            if c.since_s not in self.unrecovered[-1:]:  # (one recovery per revocation instant)
                self.unrecovered.append(c.since_s)
            seen = self.t + self.m.recovery.detect_s
            self.push(seen, _DETECT, d.id)
            for key, x in list(self.x.items()):
                if x.active == d.id and (x.state == "sent" or self.t < x.prepared_at + x.T):
                    x.state = "failed"  # (no commit was sent: the passive aborts once it knows)
                    self.push(seen, _ABORT, x.passive, key)
                elif x.passive == d.id and x.state in ("sent", "prepared"):
                    del self.x[key]  # (the active learns it when the death is known)
                    self.push(seen, _FAIL, x.active)
            holders = self.holders()
            self.rank0 = holders[0] if holders else -1
        for name, (_, ready_at) in self.m.arriving.items():
            if name not in arriving:
                self.push(max(self.t, ready_at), _READY, -1)

    def detect(self, d: int) -> None:
        if d in self.members and d not in self.finished:
            self.open -= 1
        self.gone.add(d)
        self.unseen.discard(d)
        self.membership_changed()

    def run(self) -> tuple[bool, str]:
        on_x = {_ARRIVE: self.arrive, _COMMIT: self.commit, _DONE: self.done, _ABORT: self.abort}
        while self.q:
            event = self.q.pop()
            self.t, self.events = event.time, self.events + 1
            kind, i, ref = event.payload
            w = self.w.get(i)
            if kind == _CHANGE:
                self.change()
            elif kind == _DETECT:
                self.detect(i)
            elif kind == _READY:
                self.ready()
            elif kind in (_JOIN, _JOINED) and w is not None and w.state == _JOINING:
                (self.join if kind == _JOIN else self.joined)(w, ref)
            elif kind == _COMPUTED and w is not None and w.state == _RUNNING:
                self.take(w)
            elif kind in (_ANSWER, _FAIL) and w is not None and w.state == _RUNNING:
                w.attempt += 1
                self.try_peer(w)
            elif kind in on_x and (x := self.x.get(ref)) is not None:
                on_x[kind](x)
            if self.rank0 < 0:
                return False, "every worker holding a replica was revoked (no checkpoint restart modelled)"
            if self.training == 0 and not self.unseen:
                return True, ""
        raise AssertionError("simulate_adpsgd: the events ran out before the end")


def simulate_adpsgd(
    job: SimJob, cluster: SimCluster, spec: ADPSGDSpec = ADPSGDSpec(), *,
    changes: tuple[Change, ...] | list[Change] = (), recovery: Recovery = Recovery(),
    record: list[Exchange] | None = None,
) -> SimResult:  # fmt: skip
    """Simulate ``job`` under AD-PSGD (see the module doc); ``record`` receives every committed
    exchange."""
    members = Members(cluster, changes, recovery)
    run = _Run(job, cluster, spec, members, record)
    run.start(changes)
    ended, note = run.run()
    replicas = [run.w[i] for i in sorted(run.finished) if run.w[i].state == _FINISHED]
    end = run.t
    if ended:
        link = cluster.link_among([w.device for w in replicas])
        end += ring_allreduce_s(len(replicas), job.model_bytes, link)
    members.close(end)
    rank0 = run.w.get(run.rank0)
    counts = f"exchanges={run.exchanges}, busy={run.busy}, aborted={run.aborted}"
    return SimResult(
        strategy=spec.name, steps=rank0.done if rank0 is not None else run.last0, time_s=end,
        completed=ended and run.reached, device_s=members.device_s, cost=members.cost,
        samples=run.samples, timeline=run.timeline, events=run.events,
        recoveries_s=run.recoveries + [0.0 for _ in run.unrecovered],  # (0: the job ended first)
        note=f"{note}; {counts}" if note else counts,
    )  # fmt: skip
