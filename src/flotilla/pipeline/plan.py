"""Pipeline plans and the cost model the partitioner optimises (pure; SPEC §3.2, §2).

Inputs: a ``ModelProfile`` (times for one minibatch on a speed-1.0 device) and the cluster: the
``DeviceSpec``s and ``LinkModel`` of a ``flotilla.cluster.spec.ClusterSpec``.  A plan cuts the
layers into contiguous stages and gives each stage a non-empty set of devices (more than one = a
replicated, data-parallel stage).  Per stage s = [j, k) on devices G
(r = |G|), with P = param bytes and A = activation bytes of the stage:

- ``compute_s``  = sum(forward+backward of layers j..k-1) / (r * min speed in G) + ``allreduce_s``
  (replicas split every minibatch evenly, so the slowest replica sets the pace);
- ``allreduce_s`` = ring all-reduce of the stage's weights once per minibatch, 0 when r = 1:
  2(r-1)/r * P / bw + 2(r-1) * lat, over the slowest link inside G;
- ``comm_s``     = activations of layer k-1 forward plus their gradients backward over the slowest
  link between G and the next stage's devices: 2 * (lat + bytes / bw); 0 for the last stage;
- ``stage_s``    = max(compute_s, comm_s) if ``overlap_comm`` (PipeDream's assumption: transfers
  run beside compute) else compute_s + comm_s.

The partitioner minimises the bottleneck max(stage_s); ties are broken towards a smaller sum of
stage_s.  Memory per device of a stage (``memory_bytes``), for stage i of p (s = p - i stages from
it to the end, m microbatches):
``P * (optimizer_multiplier + versions - 1) + A * in_flight / r`` where A is what the stage holds
from a minibatch's forward until its backward (``ModelProfile.held_bytes``: its input, what its
layers save for the backward as the profiler measured it, its output), versions = 1 for flush
schedules, s for PipeDream (weight stashing)
and p with vertical sync, and in_flight (in minibatches) = 1 for GPipe, min(s, m)/m for 1F1B,
s for PipeDream (at a depth of N minibatches, ``PartitionOptions.in_flight``: max(1, N - i) for
stage i, weight versions likewise).  A plan is feasible when that fits in every device of every stage.

``predicted_step_s``: PipeDream's steady state is one minibatch per bottleneck time; flush schedules
take (sum(stage_s) + (m-1) * bottleneck) / m per minibatch (fill and drain included, each stage's
time split evenly over microbatches).  Throughput = batch_size / predicted_step_s samples/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flotilla.cluster.comm_cost import BYTES_PER_S_PER_GBPS, ring_allreduce_s, transfer_s
from flotilla.cluster.spec import ClusterSpec, DeviceSpec, Link, LinkModel, PairLink
from flotilla.core.errors import ConfigError
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.schedule import ScheduleKind

__all__ = [
    "BYTES_PER_S_PER_GBPS",
    "ClusterSpec",
    "CostModel",
    "DeviceSpec",
    "LinkModel",
    "PairLink",
    "PartitionOptions",
    "PipelinePlan",
    "PlanError",
    "StagePlan",
    "cluster_parts",
    "evaluate_plan",
    "format_bytes",
    "memory_shortfalls",
]

# DeviceSpec, PairLink and LinkModel live in flotilla.cluster.spec (the one cluster description);
# they are re-exported here for the callers that still import them from the pipeline package.
# The communication formulas are flotilla.cluster.comm_cost's (the simulator's too).


class PlanError(ConfigError):
    """No plan satisfies the constraints (memory, device count); the message says why."""


Devices = Sequence[DeviceSpec] | ClusterSpec
"""What the planners accept: a ``ClusterSpec`` (devices and links together), or devices with the
links passed separately."""


def cluster_parts(devices: Devices, links: LinkModel | None) -> tuple[Sequence[DeviceSpec], LinkModel]:
    """``(devices, links)`` of a ``ClusterSpec`` or of separate arguments (default links when
    omitted).  Passing both a ``ClusterSpec`` and ``links`` is refused: the spec holds its links."""
    if isinstance(devices, ClusterSpec):
        if links is not None:
            raise ConfigError("links must be None when a ClusterSpec is given (the spec holds its links)")
        return devices.devices, devices.links
    return devices, links if links is not None else LinkModel()


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionOptions:
    """Knobs of the partitioner.  ``optimizer_multiplier``: bytes kept per parameter byte for the
    newest version (weights + gradient + optimizer state; 3.0 = SGD with momentum, 4.0 = Adam).
    ``max_search_work`` bounds the dynamic program (see ``partition``)."""

    schedule: ScheduleKind = ScheduleKind.PIPEDREAM
    num_microbatches: int = 1
    vertical_sync: bool = False
    allow_replication: bool = True
    optimizer_multiplier: float = 3.0
    overlap_comm: bool = True
    max_search_work: int = 20_000_000
    # PipeDream's depth N (minibatches in flight on stage 0; stage i keeps max(1, N - i)); None:
    # the number of stages (HetPipe runs N = s_local + 1)
    in_flight: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleKind):
            allowed = [k.value for k in ScheduleKind]
            raise ConfigError(f"PartitionOptions.schedule must be one of {allowed}, got {self.schedule!r}")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ConfigError(
                f"PartitionOptions.num_microbatches must be an integer >= 1, got {self.num_microbatches!r}"
            )
        if self.schedule is ScheduleKind.PIPEDREAM and self.num_microbatches != 1:
            raise ConfigError("PartitionOptions.num_microbatches must be 1 for schedule 'pipedream'")
        if self.vertical_sync and self.schedule is not ScheduleKind.PIPEDREAM:
            raise ConfigError("PartitionOptions.vertical_sync is only allowed with schedule 'pipedream'")
        if self.in_flight is not None and (not isinstance(self.in_flight, int) or self.in_flight < 1):
            raise ConfigError(f"PartitionOptions.in_flight must be an integer >= 1, got {self.in_flight!r}")
        if not isinstance(self.optimizer_multiplier, (int, float)) or not self.optimizer_multiplier >= 1:
            raise ConfigError(
                f"PartitionOptions.optimizer_multiplier must be >= 1, got {self.optimizer_multiplier!r}"
            )
        if not isinstance(self.max_search_work, int) or self.max_search_work < 1:
            raise ConfigError(
                f"PartitionOptions.max_search_work must be an integer >= 1, got {self.max_search_work!r}"
            )

    @property
    def memory_needs_num_stages(self) -> bool:
        """True when a stage's memory depends on p itself, not only on p - stage_idx."""
        return self.schedule is ScheduleKind.PIPEDREAM and (self.vertical_sync or self.in_flight is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """Layers [layer_start, layer_end) on ``devices``; times in seconds per minibatch; memory per device."""

    stage_idx: int
    layer_start: int
    layer_end: int
    devices: tuple[str, ...]
    compute_s: float
    allreduce_s: float
    comm_s: float
    stage_s: float
    memory_bytes: int
    activation_bytes: int = 0  # (the part of memory_bytes the in-flight microbatches hold)

    @property
    def layers_label(self) -> str:
        """Inclusive layer range, e.g. ``4-7`` for [4, 8)."""
        last = self.layer_end - 1
        return str(self.layer_start) if last == self.layer_start else f"{self.layer_start}-{last}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """A partition with its modelled costs.  Invariant: stages cover all layers in order."""

    stages: tuple[StagePlan, ...]
    bottleneck_stage: int
    bottleneck_s: float
    predicted_step_s: float
    throughput_samples_per_s: float
    schedule: ScheduleKind
    num_microbatches: int
    batch_size: int
    unused_devices: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def total_stage_s(self) -> float:
        return math.fsum(stage.stage_s for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.value,
            "num_microbatches": self.num_microbatches,
            "batch_size": self.batch_size,
            "bottleneck_stage": self.bottleneck_stage,
            "bottleneck_s": self.bottleneck_s,
            "predicted_step_s": self.predicted_step_s,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "unused_devices": list(self.unused_devices),
            "stages": [
                {name: (list(v) if isinstance(v, tuple) else v) for name, v in _fields(stage).items()}
                for stage in self.stages
            ],
        }


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``3.2 GiB``, ``512.0 KiB``, ``17 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


class CostModel:
    """The per-stage formulas of the module docstring, shared by the DP and the brute force."""

    def __init__(self, profile: ModelProfile, links: LinkModel, options: PartitionOptions) -> None:
        self.profile, self.links, self.options = profile, links, options
        self._compute: dict[tuple[int, int], float] = {}
        self._params: dict[tuple[int, int], int] = {}

    def layer_compute_s(self, j: int, k: int) -> float:
        if (j, k) not in self._compute:
            self._compute[(j, k)] = math.fsum(layer.compute_s for layer in self.profile.layers[j:k])
        return self._compute[(j, k)]

    def param_bytes(self, j: int, k: int) -> int:
        if (j, k) not in self._params:
            self._params[(j, k)] = sum(layer.param_bytes for layer in self.profile.layers[j:k])
        return self._params[(j, k)]

    def _slowest_link(self, pairs: Sequence[tuple[DeviceSpec, DeviceSpec]]) -> Link:
        bw = min(self.links.bandwidth_gbps(a.name, b.name) for a, b in pairs)
        lat = max(self.links.link_latency_s(a.name, b.name) for a, b in pairs)
        return Link(bandwidth_gbps=bw, latency_s=lat)

    def allreduce_s(self, j: int, k: int, group: Sequence[DeviceSpec]) -> float:
        if len(group) < 2:
            return 0.0
        link = self._slowest_link([(a, b) for x, a in enumerate(group) for b in group[x + 1 :]])
        return ring_allreduce_s(len(group), self.param_bytes(j, k), link)

    def compute_s(self, j: int, k: int, group: Sequence[DeviceSpec]) -> float:
        """Compute (incl. all-reduce) seconds per minibatch of layers [j, k) on ``group``."""
        slowest = min(device.speed for device in group)
        return self.layer_compute_s(j, k) / (len(group) * slowest) + self.allreduce_s(j, k, group)

    def comm_s(self, k: int, group: Sequence[DeviceSpec], next_group: Sequence[DeviceSpec]) -> float:
        """Activations out of layer k-1 plus their gradients back, between two disjoint groups."""
        link = self._slowest_link([(a, b) for a in group for b in next_group])
        return 2 * transfer_s(self.profile.layers[k - 1].activation_bytes, link)

    def stage_s(self, compute_s: float, comm_s: float) -> float:
        return max(compute_s, comm_s) if self.options.overlap_comm else compute_s + comm_s

    def _shape(self, stages_from_here: int, num_stages: int) -> tuple[int, float]:
        """(weight versions kept, minibatches in flight) of a stage ``stages_from_here`` from the end."""
        opts, s = self.options, stages_from_here
        if opts.schedule is ScheduleKind.PIPEDREAM:
            depth = s if opts.in_flight is None else max(1, opts.in_flight - (num_stages - s))
            return (num_stages if opts.vertical_sync else depth), float(depth)
        if opts.schedule is ScheduleKind.ONE_F_ONE_B:
            return 1, min(s, opts.num_microbatches) / opts.num_microbatches
        return 1, 1.0

    def activation_bytes(
        self, j: int, k: int, replicas: int, stages_from_here: int, num_stages: int
    ) -> float:
        """The activations part of :meth:`memory_bytes`: what the in-flight microbatches hold."""
        _, in_flight = self._shape(stages_from_here, num_stages)
        return self.profile.held_bytes(j, k) * in_flight / replicas

    def memory_bytes(self, j: int, k: int, replicas: int, stages_from_here: int, num_stages: int) -> int:
        """Bytes needed on EACH device of a stage [j, k) with ``replicas`` devices that is
        ``stages_from_here`` stages from the end (p - stage_idx) of a ``num_stages`` pipeline."""
        versions, _ = self._shape(stages_from_here, num_stages)
        params = self.param_bytes(j, k) * (self.options.optimizer_multiplier + versions - 1)
        return math.ceil(params + self.activation_bytes(j, k, replicas, stages_from_here, num_stages))


def evaluate_plan(
    profile: ModelProfile,
    devices: Devices,
    links: LinkModel | None,
    options: PartitionOptions,
    layer_ends: Sequence[int],
    groups: Sequence[Sequence[str]],
) -> PipelinePlan:
    """Cost of one explicit assignment: stage i runs layers [layer_ends[i-1], layer_ends[i]) on the
    devices named in ``groups[i]``.  Memory is computed, not enforced (see ``memory_shortfalls``)."""
    devices, links = cluster_parts(devices, links)
    by_name = {d.name: d for d in devices}
    if len(layer_ends) != len(groups) or not layer_ends or layer_ends[-1] != profile.num_layers:
        raise ConfigError("layer_ends must be increasing, end at the number of layers, one per group")
    starts = (0, *layer_ends[:-1])
    if any(a >= b for a, b in zip(starts, layer_ends)):
        raise ConfigError(f"layer_ends must be strictly increasing from > 0, got {list(layer_ends)}")
    used = [name for group in groups for name in group]
    if len(set(used)) != len(used) or any(not g for g in groups) or not set(used) <= set(by_name):
        raise ConfigError(f"groups must be non-empty, disjoint and name known devices, got {groups}")
    model, p = CostModel(profile, links, options), len(groups)
    stages = []
    for i, (j, k) in enumerate(zip(starts, layer_ends)):
        group = [by_name[n] for n in groups[i]]
        comm = model.comm_s(k, group, [by_name[n] for n in groups[i + 1]]) if i + 1 < p else 0.0
        compute = model.compute_s(j, k, group)
        stages.append(
            StagePlan(
                stage_idx=i,
                layer_start=j,
                layer_end=k,
                devices=tuple(groups[i]),
                compute_s=compute,
                allreduce_s=model.allreduce_s(j, k, group),
                comm_s=comm,
                stage_s=model.stage_s(compute, comm),
                memory_bytes=model.memory_bytes(j, k, len(group), p - i, p),
                activation_bytes=math.ceil(model.activation_bytes(j, k, len(group), p - i, p)),
            )
        )
    return _finish(profile, options, stages, tuple(d.name for d in devices if d.name not in used))


def _finish(
    profile: ModelProfile, options: PartitionOptions, stages: list[StagePlan], unused: tuple[str, ...]
) -> PipelinePlan:
    bottleneck = max(range(len(stages)), key=lambda i: (stages[i].stage_s, -i))
    slowest = stages[bottleneck].stage_s
    m = options.num_microbatches
    if options.schedule is ScheduleKind.PIPEDREAM:
        step = slowest
    else:
        step = (math.fsum(s.stage_s for s in stages) + (m - 1) * slowest) / m
    return PipelinePlan(
        stages=tuple(stages),
        bottleneck_stage=bottleneck,
        bottleneck_s=slowest,
        predicted_step_s=step,
        throughput_samples_per_s=profile.batch_size / step if step > 0 else math.inf,
        schedule=options.schedule,
        num_microbatches=m,
        batch_size=profile.batch_size,
        unused_devices=unused,
    )


def memory_shortfalls(plan: PipelinePlan, devices: Devices) -> list[str]:
    """One message per device that cannot hold its stage, e.g. ``device gpu1 needs 3.2 GiB for
    stage 1 (layers 4-7) but has 2.0 GiB: short by 1.2 GiB (1288490189 bytes)``."""
    devices = devices.devices if isinstance(devices, ClusterSpec) else devices
    by_name = {d.name: d for d in devices}
    out = []
    for stage in plan.stages:
        for name in stage.devices:
            have, need = by_name[name].memory_bytes, stage.memory_bytes
            if need > have:
                out.append(
                    f"device {name} needs {format_bytes(need)} for stage {stage.stage_idx} "
                    f"(layers {stage.layers_label}) but has {format_bytes(have)}: "
                    f"short by {format_bytes(need - have)} ({need - have} bytes)"
                )
    return out
