"""The launcher's side of losing a pipeline instance and bringing it back (``strategy.replicas``
> 1; the rules are ``pipeline/replicas.py``'s, the stages' side ``roles/stage_replicas.py``):

- when a stage process exits with an error while another instance is whole, the other stages of
  its instance are killed and the next generation of survivors is announced in the attempt's
  rendezvous store (signed with the cluster secret, as every value there); the survivors re-form
  and train on, no restart;
- then, while the replacement budget lasts (``job.max_restarts``, shared by every instance of
  the attempt; what each return takes, and which are free: ``launch/pipeline_returns.py``), the
  lost instance comes back: new stage processes
  are started for it with the plan of the generation that will hold it; once every one of them
  said it is ready, that generation is announced and the running instances move to it after an
  agreed step.  One
  instance comes back at a time; a loss while one is coming back cancels it (its newcomers are
  killed) and it is tried again after.  Instances that stand alone (``sync/stage_plug.py``:
  ``independent_instances``, e.g. hetpipe's VWs) come back only where their plug says so
  (``instances_return``): nobody moves, each newcomer says it is ready and in at once after its
  strategy side attached; ``on_lost`` is told of newcomers given up too (what they took, e.g.
  a VW's new worker id on the servers, is released).  Their state is held elsewhere (``alone``),
  so losing the last of them while a return is possible leaves a generation of none: the
  attempt waits for the returns (a return being planned when another instance is lost is
  tried again first, its budget kept).

Where the strategy forms a lost instance again on other devices (``reshape``,
``launch/pipeline_reform.py``), that is decided just before its newcomers would start: it comes
back on new stage processes (the names and layout grow; its old processes retired), or waits;
such a return is free.

A group that breaks with every stage process alive (the network reset a connection): a stage
that finds no new generation says so in the store (``pipeline/replicas.broken_key``); once no
loss came within ``REGROUP_GRACE_S``, the same instances are announced as the next generation and
every stage re-forms as after a loss (:meth:`InstanceWatch._regroup`; a return being planned is
cancelled and tried again after, its budget kept).

Each loss, each return and each regroup is recorded (which stage, its exit code, the step the
job had reached, when, the instances after) for the summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field, replace
from typing import Any

from flotilla.comm.store import StoreAddress, connect_store
from flotilla.core.log import get_logger
from flotilla.launch.pipeline_instance_log import InstanceLog
from flotilla.launch.pipeline_reform import DeviceFeed, Reshape, may_come_back
from flotilla.launch.pipeline_returns import Returns
from flotilla.launch.supervisor import Child, Supervisor, kill_all
from flotilla.pipeline.layout import Layout
from flotilla.pipeline.replicas import (
    Generation,
    RegroupWatch,
    broken_key,
    generation_key,
    joined,
    joined_key,
    lead_of,
    plan_key,
    ready_key,
    regroup_note,
    regrouped,
    survivors_after,
)

__all__ = ["InstanceWatch"]

log = get_logger("pipeline-job")

Spawn = Callable[[int, int, int], Child]
"""``(stage process, generation it joins, arrival) -> the started newcomer``; ``arrival``: the
round's serial in the job (1, 2, ...; never reused: a round cancelled and tried again joins the
same generation as a new arrival, so what its newcomers take -- e.g. a hetpipe VW's worker id on
the servers, released when it was given up -- is not taken twice)."""


@dataclass
class _Coming:
    """An instance coming back: the generation that will hold it and its newcomers."""

    instance: int
    plan: Generation
    children: list[Child]
    arrival: int
    free: bool = False  # (its return takes none of the budget: nobody failed)
    reformed: bool = False  # (formed again on other devices: free too)


@dataclass
class InstanceWatch:
    """The live instances of one attempt, the losses and the returns (module doc)."""

    names: list[str]  # one per stage process, in order
    layout: Layout  # where each stage process sits (pipeline/layout.py)
    store: StoreAddress | None = None
    secret: bytes | None = None
    timeout_s: float = 30.0
    history: InstanceLog = field(default_factory=InstanceLog)  # (the caller's: every attempt's)
    spawn: Spawn | None = None  # (None: a lost instance does not come back)
    # (told of each lost instance, and of newcomers given up, with the instance's last arrival
    # -- 0: it never came back --: e.g. hetpipe's servers bar that return's worker id)
    on_lost: Callable[[int, int], None] | None = None
    budget: InitVar[int] = 0  # returns that may take from job.max_restarts (what is left: returns.budget)
    # (the instances stand alone, their state held elsewhere -- hetpipe's VWs, the servers: with
    # every one lost while one can come back, the job waits for it -- a generation of none)
    alone: bool = False
    reshape: Reshape | None = None  # (a lost instance may come back on other processes: pipeline_reform)
    devices: DeviceFeed | None = None  # (devices added mid-run, for it: pipeline_reform)
    # (lost instance -> the stage process whose own failure lost it; None: nobody's)
    lost_by: dict[int, str | None] = field(default_factory=dict)
    unable: dict[int, str] = field(default_factory=dict)  # (lost instance -> why it cannot come back yet)
    generation: Generation = field(init=False)
    _waiting: list[int] = field(default_factory=list)  # lost instances to bring back, in order
    _coming: _Coming | None = None
    _joining: _Coming | None = None  # (announced, its newcomers not all in yet)
    _retired: list[Child] = field(default_factory=list)
    _arrival_of: dict[int, int] = field(default_factory=dict)  # instance -> its last return's arrival
    _regroups: RegroupWatch = field(default_factory=RegroupWatch)  # (when a broken group re-forms)
    _serials: int = 0  # (generations stamped in this attempt: pipeline/replicas.Generation.serial)
    _client: Any = None
    returns: Returns = field(init=False)  # (what each return takes: launch/pipeline_returns.py)

    def __post_init__(self, budget: int) -> None:
        self.generation = Generation(1, tuple(range(self.layout.num_instances)))
        self.returns = Returns(budget, self.history, reforming=self.reshape is not None)

    @property
    def lead(self) -> int:
        return lead_of(self.generation)

    def out(self, child: Child) -> bool:
        """Whether ``child``'s exit changes nothing: a process of an instance already lost."""
        return any(child is c for c in self._retired)

    def handles(
        self, sup: Supervisor, child: Child, reached_step: int, *, nobody_failed: bool = False
    ) -> bool:
        """``child`` (a stage process) failed: True if that is taken care of here (its instance
        was out already, its instance is dropped while another is whole, or it was a newcomer
        not yet in); False when no whole instance is left (the caller's failure path: a
        restart from the checkpoint).  ``nobody_failed``: it exited because its group broke and
        no stage of its instance failed first (the network broke the group, or a stage froze):
        the instance's return does not take one of the budget (up to ``FREE_RETURNS``)."""
        if self.out(child):
            return True
        coming = self._coming
        if coming is not None and any(child is c for c in coming.children):
            if not nobody_failed:  # (its own failure: a re-forming strategy counts its device gone)
                self.lost_by[coming.instance] = child.name
            self._cancel(sup, f"newcomer {child.name} exited with code {child.returncode}")
            self._next(sup)
            # (no instance trains and none can come back now: the caller's failure path)
            return self.goes_on()
        return self._lose(sup, child, reached_step, free=nobody_failed)

    def _may_return(self, free: bool | None = None) -> bool:
        """Whether a lost instance can come back now (a return being planned included: it is
        tried again, its budget kept), ``free``: the one just lost was lost by nobody's fault."""
        if self.spawn is None:
            return False
        return self._coming is not None or self.returns.any_able(self._waiting, self.lost_by, just_lost=free)

    def _lose(self, sup: Supervisor, child: Child, reached_step: int, *, free: bool = False) -> bool:
        index = self.names.index(child.name)
        if not self.layout.current(index):  # (its instance was formed again on new processes)
            self._retired.append(child)
            return True
        instance = self.layout.instance_of(index)
        nxt = survivors_after(self.generation, instance, alone=self.alone and self._may_return(free))
        if nxt is None:
            return False
        if nxt is self.generation:  # (its instance was out already)
            self._retired.append(child)
            return True
        nxt = self._stamp(nxt)
        if self._coming is not None:  # (not the newcomers' fault: their return is not spent)
            self._cancel(sup, f"pipeline instance {instance} was lost meanwhile", refund=True)
        if self._joining is not None and self._joining.instance == instance:  # (it never got in)
            self._joining = None
            self.history.returned.pop()
        mates = [
            c for c in sup.alive("stage") if self.layout.instance_of(self.names.index(c.name)) == instance
        ]
        self._retired += [child, *mates]
        kill_all(mates, grace_s=0.0)
        self._announce(generation_key(nxt.number), nxt)
        if self.on_lost is not None:
            self.on_lost(instance, self._arrival_of.get(instance, 0))
        self.history.note_lost(instance, child.name, child.returncode, reached_step, nxt, free=free)
        self._waiting.append(instance)
        self.lost_by[instance] = None if free else child.name
        self.returns.lost(instance, nobody_failed=free)
        self._next(sup)
        # (none trains and none is coming back -- cannot happen by _may_return: the failure path)
        return self.goes_on()

    def goes_on(self) -> bool:
        """Whether the attempt goes on: an instance trains or comes back, or every one is lost and
        one waits for devices still to be added (``devices``: a revocation schedule's)."""
        if self.generation.instances or self._coming is not None:
            return True
        waits = bool(self._waiting) and self._may_return()
        return waits and self.devices is not None and self.devices.pending()

    def _next(self, sup: Supervisor) -> None:
        """Start bringing back the next lost instance whose return the budget allows (one lost by
        nobody's fault may come back free: it goes first when the budget is spent)."""
        if self._coming is not None or self.spawn is None:
            return
        self._waiting = [i for i in self._waiting if i not in self.generation.instances]
        instance, reformed = None, False
        for i in (i for i in self._waiting if self.returns.able(i, self.lost_by)):
            processes = len(self.names)
            if may_come_back(self, i):
                # (formed again: new processes; a retry of one given up takes the same, free too)
                reformed = len(self.names) > processes or i in self.returns.reformed
                instance = i
                break
        if instance is None:
            return
        self._waiting.remove(instance)
        free = self.returns.pay(instance, reformed=reformed)
        plan = self._stamp(joined(self.generation, instance))
        self._announce(plan_key(plan.number), plan, current=False)
        self.history.arrivals += 1
        arrival = self._arrival_of[instance] = self.history.arrivals
        children = [self.spawn(g, plan.number, arrival) for g in self.layout.processes(instance)]
        self._coming = _Coming(instance, plan, children, arrival, free, reformed)
        log.info(
            "pipeline instance %d: new stage processes started (to join generation %d, arrival %d)",
            instance,
            plan.number,
            arrival,
        )

    def _cancel(self, sup: Supervisor, why: str, *, refund: bool = False) -> None:
        """Give up the return being planned (``refund``: not by its newcomers' fault, so what it
        took -- the budget, or a free return -- is given back for its next try)."""
        coming = self._coming
        assert coming is not None
        self._coming = None
        if refund or coming.reformed:  # (a re-form's return stays free, whoever failed)
            self.returns.refund(coming.instance, free=coming.free, reformed=coming.reformed)
        self._retired += coming.children
        kill_all([c for c in coming.children if c.proc.poll() is None], grace_s=0.0)
        for g in self.layout.processes(coming.instance):  # (the next plan may take the same number)
            self._store().delete_key(ready_key(coming.plan.number, g))
        self._waiting.insert(0, coming.instance)
        if self.on_lost is not None:  # (what its newcomers took, e.g. a hetpipe VW's new worker id)
            self.on_lost(coming.instance, coming.arrival)
        log.warning("pipeline instance %d is not coming back for now: %s", coming.instance, why)

    def poll(self, sup: Supervisor, reached_step: int) -> None:
        """Announce the same instances again once a group broke with nobody lost
        (:meth:`_regroup`); the generation of the instance coming back once all its newcomers
        are ready."""
        if self._regroup(sup, reached_step):
            return
        if self.devices is not None and self.devices.arrivals():  # (a waiting instance may form now)
            self._next(sup)
        coming = self._coming
        if coming is None:
            return
        keys = [ready_key(coming.plan.number, g) for g in self.layout.processes(coming.instance)]
        if not self._store().check(keys):
            return
        self._coming, self._joining = None, coming
        self._announce(generation_key(coming.plan.number), coming.plan)
        self.history.returned.append(
            {
                "instance": coming.instance,
                "reached_step": reached_step,
                "at": time.time(),
                "instances": list(coming.plan.instances),
            }
        )
        log.warning(
            "pipeline instance %d is back: instances %s from generation %d (the job at step %d)",
            coming.instance,
            ", ".join(map(str, coming.plan.instances)),
            coming.plan.number,
            reached_step,
        )
        self._next(sup)

    def _regroup(self, sup: Supervisor, reached_step: int) -> bool:
        """A stage said its group broke in the current generation and no loss came within the
        grace (``pipeline/replicas.RegroupWatch``): announce the same instances as the next
        generation (a return being planned is cancelled, tried again after); True if done."""
        if self.layout.num_instances < 2 or self._joining is not None:
            return False
        number = self.generation.number
        broken = self._store().check([broken_key(number)])
        if not self._regroups.due(number, broken, time.monotonic()):
            return False
        coming = self._coming
        if coming is not None:
            ready = [ready_key(coming.plan.number, g) for g in self.layout.processes(coming.instance)]
            if self._store().check(ready):  # (its announcement re-forms everyone, the survivors too)
                return False
            why = "a group broke with every instance alive: the instances re-form first"
            self._cancel(sup, why, refund=True)  # (not the newcomers' fault: their return is not spent)
        nxt = self._stamp(regrouped(self.generation))
        self._announce(generation_key(nxt.number), nxt)
        self.history.regrouped.append(
            {"generation": nxt.number, "reached_step": reached_step, "at": time.time()}
        )
        log.warning("%s", regroup_note(number, reached_step, nxt))
        self._next(sup)
        return True

    def trains(self) -> bool:
        """Whether an instance of the generation trains that is not the one last announced back
        (whose newcomers may not be in yet): False only with every instance lost, their state
        held elsewhere (:attr:`alone`), while they come back."""
        joining = self._joining.instance if self._joining is not None else None
        return any(i != joining for i in self.generation.instances)

    def waiting_newcomers(self) -> list[Child]:
        """The newcomers still alive that are not in the job yet: those of an instance coming back,
        and those of the last announced return that have not received the state."""
        out = list(self._coming.children) if self._coming is not None else []
        j = self._joining
        if j is not None:
            keys = [joined_key(j.plan.number, g) for g in self.layout.processes(j.instance)]
            if self._store().check(keys):
                self._joining = None
            else:
                out += j.children
        return [c for c in out if c.proc.poll() is None]

    def drop_waiting(self) -> None:
        """The job ended before they were in: kill the waiting newcomers (their exit changes nothing)."""
        waiting = self.waiting_newcomers()
        if waiting:
            self._retired += waiting
            kill_all(waiting, grace_s=0.0)
            log.info("the job ended before %s joined: stopped", ", ".join(c.name for c in waiting))
        j = self._joining
        if j is not None:  # (announced, never in: the job ended without it)
            kept = tuple(i for i in self.generation.instances if i != j.instance)
            self.generation = replace(self.generation, instances=kept)
            self.history.returned.pop()
        self._coming = self._joining = None

    def _stamp(self, gen: Generation) -> Generation:
        """``gen`` with the next serial of this attempt (its groups' namespaces: never reused)."""
        self._serials += 1
        return replace(gen, serial=self._serials)

    def _store(self) -> Any:
        if self.store is None:
            raise RuntimeError("InstanceWatch: no store to announce generations in")
        if self._client is None:
            self._client = connect_store(self.store, self.timeout_s, secret=self.secret)
        return self._client

    def _announce(self, key: str, gen: Generation, *, current: bool = True) -> None:
        self._store().set(key, gen.to_bytes())
        if current:
            self.generation = gen
