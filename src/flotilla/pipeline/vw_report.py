"""What ``flotilla plan --virtual-workers`` prints (pure): HetPipe's placements
(``pipeline/vw_placement.py``) beside what the cluster would do without virtual workers, by the
same cost model -- data parallelism over the devices that hold the model alone, and one pipeline
over every device (:func:`alternatives`) -- and the report itself (:func:`format_choice`).
No I/O, no clock, no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flotilla.cluster.spec import ClusterSpec
from flotilla.pipeline.partition import partition
from flotilla.pipeline.plan import PartitionOptions, PlanError, evaluate_plan, format_bytes, memory_shortfalls
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.vw_placement import POLICIES, PlacementChoice, WaveSettings

__all__ = ["Alternative", "alternatives", "format_choice"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """What the cluster would do without virtual workers (HetPipe's baselines), predicted by the
    same cost model: ``throughput_samples_per_s`` None when it cannot run (``note`` says why)."""

    name: str
    devices: tuple[str, ...]
    throughput_samples_per_s: float | None
    note: str = ""


def alternatives(
    cluster: ClusterSpec, profile: ModelProfile, options: PartitionOptions | None = None
) -> tuple[Alternative, Alternative]:
    """(data parallelism over the devices that hold the model alone -- one stage replicated over
    them, the minibatch split evenly, its weights all-reduced every step; one pipeline over every
    device, cut by the partitioner).  Neither keeps a VW's ``in_flight`` depth: data parallelism
    holds one minibatch, the pipeline its schedule's own."""
    options = replace(options or PartitionOptions(), in_flight=None)
    devices, links = list(cluster.devices), cluster.links
    layers = profile.num_layers
    alone = [
        d
        for d in devices
        if not memory_shortfalls(
            evaluate_plan(profile, [d], links.among({d.name}), options, [layers], [[d.name]]), [d]
        )
    ]
    if alone:  # (replicated, each device holds less than alone: the group fits too)
        names = [d.name for d in alone]
        plan = evaluate_plan(profile, alone, links.among(set(names)), options, [layers], [names])
        dp = Alternative(name="data parallel", devices=tuple(names),
                         throughput_samples_per_s=plan.throughput_samples_per_s)  # fmt: skip
    else:
        dp = Alternative(name="data parallel", devices=(), throughput_samples_per_s=None,
                         note="no device holds the model alone")  # fmt: skip
    try:
        whole = partition(profile, devices, links, options)
        pp = Alternative(
            name="one pipeline",
            devices=tuple(n for s in whole.stages for n in s.devices),
            throughput_samples_per_s=whole.throughput_samples_per_s,
        )
    except PlanError as exc:
        pp = Alternative(name="one pipeline", devices=(), throughput_samples_per_s=None, note=str(exc))
    return dp, pp


def format_choice(
    choice: PlacementChoice,
    cluster: ClusterSpec,
    settings: WaveSettings,
    policy: str,
    profile: ModelProfile,
    options: PartitionOptions | None = None,
) -> str:
    """``flotilla plan --virtual-workers``: every policy's VWs, their stages with memory against
    each device's budget, the predicted wave and throughput, the choice, and what the cluster
    would do without virtual workers (:func:`alternatives`)."""
    budget = {d.name: d.memory_bytes for d in cluster.devices}
    lines = [
        f"virtual workers (HetPipe): a wave is {settings.wave_size} minibatch(es) "
        f"(s_local {settings.s_local}), clock distance {settings.clock_distance}, "
        f"{settings.ps_shards} server shard(s)"
    ]
    for name in POLICIES:
        if name in choice.refused:
            lines.append(f"{name}: cannot place: {choice.refused[name]}")
            continue
        p = choice.placements[name]
        lines.append(
            f"{name}: {len(p.vws)} VW(s); wave {p.estimate.wave_s:.6g} s "
            f"(servers {p.estimate.servers_s:.6g} s); predicted {p.throughput_samples_per_s:.6g} samples/s"
            + (f"; unused: {', '.join(p.unused)}" if p.unused else "")
        )
        for i, vw in enumerate(p.vws):
            idle = vw.plan.unused_devices  # (in the VW, left out by its cut: the rest hold it faster)
            lines.append(
                f"  VW {i}: {', '.join(d for d in vw.devices if d not in idle)}"
                + (f" ({', '.join(idle)} left out by its cut)" if idle else "")
                + f": {vw.plan.num_stages} stage(s), wave compute "
                f"{vw.wave_compute_s:.6g} s, sync {vw.wave_sync_s:.6g} s, "
                f"a minibatch alone through the pipeline {vw.latency_s:.6g} s"
            )
            for s in vw.plan.stages:
                held = ", ".join(
                    f"{format_bytes(s.memory_bytes)} of {format_bytes(budget[d])}" for d in s.devices
                )
                lines.append(
                    f"    stage {s.stage_idx}: layers {s.layers_label} on {','.join(s.devices)}: {held}"
                )
    how = "the fastest predicted" if policy == "auto" else "configured"
    lines.append(f"chosen: {choice.chosen.policy} ({how})")
    for alt in alternatives(cluster, profile, options):
        if alt.throughput_samples_per_s is None:
            lines.append(f"without virtual workers, {alt.name}: cannot run ({alt.note})")
        else:
            ratio = alt.throughput_samples_per_s / choice.chosen.throughput_samples_per_s
            lines.append(
                f"without virtual workers, {alt.name} over {', '.join(alt.devices)}: predicted "
                f"{alt.throughput_samples_per_s:.6g} samples/s ({ratio:.3g}x the chosen placement)"
            )
    return "\n".join(lines)
