"""AD-PSGD in virtual time (``sim/adpsgd.py``): the run's events and workers, and a joiner's side.

A worker that arrives (ready ``startup_s`` after it arrives) asks the running workers in id order
for their state (``T0``; busy: ``T0`` back); the first free lends it -- its slot taken and given
back at once, as the runtime's export (``sync/adpsgd_join.py``) -- and the state comes (``T``): the
joiner starts at the lender's step (nobody lent: at 0, the runtime's fallback).  A dead lender
answers nothing: the next is asked once its death is known.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from flotilla.sim.members import Members
from flotilla.sim.model import SimCluster, SimDevice
from flotilla.sync.adpsgd_plan import Slot

# event kinds; simultaneous events are handled in this order (a slot is freed before a prepare)
_CHANGE, _DETECT, _READY, _JOIN, _JOINED, _ABORT, _COMMIT = range(7)
_ARRIVE, _ANSWER, _FAIL, _DONE, _COMPUTED = range(7, 12)
_Payload = tuple[int, int, int]  # (kind, worker id, exchange key or lender index or step)
_RUNNING, _JOINING, _FINISHED, _DEAD = range(4)


@dataclass(slots=True)
class _Worker:
    """A worker of the run (a joiner: ``lenders`` to ask in id order)."""

    id: int
    device: SimDevice
    rng: random.Random
    state: int = _RUNNING
    slot: Slot = field(default_factory=Slot)
    done: int = 0  # steps trained (a joiner: from its lender's count)
    attempt: int = 0
    tried: set[int] = field(default_factory=set)
    waiting: bool = False  # its compute ended; it waits for its slot
    revoked_at: float = math.inf
    lenders: list[int] = field(default_factory=list)  # a joiner's, to ask in id order


class Joining:
    """The handlers of a joiner's events (``_READY``, ``_JOIN``, ``_JOINED``), mixed into the run
    (``sim/adpsgd._Run``), whose state they use."""

    m: Members
    cluster: SimCluster
    w: dict[int, _Worker]
    ids: dict[str, int]
    members: set[int]
    gone: set[int]
    t: float
    seq: int
    training: int
    open: int
    last0: int
    timeline: list[tuple[float, int, int]]

    def push(self, at: float, kind: int, w: int, ref: int = -1) -> None:
        raise NotImplementedError

    def holders(self) -> list[int]:
        raise NotImplementedError

    def costs(self, a: _Worker, b: _Worker) -> tuple[float, float]:
        raise NotImplementedError

    def compute(self, w: _Worker) -> None:
        raise NotImplementedError

    def membership_changed(self) -> None:
        raise NotImplementedError

    def ready(self) -> None:
        names = self.m.ready(self.t)
        self.m.admit(names)
        self.timeline.append((self.t, self.last0, len(self.m.live)))
        for name in names:
            i = self.ids[name] = self.m.index[name]
            j = self.w[i] = _Worker(i, self.m.live[name], self.cluster.rng_of(i), state=_JOINING)
            j.lenders = [k for k in self.holders() if self.w[k].state == _RUNNING and k not in self.gone]
            self.training += 1
            self.ask(j, 0, self.t)

    def ask(self, j: _Worker, k: int, at: float) -> None:
        """The joiner's request for the state of its ``k``-th lender leaves at ``at``."""
        if k < len(j.lenders):
            self.push(at + self.costs(j, self.w[j.lenders[k]])[1], _JOIN, j.id, k)
        else:  # nobody lent: it starts from its own weights at step 0 (the runtime's fallback)
            self.push(at, _JOINED, j.id, 0)

    def join(self, j: _Worker, k: int) -> None:
        d = self.w[j.lenders[k]]
        T, T0 = self.costs(j, d)
        if d.state == _DEAD:  # (no answer: the next lender once the death is known)
            self.ask(j, k + 1, max(self.t, d.revoked_at + self.m.recovery.detect_s))
            return
        self.seq += 1
        hold = f"state:{d.id}:{self.seq}"
        if d.slot.prepare(hold, -1, self.t, math.inf) != "prepared":
            self.ask(j, k + 1, self.t + T0)
            return
        d.slot.abort(hold)  # (exported at once: the slot is given back before the reply)
        self.push(self.t + T, _JOINED, j.id, d.done)

    def joined(self, j: _Worker, at_step: int) -> None:
        j.state, j.done = _RUNNING, at_step
        self.members.add(j.id)
        self.membership_changed()
        self.open += 1
        self.compute(j)
