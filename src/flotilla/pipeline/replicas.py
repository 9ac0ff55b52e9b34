"""Pipeline instances side by side (PP x DP, ``strategy.replicas``): where each stage process runs
and which devices the partitioner plans over (pure: no I/O, no torch).

A job of ``P`` stages and ``R`` replicas has ``R * P`` stage processes; process ``g`` is stage
``g % P`` of instance ``g // P`` and runs on ``devices[g]`` (the configured workers, in order).
Every instance uses the same split (the same stage of every instance holds the same layers, so
their gradients can be summed), so the split is planned over one pipeline of ``P`` positions
whose position ``i`` is the weakest of the instances' stage-``i`` devices: the slowest speed and
the least memory of them, and between positions ``i`` and ``i + 1`` the slowest of the instances'
links (least bandwidth, most latency).  With ``R = 1`` that is the cluster itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, LinkModel, PairLink
from flotilla.core.errors import ConfigError

__all__ = ["StagePlace", "planning_cluster", "stage_place"]


@dataclass(frozen=True, slots=True)
class StagePlace:
    """Stage process ``index`` of a job: stage ``stage`` of pipeline instance ``replica``."""

    index: int
    stage: int
    replica: int


def stage_place(index: int, num_stages: int, replicas: int) -> StagePlace:
    """Where stage process ``index`` sits (module doc); ConfigError out of range."""
    if num_stages < 1 or replicas < 1:
        raise ConfigError(f"a pipeline needs num_stages >= 1 and replicas >= 1, got {num_stages}, {replicas}")
    if not 0 <= index < num_stages * replicas:
        raise ConfigError(
            f"stage process {index} out of range: the job has {num_stages} stage(s) x {replicas} "
            f"replica(s) = {num_stages * replicas} processes"
        )
    replica, stage = divmod(index, num_stages)
    return StagePlace(index, stage, replica)


def planning_cluster(cluster: ClusterSpec, num_stages: int, replicas: int) -> ClusterSpec:
    """The ``num_stages`` positions the split is planned over (module doc): the cluster itself for
    one replica.  ConfigError when the cluster does not have ``num_stages * replicas`` devices."""
    devices: Sequence[DeviceSpec] = cluster.devices
    if len(devices) != num_stages * replicas:
        raise ConfigError(
            f"strategy.num_stages x strategy.replicas ({num_stages} x {replicas} = "
            f"{num_stages * replicas}) must equal the number of cluster workers ({len(devices)}): "
            "stage i of instance r runs on cluster.workers[r * num_stages + i]"
        )
    if replicas == 1:
        return cluster
    columns = [[devices[r * num_stages + i] for r in range(replicas)] for i in range(num_stages)]
    positions = tuple(
        replace(
            col[0],
            speed=min(d.speed for d in col),
            memory_bytes=min(d.memory_bytes for d in col),
        )
        for col in columns
    )
    links = cluster.links
    pairs = []
    for i in range(num_stages - 1):
        between = [links.link(a.name, b.name) for a, b in zip(columns[i], columns[i + 1])]
        pairs.append(
            PairLink(
                a=positions[i].name,
                b=positions[i + 1].name,
                bandwidth_gbps=min(link.bandwidth_gbps for link in between),
                latency_s=max(link.latency_s for link in between),
            )
        )
    model = LinkModel(
        default_bandwidth_gbps=links.default_bandwidth_gbps, latency_s=links.latency_s, pairs=tuple(pairs)
    )
    return ClusterSpec(devices=positions, links=model)
