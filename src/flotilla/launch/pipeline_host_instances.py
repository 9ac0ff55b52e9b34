"""A hosted pipeline job's live instances (``flotilla coordinator``, ``launch/pipeline_host.py``;
the rules are ``pipeline/replicas.py``'s, the stages' side ``roles/stage_replicas.py``).

- **Loss**: a stage process of an instance fails, dies or goes silent while another instance is
  whole: its instance is dropped -- its other stages told to stop, the survivors' next generation
  announced in the store (the survivors' stages re-form and train on).  With no whole instance
  left the job ends (the caller's :class:`FlotillaError`) -- unless the instances stand alone,
  their state held elsewhere, and come back (HetPipe's VWs: ``alone``): then a generation of
  none is announced and the job waits for their stages to be started again.
- **Return** (where the strategy lets a lost instance come back: ``sync/stage_plug.py``'s
  ``lost_instances_return``; HetPipe's VWs come back as new workers on their servers, each plan
  a new ``arrival``, never reused -- not by a plan voided and made again): nobody here can start
  a process on another host, so the lost instance's stage processes are given free at once
  (:meth:`StageHost.release`: a worker still holding one hears on its next beat why its instance
  was lost) and wait for ``flotilla worker --name ...``
  to take them -- by hand, or a scheduler replacing a lost machine.  Once every stage process of
  the instance is held again, the generation that will hold it is planned (:func:`joined`, under
  :func:`plan_key`) and the newcomers told (:meth:`StageHost.admit`); once each said it is ready,
  that generation is announced, the running instances move to it after an agreed step and send
  the newcomers the state -- as ``flotilla run`` brings an instance back
  (``launch/pipeline_instances.py``).  One instance comes back at a time; a newcomer that fails,
  dies or goes silent before its generation is announced frees its process again (its mates of
  an instance already planned are told to stop and must be started again: the plan is void), and
  a loss meanwhile voids the plan the same way.  An instance announced whose newcomers never
  received the state (the running instances finished first) is taken out again at the end
  (:meth:`drop_joining`), its newcomers told to stop.  There is no budget: every return is
  someone's deliberate start.

Each loss and each return is recorded for the summary (``instances_lost``, ``instances_back``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flotilla.comm.store import connect_store
from flotilla.core.log import get_logger
from flotilla.pipeline.replicas import (
    Generation,
    RegroupWatch,
    broken_key,
    generation_key,
    joined,
    joined_key,
    plan_key,
    ready_key,
    regroup_note,
    regrouped,
    survivors_after,
)
from flotilla.roles.stage_host import HostView, StageHost

__all__ = ["HostedInstances"]

log = get_logger("pipeline-host")


class HostedInstances:
    """The hosted job's live pipeline instances, their losses and returns (module doc)."""

    def __init__(
        self, host: StageHost, secret: bytes, timeout_s: float, *, bring_back: bool, alone: bool = False
    ) -> None:
        """``alone``: the instances stand alone, their state held elsewhere (hetpipe's VWs: the
        servers), and come back (``bring_back``): losing the last one leaves a generation of none,
        and the job waits for their stages to be started again."""
        self.host, self.secret, self.timeout_s, self.bring_back = host, secret, timeout_s, bring_back
        self.alone = alone and bring_back
        self.layout = host.job.layout
        self.generation = Generation(1, tuple(range(self.layout.num_instances)))
        self.lost: list[dict[str, Any]] = []
        self.returned: list[dict[str, Any]] = []
        self.regrouped: list[dict[str, Any]] = []  # (groups re-formed with nobody lost)
        self._regroups = RegroupWatch()  # (when a broken group re-forms: pipeline/replicas.py)
        self._serials = 0  # (generations stamped: pipeline/replicas.Generation.serial)
        # (told of each lost instance, and of a planned return voided: e.g. hetpipe's servers)
        self.on_lost: Callable[[int, int], None] | None = None  # (with its last return's arrival)
        self._waiting: list[int] = []  # lost instances whose stage processes newcomers may take
        self._coming: tuple[int, Generation] | None = None  # (planned: its newcomers getting ready)
        self._joining: tuple[int, Generation] | None = None  # (announced: its newcomers not all in yet)
        self._store: Any = None
        self.arrivals = 0  # (returns planned so far: each plan's serial, launch/pipeline_instances.Spawn)
        self._arrival_of: dict[int, int] = {}  # instance -> its last plan's arrival

    def processes(self) -> list[int]:
        """The stage processes of the live instances, the lead's first."""
        return [g for r in self.generation.instances for g in self.layout.processes(r)]

    def lose(self, g: int, line: str, reached_step: int) -> bool:
        """Stage process ``g`` of a live instance is lost (``line``): True when its instance was
        dropped and another trains on; False when no whole instance is left (the job ends)."""
        instance = self.layout.instance_of(g)
        nxt = survivors_after(self.generation, instance, alone=self.alone)
        if nxt is None:
            return False
        if nxt is self.generation:
            return True
        nxt = self._stamp(nxt)
        if self._coming is not None:
            self._void(f"pipeline instance {instance} was lost meanwhile")
        if self._joining is not None and self._joining[0] == instance:  # (it never got in)
            self._joining = None
            self.returned.pop()
        why = f"pipeline instance {instance} lost: {line}"
        procs = list(self.layout.processes(instance))
        self.host.stop_processes(procs, why)
        if self.on_lost is not None:
            self.on_lost(instance, self._arrival_of.get(instance, 0))
        self._client().set(generation_key(nxt.number), nxt.to_bytes())
        self.generation = nxt
        self.lost.append(
            {
                "instance": instance,
                "stage": self.host.job.stage_names[g],
                "reason": line,
                "reached_step": reached_step,
                "at": time.time(),
                "survivors": list(nxt.instances),
            }
        )
        on = f"instances {', '.join(map(str, nxt.instances))} train on" if nxt.instances else "none trains"
        log.warning("pipeline instance %d lost (%s); %s (generation %d)", instance, line, on, nxt.number)
        if self.bring_back:
            for p in procs:
                self.host.release(p, None, why)
            self._waiting.append(instance)
            log.warning(
                "pipeline instance %d comes back once its stages join again: flotilla worker --name %s",
                instance,
                " / ".join(self.host.job.stage_names[p] for p in procs),
            )
        return True

    def poll(self, view: HostView, reached_step: int) -> None:
        """The newcomers' side (module doc): free the process of one that failed, died or went
        silent; plan the next instance whose processes are all held; announce the planned one
        once its newcomers are ready; the same instances again once a group broke with nobody lost
        (:meth:`_regroup`)."""
        if self._regroup(reached_step) or not self.bring_back:
            return
        self._drop_broken(view)
        if self._coming is not None:
            instance, plan = self._coming
            keys = [ready_key(plan.number, p) for p in self.layout.processes(instance)]
            if not self._client().check(keys):
                return
            self._coming, self._joining = None, (instance, plan)
            self._client().set(generation_key(plan.number), plan.to_bytes())
            self.generation = plan
            back = {"instance": instance, "reached_step": reached_step, "at": time.time()}
            self.returned.append({**back, "instances": list(plan.instances)})
            log.warning(
                "pipeline instance %d is back: instances %s from generation %d (the job at step %d)",
                instance,
                ", ".join(map(str, plan.instances)),
                plan.number,
                reached_step,
            )
            return
        for instance in self._waiting:
            procs = list(self.layout.processes(instance))
            if all(p in view.claimed for p in procs):
                plan = self._stamp(joined(self.generation, instance))
                self._forget_ready(plan.number, procs)  # (a voided plan's newcomers may have said so)
                self._client().set(plan_key(plan.number), plan.to_bytes())
                self.arrivals += 1  # (a plan voided and made again: the same generation, a new arrival)
                self._arrival_of[instance] = self.arrivals
                self.host.admit(procs, plan.number, arrival=self.arrivals)
                self._waiting.remove(instance)
                self._coming = (instance, plan)
                log.info("pipeline instance %d: its stages joined (generation %d)", instance, plan.number)
                return

    def joining(self) -> list[int]:
        """The stage processes of the instance last announced back whose newcomers have not all
        received the state yet (read from the store: once in, they are members like any other)."""
        j = self._joining
        if j is None:
            return []
        procs = list(self.layout.processes(j[0]))
        if self._client().check([joined_key(j[1].number, p) for p in procs]):
            self._joining = None
            return []
        return procs

    def drop_joining(self) -> list[int]:
        """The job ended before the instance last announced back got in: it is out again (not a
        return); its stage processes (to be told to stop)."""
        j = self._joining
        if j is None:
            return []
        self._joining = None
        kept = tuple(i for i in self.generation.instances if i != j[0])
        self.generation = replace(self.generation, instances=kept)
        self.returned.pop()
        log.warning("pipeline instance %d: the job ended before its newcomers received the state", j[0])
        return list(self.layout.processes(j[0]))

    def newcomers(self) -> list[int]:
        """The stage processes held by newcomers not in the job yet (told to stop at its end)."""
        waiting = [*self._waiting, *([self._coming[0]] if self._coming is not None else [])]
        return [p for r in waiting for p in self.layout.processes(r)]

    def note(self) -> str | None:
        """What a completed run went through (None: nothing lost)."""
        if not self.lost:
            return None
        which = ", ".join(f"instance {e['instance']} ({e['stage']}: {e['reason']})" for e in self.lost)
        back = self.returned
        tail = f"; back: instance(s) {', '.join(str(e['instance']) for e in back)}" if back else ""
        return f"lost pipeline {which}{tail}"

    def _drop_broken(self, view: HostView) -> None:
        for instance in [*self._waiting, *([self._coming[0]] if self._coming is not None else [])]:
            for p in self.layout.processes(instance):
                if p not in view.claimed or not (p in view.dead or p in view.silent or p in view.failures):
                    continue
                why = (
                    view.failures[p][1]
                    if p in view.failures
                    else ("its process is gone" if p in view.dead else "it went silent")
                )
                what = self.host.describe(p)
                if self._coming is not None and self._coming[0] == instance:
                    self._void(f"its newcomer {what} failed before it was in: {why}")
                    return
                self.host.release(p, None, f"{what} is free again: {why}")
                log.warning("newcomer %s, before its instance came back: %s; free again", what, why)

    def _regroup(self, reached_step: int) -> bool:
        """As ``launch/pipeline_instances.InstanceWatch._regroup``: a stage said its group broke
        in the current generation and no loss came within the grace: the same instances are
        announced as the next generation (a planned return is voided first); True if done."""
        if self.layout.num_instances < 2 or self._joining is not None:
            return False
        number = self.generation.number
        broken = self._client().check([broken_key(number)])
        if not self._regroups.due(number, broken, time.monotonic()):
            return False
        if self._coming is not None:
            instance, plan = self._coming
            ready = [ready_key(plan.number, p) for p in self.layout.processes(instance)]
            if self._client().check(ready):  # (its announcement re-forms everyone, the survivors too)
                return False
            self._void("a group broke with every instance alive: the instances re-form first")
        nxt = self._stamp(regrouped(self.generation))
        self._client().set(generation_key(nxt.number), nxt.to_bytes())
        self.generation = nxt
        self.regrouped.append({"generation": nxt.number, "reached_step": reached_step, "at": time.time()})
        log.warning("%s", regroup_note(number, reached_step, nxt))
        return True

    def _void(self, why: str) -> None:
        """The planned instance does not come back for now: its newcomers are told to stop (they
        must be started again) and its processes are free again."""
        assert self._coming is not None
        instance, plan = self._coming
        self._coming = None
        procs = list(self.layout.processes(instance))
        line = f"pipeline instance {instance} is not coming back for now ({why}): start its stages again"
        for p in procs:
            self.host.release(p, None, line)
        self._forget_ready(plan.number, procs)
        self._waiting.insert(0, instance)
        if self.on_lost is not None:  # (what its newcomers took, e.g. a hetpipe VW's new worker id)
            self.on_lost(instance, self._arrival_of.get(instance, 0))
        log.warning("%s", line)

    def _stamp(self, gen: Generation) -> Generation:
        """``gen`` with the next serial (its groups' namespaces: never reused)."""
        self._serials += 1
        return replace(gen, serial=self._serials)

    def _forget_ready(self, number: int, procs: list[int]) -> None:
        for p in procs:
            self._client().delete_key(ready_key(number, p))

    def _client(self) -> Any:
        if self._store is None:
            self._store = connect_store(self.host.store_address, self.timeout_s, secret=self.secret)
        return self._store
