"""Pipelines in virtual time (``strategy: {kind: pipeline}``; ``docs/simulator.md``).

The code the runtime runs, with modelled times:

- **the split**: ``pipeline/fixed_split.fixed_stage_plan`` -- the runtime's own (stage i on
  ``cluster.workers[i]``) -- over the first instance's devices, with the job's layer profile
  (``SimJob.profile``, measured by ``flotilla simulate`` as ``flotilla plan`` measures it); every
  instance keeps that split, as the runtime's instances do;
- **the schedule**: ``pipeline/schedule.make_schedule`` (GPipe, 1F1B, PipeDream with or without
  vertical sync), replayed by ``pipeline/timeline.modelled_timeline`` with each stage's forward
  and backward per microbatch on its device and each boundary's transfer over its link
  (``cluster/comm_cost.transfer_s``).

A step is one minibatch of ``SimJob.global_batch`` samples:

- the live devices form **instances** of ``num_stages`` devices, in order (instance r's stage i is
  the (r * num_stages + i)-th device, as ``cluster.workers`` places them), at most
  ``global_batch // num_microbatches`` of them (the runtime's rule: an instance's share of every
  batch fills its microbatches); devices left over are held (and paid for) as spares; each
  instance takes ``global_batch / R`` samples of every step;
- an instance's step (GPipe, 1F1B) is the makespan of one flush of its schedule: ``M``
  microbatches; each stage's per-microbatch compute is its layers' profiled time scaled by the
  instance's share of the batch and divided by the device's speed.  PipeDream has no flush and
  runs as one instance (the runtime's rule): a step is its steady-state time per minibatch
  (the makespan of ``2K`` minibatches minus that of ``K``, over ``K``, with ``K = 2 num_stages``);
- with ``R > 1`` instances each stage then all-reduces its gradients with the same stage of the
  others (a ring over R, the slowest link among them; all stages at once): the step is the
  slowest instance's plus the slowest stage's all-reduce;
- transient slowdowns: an instance's step is scaled by the largest factor its devices draw that
  step (an upper bound: the exact replay needs one timeline per instance per step).

Revocations: a device of an instance revoked during a step breaks the step everywhere (the
all-reduce of the flush fails); the survivors notice ``detect_s`` later.  If a whole instance
survives, the job goes on with the instances left after ``repair_s`` and redoes the step; the
broken instance's surviving devices become spares once new stage processes started on them
(``startup_s``: the runtime's launcher kills the broken instance's other stages and starts new
ones).  A spare's revocation breaks nothing (and is no recovery).  If none does, the job restarts from its
newest checkpoint (the runtime's launcher restarts every stage): the steps since it are redone,
once ``num_stages`` devices are live, ``startup_s`` after the restart began or the last of them
arrived.  Arrivals are ready ``startup_s`` after they arrive; at a step boundary, spares and ready
arrivals form new instances, ``num_stages`` at a time, for ``repair_s`` plus sending each new
stage its stage's weights and optimizer state.

Not modelled: overlap of a flush's all-reduce with the next minibatch, the memory check
(``SimDevice`` has no memory: the split minimises time only), stage replicas within an instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flotilla.cluster.comm_cost import transfer_s
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimJob, SimResult, layers_of
from flotilla.sim.pipeline_costs import STATE_COPIES, StageCosts

__all__ = ["PipelineSpec", "pipeline_of", "simulate_pipeline"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSpec:
    """``strategy: {kind: pipeline}``'s shape: ``schedule`` (gpipe, 1f1b, pipedream),
    ``num_stages``, ``num_microbatches`` (flushing schedules), ``vertical_sync`` (PipeDream)."""

    name: str = "pipeline"
    schedule: str = "1f1b"
    num_stages: int = 2
    num_microbatches: int = 8
    vertical_sync: bool = False

    def __post_init__(self) -> None:
        kinds = [k.value for k in ScheduleKind]
        if self.schedule not in kinds:
            raise ValueError(
                f"PipelineSpec.schedule must be one of {', '.join(kinds)}, got {self.schedule!r}"
            )
        for name in ("num_stages", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PipelineSpec.{name} must be an integer >= 1, got {value!r}")

    @property
    def kind(self) -> ScheduleKind:
        return ScheduleKind(self.schedule)

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        return simulate_pipeline(job, cluster, self, changes=changes, recovery=recovery)


def pipeline_of(settings: Any) -> PipelineSpec:
    """``strategy: {kind: pipeline, ...}`` (``StrategySpec.simulated``; the settings read by name)."""
    return PipelineSpec(
        schedule=str(settings.schedule),
        num_stages=int(settings.num_stages),
        num_microbatches=int(settings.num_microbatches),
        vertical_sync=bool(getattr(settings, "vertical_sync", False)),
    )


class _Run:
    def __init__(self, job: SimJob, cluster: SimCluster, spec: PipelineSpec, members: Members) -> None:
        self.job, self.cluster, self.spec, self.m = job, cluster, spec, members
        # the runtime's rules: PipeDream runs one instance; a flushing schedule's instance needs
        # a sample per microbatch of its share of every batch (the devices beyond are spares)
        flushes = spec.kind is not ScheduleKind.PIPEDREAM
        self.max_instances = max(1, job.global_batch // spec.num_microbatches) if flushes else 1
        first = list(members.live.values())[: spec.num_stages]
        self.costs = StageCosts(job, cluster, spec, first)
        self.rngs = {n: cluster.rng_of(i) for n, i in members.index.items()}
        self.t, self.step, self.checkpointed, self.events = 0.0, 0, 0, 0
        self.instances: list[tuple[SimDevice, ...]] = []
        self.samples, self.restarts = 0, 0
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self._unrecovered: list[float] = []
        self._restarting: dict[str, float] = {}  # a broken instance's survivor -> its new process is ready
        self.note = ""

    def used(self) -> set[str]:
        return {d.name for inst in self.instances for d in inst}

    def form(self, *, joining: bool) -> None:
        """Spares and ready arrivals form new instances, ``num_stages`` at a time."""
        s = self.spec.num_stages
        self.m.admit(self.m.ready(self.t))
        spares = self.spares()
        new: list[tuple[SimDevice, ...]] = []
        while len(spares) >= s and len(self.instances) + len(new) < self.max_instances:
            new.append(tuple(spares[:s]))
            spares = spares[s:]
        if not new:
            return
        self.instances += new
        if joining:  # (re-forming: the newcomers receive their stage's state)
            link = self.cluster.link_among([d for inst in self.instances for d in inst])
            self.t += self.m.recovery.repair_s + max(
                transfer_s(STATE_COPIES * nbytes, link) for nbytes in self.costs.stage_bytes
            )

    def spares(self) -> list[SimDevice]:
        """Live devices in no instance whose stage process is up (a broken instance's survivors
        get new ones: ``startup_s`` after the break, as the runtime's launcher starts them)."""
        used = self.used()
        return [d for n, d in self.m.live.items() if n not in used and self._restarting.get(n, 0.0) <= self.t]

    def drop_broken(self, at: float) -> None:
        """Instances that lost a device are gone; their other devices restart their processes."""
        keep = []
        for inst in self.instances:
            if all(d.name in self.m.live for d in inst):
                keep.append(inst)
            else:
                for d in inst:
                    if d.name in self.m.live:
                        self._restarting[d.name] = at + self.m.recovery.startup_s
        self.instances = keep

    def step_s(self) -> float:
        r = len(self.instances)
        share = self.job.global_batch / r
        slowest = 0.0
        for inst in self.instances:
            base = self.costs.instance_s(inst, share)
            if self.cluster.slowdown is not None:
                base *= max(self.cluster.slowdown.draw(self._rng(d.name)) for d in inst)
            slowest = max(slowest, base)
        return slowest + self.costs.allreduce_s(self.instances)

    def _rng(self, name: str) -> Any:
        if name not in self.rngs:
            self.rngs[name] = self.cluster.rng_of(self.m.index[name])
        return self.rngs[name]

    def run(self) -> bool:
        """Until the job's steps are done (True) or nothing can run any more (False)."""
        job, rec = self.job, self.m.recovery
        self.form(joining=False)
        while self.step < job.steps:
            self.events += 1
            self.m.advance(self.t)
            self.drop_broken(self.t)
            if not self.instances:
                if not self._restart():
                    return False
                continue
            if self.m.ready(self.t) or len(self.spares()) >= self.spec.num_stages:
                self.form(joining=True)
            end = self.t + self.step_s()
            kill = self._next_kill(end)
            if kill is not None:  # a stage's device revoked during the step: it breaks
                self.m.advance(kill.at_s)
                self._unrecovered.append(kill.since_s)
                self.t = max(self.t, kill.at_s) + rec.detect_s
                self.drop_broken(kill.at_s)
                if self.instances:
                    self.t += rec.repair_s
                continue
            self.t = end
            self.step += 1
            self.samples += job.global_batch
            self.timeline.append((self.t, self.step, len(self.m.live)))
            self.recoveries += [self.t - at for at in self._unrecovered]
            self._unrecovered = []
            if job.checkpoint_every_steps and self.step % job.checkpoint_every_steps == 0:
                self.t += job.checkpoint_s
                self.checkpointed = self.step
            if job.eval_every_steps and self.step % job.eval_every_steps == 0:
                self.t += job.eval_s
        return True

    def _next_kill(self, until: float) -> Change | None:
        """The next revocation of a device in an instance before ``until`` (a spare's is applied
        on the way: it breaks nothing)."""
        used = self.used()
        while True:
            kill = self.m.next_kill(until)
            if kill is None or kill.name in used:
                return kill
            self.m.advance(kill.at_s)

    def _restart(self) -> bool:
        """No whole instance is left: the job restarts from its newest checkpoint."""
        s, rec = self.spec.num_stages, self.m.recovery
        began = self.t
        while len(self.m.live) + len(self.m.ready(self.t)) < s:  # (wait for enough devices)
            nxt = [
                x for x in (self.m.next_ready_at(), self.m.next_change_at()) if x is not None and x > self.t
            ]
            if not nxt:
                self.note = f"fewer than {s} devices left for a pipeline of {s} stages, and none arriving"
                return False
            self.t = min(nxt)
            self.m.advance(self.t)
        self.t = max(self.t, began + rec.startup_s)
        self._restarting.clear()  # (every stage process restarted: the restart's start-up)
        self.form(joining=False)
        if self.step > self.checkpointed:
            self.note = "restarted from a checkpoint (its later steps redone)"
        self.step = self.checkpointed
        self.restarts += 1
        return True


def simulate_pipeline(
    job: SimJob,
    cluster: SimCluster,
    spec: PipelineSpec = PipelineSpec(),
    *,
    changes: tuple[Change, ...] | list[Change] = (),
    recovery: Recovery = Recovery(),
) -> SimResult:
    """Simulate ``job`` as a pipeline (see the module doc)."""
    profile = layers_of(job, "a pipeline")
    if spec.num_stages > profile.num_layers:
        raise ValueError(
            f"PipelineSpec.num_stages: {spec.num_stages} stages for a model of {profile.num_layers} layers"
        )
    members = Members(cluster, changes, recovery)
    if len(members.live) < spec.num_stages:
        raise ValueError(
            f"the cluster has {len(members.live)} device(s); a pipeline of {spec.num_stages} stages needs "
            f"at least {spec.num_stages}"
        )
    run = _Run(job, cluster, spec, members)
    completed = run.run()
    members.close(run.t)
    instances = f"{len(run.instances)} instance(s) of {spec.num_stages} stages at the end"
    note = "; ".join(x for x in (instances, run.note) if x)
    return SimResult(
        strategy=f"{spec.name} ({spec.schedule})",
        steps=run.step,
        time_s=run.t,
        completed=completed,
        device_s=members.device_s,
        cost=members.cost,
        samples=run.samples,
        timeline=run.timeline,
        recoveries_s=run.recoveries,
        events=run.events,
        note=note,
        parts=run.costs.parts(run.instances[0], job.global_batch / len(run.instances))
        if run.instances
        else {},
    )
