"""Where HetPipe's virtual workers sit in a simulation (pure; ``sim/hetpipe.py`` runs them): the
launcher's own placement (``pipeline/vw_placement.choose``, as ``sync/hetpipe_place`` calls it:
the policy configured or ``auto``, PipeDream at the VW's depth ``s_local + 1``, no replicated
stages) over the live simulated devices -- their type, node, speed and memory
(``DeviceClass.memory_bytes``, 0 for unlimited), the intra-node link between devices of one node,
the inter-node link otherwise -- with the job's layer profile scaled to a VW's share of the batch
(compute and activations scale with it), profiled again at the chosen count's share (at most
three rounds, as the launcher does).  A lost VW is formed again (``reform_vw``) by
``pipeline/vw_reform.reform`` over the same cluster view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, LinkModel, PairLink
from flotilla.data.sampler import shard_bounds
from flotilla.pipeline.plan import PartitionOptions, PlanError
from flotilla.pipeline.profile import scaled_profile
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.pipeline.vw_placement import Placement, WaveSettings, choose
from flotilla.pipeline.vw_reform import Reformed, reform
from flotilla.sim.model import SimCluster, SimDevice, SimJob

if TYPE_CHECKING:
    from flotilla.sim.hetpipe_spec import HetPipeSpec

__all__ = ["part", "place", "reform_vw", "scaled_profile"]

UNLIMITED = 1 << 60  # (a device whose class sets no memory)


def _cluster_spec(devices: list[SimDevice], cluster: SimCluster) -> ClusterSpec:
    """The live devices as the placement sees them: the inter-node link by default, the
    intra-node link between devices of one node."""
    by_node: dict[str, list[str]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d.name)
    fast, slow = cluster.intra_node, cluster.inter_node
    pairs = tuple(
        PairLink(a=a, b=b, bandwidth_gbps=fast.bandwidth_gbps, latency_s=fast.latency_s)
        for names in by_node.values()
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    )
    return ClusterSpec(
        devices=tuple(
            DeviceSpec(
                name=d.name,
                type=d.type,
                node=d.node,
                speed=d.speed,
                memory_bytes=d.memory_bytes if d.memory_bytes > 0 else UNLIMITED,
            )  # fmt: skip
            for d in devices
        ),
        links=LinkModel(default_bandwidth_gbps=slow.bandwidth_gbps, latency_s=slow.latency_s, pairs=pairs),
    )


def _settings(job: SimJob, spec: HetPipeSpec) -> tuple[PartitionOptions, WaveSettings]:
    """The partitioner's options and WSP's knobs, as the launcher sets them for HetPipe."""
    options = PartitionOptions(
        schedule=ScheduleKind.PIPEDREAM,
        allow_replication=False,
        optimizer_multiplier=job.optimizer_multiplier,
        in_flight=spec.wave_size,
    )
    return options, WaveSettings(
        s_local=spec.s_local, clock_distance=spec.clock_distance, ps_shards=spec.ps_shards
    )


def place(
    job: SimJob, cluster: SimCluster, spec: HetPipeSpec, devices: list[SimDevice]
) -> tuple[Placement, int]:
    """The runtime's placement of ``devices`` (module doc) and a VW's share of every batch;
    ValueError (the placement's reason) when it cannot hold the model."""
    assert job.profile is not None
    options, waves = _settings(job, spec)
    nodes = max(1, len({d.node for d in devices}))
    spec_cluster = _cluster_spec(devices, cluster)
    count, chosen = nodes, None
    for _ in range(3):  # (the launcher's rounds: the share is the VW count's)
        share = max(1, job.global_batch // count)
        try:
            chosen = choose(
                spec_cluster, scaled_profile(job.profile, share), spec.placement, options, waves
            ).chosen
        except PlanError as exc:
            raise ValueError(f"hetpipe: {exc}") from None
        if len(chosen.vws) == count:
            break
        count = len(chosen.vws)
    assert chosen is not None
    return chosen, max(1, job.global_batch // len(chosen.vws))


def reform_vw(
    job: SimJob, cluster: SimCluster, spec: HetPipeSpec, survivors: list[SimDevice], free: list[SimDevice],
    others: list[list[SimDevice]],
) -> Reformed | str:  # fmt: skip
    """A lost VW formed again from ``survivors`` and as few ``free`` devices as hold the model and
    speed the job of the ``others`` VWs up (``pipeline/vw_reform.reform``, the placement's
    partitioner and cost model); or why none does."""
    profile = job.profile
    assert profile is not None
    options, waves = _settings(job, spec)
    spec_cluster = _cluster_spec([*survivors, *free, *(d for o in others for d in o)], cluster)
    by_name = {d.name: d for d in spec_cluster.devices}
    return reform(
        [by_name[d.name] for d in survivors],
        [by_name[d.name] for d in free],
        [[by_name[d.name] for d in o] for o in others],
        spec_cluster,
        lambda share: scaled_profile(profile, share),
        job.global_batch,
        options,
        waves,
    )


def part(batch: int, rank: int, world: int) -> int:
    """The samples of part ``rank`` of ``world`` of a batch (contiguous, as the runtime splits)."""
    lo, hi = shard_bounds(batch, rank, world)
    return hi - lo
