"""A simulated pipeline's costs (pure; ``sim/pipeline.py`` runs them): the runtime's split of the
profiled layers (``pipeline/fixed_split.fixed_stage_plan`` over the first instance's devices),
one instance's step -- the runtime's schedule replayed by ``pipeline/timeline.modelled_timeline``
with each stage's forward/backward per microbatch on its device and each boundary's transfer --
and the stages' all-reduce across instances."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.spec import DeviceSpec, LinkModel, PairLink
from flotilla.pipeline.fixed_split import fixed_stage_plan
from flotilla.pipeline.plan import PartitionOptions
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.schedule import ScheduleKind, make_schedule
from flotilla.pipeline.timeline import makespan_s, modelled_timeline
from flotilla.sim.model import SimCluster, SimDevice, SimJob

if TYPE_CHECKING:
    from flotilla.sim.pipeline import PipelineSpec

__all__ = ["STATE_COPIES", "StageCosts"]

_NO_MEMORY_LIMIT = 2**62  # (the simulator's devices carry no memory: every split fits)
STATE_COPIES = 3  # a newcomer stage receives its weights and its optimizer's state (Adam: 2 more)


class StageCosts:
    """The split, and an instance's step on given devices (cached: devices of one class, on the
    same kind of links, take the same time)."""

    def __init__(
        self, job: SimJob, cluster: SimCluster, spec: PipelineSpec, first: Sequence[SimDevice]
    ) -> None:
        assert job.profile is not None
        self.profile: ModelProfile = job.profile
        self.job, self.cluster, self.spec = job, cluster, spec
        kind = spec.kind
        self.micro = 1 if kind is ScheduleKind.PIPEDREAM else spec.num_microbatches
        options = PartitionOptions(
            schedule=kind, num_microbatches=self.micro, vertical_sync=spec.vertical_sync
        )
        specs = [
            DeviceSpec(name=d.name, type=d.type, node=d.node, speed=d.speed, memory_bytes=_NO_MEMORY_LIMIT)
            for d in first
        ]
        pairs = tuple(
            PairLink(a=a.name, b=b.name, bandwidth_gbps=link.bandwidth_gbps, latency_s=link.latency_s)
            for a, b in zip(first, first[1:], strict=False)
            for link in [cluster.link_among([a, b])]
        )
        plan = fixed_stage_plan(self.profile, specs, LinkModel(pairs=pairs), options)
        self.ends = tuple(stage.layer_end for stage in plan.stages)
        starts = (0, *self.ends[:-1])
        layers = self.profile.layers
        self.forward_s = [
            sum(l.forward_s for l in layers[j:k]) for j, k in zip(starts, self.ends, strict=True)
        ]
        self.backward_s = [
            sum(l.backward_s for l in layers[j:k]) for j, k in zip(starts, self.ends, strict=True)
        ]
        self.stage_bytes = [
            sum(l.param_bytes for l in layers[j:k]) for j, k in zip(starts, self.ends, strict=True)
        ]
        self.boundary_bytes = [layers[k - 1].activation_bytes for k in self.ends[:-1]]
        opt = job.optimizer_s or (0.0,) * len(layers)  # (the runtime stretches the update too)
        self.optimizer_s = [sum(opt[j:k]) for j, k in zip(starts, self.ends, strict=True)]
        self._cache: dict[tuple[Any, ...], float] = {}

    def instance_s(self, devices: Sequence[SimDevice], share: float) -> float:
        """One step of an instance on ``devices`` taking ``share`` samples of it."""
        key = (tuple((d.speed, d.node) for d in devices), share)
        if key not in self._cache:
            self._cache[key] = self._replay(devices, share)
        return self._cache[key]

    def actions_s(self, devices: Sequence[SimDevice], share: float) -> tuple[list[float], list[float]]:
        """Each stage's forward and backward of one microbatch on ``devices`` (an instance taking
        ``share`` samples of every batch)."""
        scale = share / self.profile.batch_size / self.micro  # (profiled per minibatch of batch_size)
        fwd = [f * scale / d.speed for f, d in zip(self.forward_s, devices, strict=True)]
        bwd = [b * scale / d.speed for b, d in zip(self.backward_s, devices, strict=True)]
        return fwd, bwd

    def parts(self, devices: Sequence[SimDevice], share: float) -> dict[str, float]:
        """Each stage's device time per step (``stageI.device_s``: its forward and backward of every
        microbatch) and the step (``step_s``) of an instance on ``devices``."""
        fwd, bwd = self.actions_s(devices, share)
        opt = [o / d.speed for o, d in zip(self.optimizer_s, devices, strict=True)]
        out = {
            f"stage{i}.device_s": (f + b) * self.micro + o for i, (f, b, o) in enumerate(zip(fwd, bwd, opt))
        }
        return out | {"step_s": self.instance_s(devices, share)}

    def _replay(self, devices: Sequence[SimDevice], share: float) -> float:
        scale = share / self.profile.batch_size / self.micro
        fwd, bwd = self.actions_s(devices, share)
        opt = [o / d.speed for o, d in zip(self.optimizer_s, devices, strict=True)]
        comm = [
            transfer_s(nbytes * scale, self.cluster.link_among([a, b]))
            for nbytes, a, b in zip(self.boundary_bytes, devices, devices[1:], strict=False)
        ]
        p, spec = len(devices), self.spec
        if spec.kind is not ScheduleKind.PIPEDREAM:
            schedule = make_schedule(spec.kind, p, self.micro)
            return makespan_s(modelled_timeline(schedule, fwd, bwd, comm, opt))
        k = 2 * p  # (steady state: the fill and drain cancel out of the difference)
        spans = [
            makespan_s(
                modelled_timeline(make_schedule(spec.kind, p, 1, n, spec.vertical_sync), fwd, bwd, comm, opt)
            )
            for n in (k, 2 * k)
        ]
        return (spans[1] - spans[0]) / k

    def allreduce_s(self, instances: Sequence[Sequence[SimDevice]]) -> float:
        """Each stage's gradients summed over the instances (all stages at once)."""
        r = len(instances)
        if r < 2:
            return 0.0
        return max(
            ring_allreduce_s(r, nbytes, self.cluster.link_among([inst[i] for inst in instances]))
            for i, nbytes in enumerate(self.stage_bytes)
        )
