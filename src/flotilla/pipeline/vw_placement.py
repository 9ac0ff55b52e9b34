"""HetPipe's virtual workers: which devices form each one, and how fast the job is (pure; SPEC §2).

A **virtual worker** (VW) is a pipeline over a group of devices; the VWs do data parallelism with
each other through the parameter server under WSP (each VW pushes its aggregated update once per
wave of ``s_local + 1`` minibatches and pulls the global weights, at most ``clock_distance``
waves ahead of the slowest VW).  :func:`place` forms the VWs under one policy (HetPipe §5):

- ``np`` (node partition): the devices of one node form one VW; every node must hold the model;
- ``ed`` (equal distribution): every VW gets the same mix of device ``type``\\ s -- ``k`` VWs,
  each with ``count_t / k`` devices of every type ``t``, for ``k`` dividing every type's count
  (devices of a type dealt out in declaration order); the ``k`` whose VWs all hold the model and
  whose job is fastest is taken;
- ``hd`` (hybrid): every node whose devices hold the model alone forms a VW (as ``np``); the
  devices of the other nodes are distributed equally (as ``ed``), or stay unused when no equal
  split of them holds the model or when the job is faster without them (a slow VW paces all).

Each VW's pipeline is cut by the partitioner (``pipeline/partition.py``: contiguous layer ranges,
memory respected, slowest stage minimised; it may leave a device of a VW unused when that is
faster).  **Cost model** (:func:`job_estimate`): a VW completes a minibatch every
``batch_size / plan.throughput`` seconds, so a wave's compute takes ``(s_local + 1)`` of those;
its synchronisation -- each stage pushes its layers' update and pulls their weights over its
link to the parameter server, all stages at once -- overlaps at most the next wave's first
``s_local`` minibatches (WSP lets them proceed while the pull waits); the wave's last minibatch
waits for the pull and then goes through the whole pipeline alone (``latency``: every stage's
forward and backward and every boundary's transfers, one after another -- with ``s_local`` 0 a
VW runs one minibatch at a time), so a VW's wave takes ``max(compute, sync + latency)``; the
servers receive every VW's push and send
every pull, ``2 * k * model bytes`` per wave over their combined bandwidth.  Under a finite clock
distance no VW runs more than ``D`` waves ahead of the slowest, so in the long run every VW moves
at the slowest one's pace, whatever ``D`` (it bounds how far ahead a fast VW gets, and the
staleness, not the steady pace)::

    wave_v = max(compute_v, sync_v + latency_v)
    wave_s = max(max over VWs of wave_v, servers' transfer per wave)
    throughput = k * (s_local + 1) * batch_size / wave_s

which is why balanced VWs (``ed``) beat a fast and a slow node (``np``) when nodes differ.
:func:`choose` evaluates every policy (an infeasible one with its reason) and picks the fastest,
or the one configured; ``pipeline/vw_report.py`` adds what the cluster would do without VWs and
the report ``flotilla plan --virtual-workers`` prints.  No I/O, no clock, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flotilla.cluster.comm_cost import shard_service_s, transfer_s
from flotilla.cluster.spec import ClusterSpec, DeviceSpec, Link, LinkModel
from flotilla.core.errors import ConfigError
from flotilla.pipeline.partition import partition
from flotilla.pipeline.plan import PartitionOptions, PipelinePlan, PlanError
from flotilla.pipeline.profile import ModelProfile

__all__ = [
    "POLICIES",
    "JobEstimate",
    "Placement",
    "PlacementChoice",
    "VirtualWorker",
    "WaveSettings",
    "choose",
    "equal_groups",
    "job_estimate",
    "place",
    "virtual_worker",
]

POLICIES = ("np", "ed", "hd")


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveSettings:
    """WSP's knobs and the parameter servers' side: ``s_local`` (a wave is ``s_local + 1``
    minibatches), ``clock_distance`` (D), each stage's link to the servers (``ps_link``; None: the
    cluster's default link) and how many server shards share the traffic."""

    s_local: int = 0
    clock_distance: int = 0
    ps_link: Link | None = None
    ps_shards: int = 1

    def __post_init__(self) -> None:
        for name in ("s_local", "clock_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"strategy.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.ps_shards, int) or self.ps_shards < 1:
            raise ConfigError(f"ps_shards must be an integer >= 1, got {self.ps_shards!r}")

    @property
    def wave_size(self) -> int:
        return self.s_local + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class VirtualWorker:
    """One VW: its devices and the pipeline the partitioner cut over them, with its wave's
    compute and synchronisation seconds."""

    devices: tuple[str, ...]
    plan: PipelinePlan
    wave_compute_s: float
    wave_sync_s: float
    overlap_s: float = 0.0  # (the s_local minibatches a VW may run while its pull waits)

    @property
    def latency_s(self) -> float:
        """One minibatch alone through every stage and back (:func:`pipeline_latency_s`)."""
        return pipeline_latency_s(self.plan)

    @property
    def gated_s(self) -> float:
        """The wave's last minibatch after the pull let it go: its trip through the whole
        pipeline, and never less than one pipeline period (``compute - overlap``: W - s_local
        minibatches = one)."""
        return max(self.latency_s, self.wave_compute_s - self.overlap_s)

    @property
    def wave_s(self) -> float:
        """Compute, or -- when longer -- the push and pull and then the wave's gated last
        minibatch (module doc): the first ``s_local`` minibatches of the next wave hide the rest."""
        return max(self.wave_compute_s, self.wave_sync_s + self.gated_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobEstimate:
    wave_s: float  # the job's wave period (the slowest VW's, or the servers')
    servers_s: float  # the servers' transfer per wave (all VWs' pushes and pulls)
    throughput_samples_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """The VWs a policy formed, the devices it left out, and the predicted job."""

    policy: str
    vws: tuple[VirtualWorker, ...]
    unused: tuple[str, ...]
    estimate: JobEstimate

    @property
    def throughput_samples_per_s(self) -> float:
        return self.estimate.throughput_samples_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementChoice:
    """Every policy's placement (or why it cannot place) and the one chosen."""

    placements: dict[str, Placement]
    refused: dict[str, str]
    chosen: Placement


def _ps_link(cluster: ClusterSpec, settings: WaveSettings) -> Link:
    links: LinkModel = cluster.links
    if settings.ps_link is not None:
        return settings.ps_link
    return Link(bandwidth_gbps=links.default_bandwidth_gbps, latency_s=links.latency_s)


def _links_among(links: LinkModel, names: set[str]) -> LinkModel:
    pairs = tuple(pair for pair in links.pairs if pair.a in names and pair.b in names)
    return LinkModel(
        default_bandwidth_gbps=links.default_bandwidth_gbps, latency_s=links.latency_s, pairs=pairs
    )


def virtual_worker(
    devices: Sequence[DeviceSpec],
    cluster: ClusterSpec,
    profile: ModelProfile,
    options: PartitionOptions,
    settings: WaveSettings,
) -> VirtualWorker:
    """A VW over ``devices``: PlanError (naming the devices short of memory) when none fits."""
    plan = partition(profile, list(devices), cluster.links.among({d.name for d in devices}), options)
    link = _ps_link(cluster, settings)
    params = [
        sum(layer.param_bytes for layer in profile.layers[s.layer_start : s.layer_end]) for s in plan.stages
    ]
    minibatch_s = profile.batch_size / plan.throughput_samples_per_s
    return VirtualWorker(
        devices=tuple(d.name for d in devices),
        plan=plan,
        wave_compute_s=settings.wave_size * minibatch_s,
        wave_sync_s=max(2 * transfer_s(b, link) for b in params),
        overlap_s=settings.s_local * minibatch_s,
    )


def pipeline_latency_s(plan: PipelinePlan) -> float:
    """One minibatch alone through ``plan``: every stage's forward and backward, and every
    boundary's activation forward and gradient back (``StagePlan.comm_s``), one after another."""
    return math.fsum(stage.compute_s + stage.comm_s for stage in plan.stages)


def job_estimate(
    vws: Sequence[VirtualWorker], profile: ModelProfile, cluster: ClusterSpec, settings: WaveSettings
) -> JobEstimate:
    """The job's wave period and throughput under WSP (module doc)."""
    if not vws:
        raise ConfigError("a placement needs at least one virtual worker")
    link = _ps_link(cluster, settings)
    k = len(vws)
    servers = 2 * k * shard_service_s(profile.total_param_bytes, settings.ps_shards, link)
    wave = max(max(vw.wave_s for vw in vws), servers)
    samples = k * settings.wave_size * profile.batch_size
    return JobEstimate(
        wave_s=wave, servers_s=servers, throughput_samples_per_s=samples / wave if wave > 0 else math.inf
    )


def _nodes(cluster: ClusterSpec) -> list[tuple[DeviceSpec, ...]]:
    return [cluster.devices_of_node(node) for node in cluster.nodes]


def equal_groups(devices: Sequence[DeviceSpec], k: int) -> list[tuple[DeviceSpec, ...]] | None:
    """``devices`` dealt into ``k`` groups with the same count of every ``type`` (in declaration
    order: group ``g`` gets the ``g``-th run of each type), or None when some type's count is not
    a multiple of ``k``."""
    by_type: dict[str, list[DeviceSpec]] = {}
    for d in devices:
        by_type.setdefault(d.type, []).append(d)
    if k < 1 or any(len(ds) % k for ds in by_type.values()):
        return None
    groups: list[list[DeviceSpec]] = [[] for _ in range(k)]
    for ds in by_type.values():
        per = len(ds) // k
        for g in range(k):
            groups[g].extend(ds[g * per : (g + 1) * per])
    order = {d.name: i for i, d in enumerate(devices)}
    return [tuple(sorted(g, key=lambda d: order[d.name])) for g in groups]


def _divisors_desc(devices: Sequence[DeviceSpec]) -> list[int]:
    counts: dict[str, int] = {}
    for d in devices:
        counts[d.type] = counts.get(d.type, 0) + 1
    g = math.gcd(*counts.values()) if counts else 0
    return [k for k in range(g, 0, -1) if g % k == 0]


class _Placer:
    def __init__(
        self, cluster: ClusterSpec, profile: ModelProfile, options: PartitionOptions, settings: WaveSettings
    ) -> None:
        self.cluster, self.profile, self.options, self.settings = cluster, profile, options, settings
        self._cache: dict[tuple[str, ...], VirtualWorker | str] = {}

    def vw(self, devices: Sequence[DeviceSpec]) -> VirtualWorker | str:
        """The VW over ``devices``, or why none fits (one line)."""
        key = tuple(d.name for d in devices)
        if key not in self._cache:
            try:
                self._cache[key] = virtual_worker(
                    devices, self.cluster, self.profile, self.options, self.settings
                )
            except PlanError as exc:
                self._cache[key] = str(exc)
            except ConfigError as exc:  # (a group too large for the partitioner's search: not a VW)
                self._cache[key] = f"too large a pipeline to plan: {exc}"
        return self._cache[key]

    def placement(self, policy: str, groups: Iterable[Sequence[DeviceSpec]]) -> Placement:
        vws = []
        for group in groups:
            got = self.vw(group)
            assert isinstance(got, VirtualWorker)
            vws.append(got)
        idle = {name for vw in vws for name in vw.plan.unused_devices}  # (the partitioner left them out)
        used = {name for vw in vws for name in vw.devices} - idle
        unused = tuple(d.name for d in self.cluster.devices if d.name not in used)
        estimate = job_estimate(vws, self.profile, self.cluster, self.settings)
        return Placement(policy=policy, vws=tuple(vws), unused=unused, estimate=estimate)

    def equal(self, policy: str, devices: Sequence[DeviceSpec], fixed: Sequence[Sequence[DeviceSpec]] = ()
              ) -> Placement | str:  # fmt: skip
        """The fastest equal distribution of ``devices`` (beside the ``fixed`` VWs), or why none fits."""
        best: Placement | None = None
        reasons = []
        for k in _divisors_desc(devices):
            groups = equal_groups(devices, k)
            assert groups is not None
            bad = [(g, r) for g in groups if isinstance(r := self.vw(g), str)]
            if bad:
                group, why = bad[0]
                reasons.append(f"{k} VW(s): {{{', '.join(d.name for d in group)}}}: {why}")
                continue
            got = self.placement(policy, [*fixed, *groups])
            if best is None or got.throughput_samples_per_s > best.throughput_samples_per_s:
                best = got
        if best is None:
            return "no equal distribution holds the model (" + "; ".join(reasons) + ")"
        return best


def place(
    policy: str,
    cluster: ClusterSpec,
    profile: ModelProfile,
    options: PartitionOptions | None = None,
    settings: WaveSettings | None = None,
) -> Placement:
    """The VWs of ``policy`` (``np``, ``ed``, ``hd``; module doc); PlanError (one line, naming the
    devices and their shortfall) when the policy cannot place the model."""
    got = _place(_Placer(cluster, profile, options or PartitionOptions(), settings or WaveSettings()), policy)
    if isinstance(got, str):
        raise PlanError(f"placement {policy!r}: {got}")
    return got


def _place(placer: _Placer, policy: str) -> Placement | str:
    cluster = placer.cluster
    if policy == "np":
        for devices in _nodes(cluster):
            why = placer.vw(devices)
            if isinstance(why, str):
                return f"node {devices[0].node!r} cannot hold the model: {why}"
        return placer.placement("np", _nodes(cluster))
    if policy == "ed":
        return placer.equal("ed", cluster.devices)
    if policy == "hd":
        whole = [ds for ds in _nodes(cluster) if isinstance(placer.vw(ds), VirtualWorker)]
        rest = [d for ds in _nodes(cluster) if ds not in whole for d in ds]
        if not rest:
            return placer.placement("hd", whole)
        mixed = placer.equal("hd", rest, whole)
        alone = placer.placement("hd", whole) if whole else None  # (the other nodes' devices unused)
        if isinstance(mixed, Placement) and (
            alone is None or mixed.throughput_samples_per_s >= alone.throughput_samples_per_s
        ):
            return mixed  # (a slow mixed VW paces every VW: without it may be faster)
        if alone is not None:
            return alone
        return f"no node holds the model alone and {mixed}"
    raise ConfigError(f"placement must be one of {', '.join(POLICIES)}; got {policy!r}")


def choose(
    cluster: ClusterSpec,
    profile: ModelProfile,
    policy: str = "auto",
    options: PartitionOptions | None = None,
    settings: WaveSettings | None = None,
) -> PlacementChoice:
    """Every policy's placement (or its reason) and the chosen one: ``policy`` itself, or with
    ``auto`` the fastest predicted (ties: the first of ``np``, ``ed``, ``hd``).  PlanError when
    the chosen policy (or, for ``auto``, every policy) cannot place the model, naming why."""
    if policy != "auto" and policy not in POLICIES:
        raise ConfigError(f"placement must be one of {', '.join(POLICIES)} or 'auto'; got {policy!r}")
    placer = _Placer(cluster, profile, options or PartitionOptions(), settings or WaveSettings())
    placements: dict[str, Placement] = {}
    refused: dict[str, str] = {}
    for name in POLICIES:
        got = _place(placer, name)
        if isinstance(got, str):
            refused[name] = got
        else:
            placements[name] = got
    if policy != "auto":
        if policy in refused:
            raise PlanError(f"placement {policy!r}: {refused[policy]}")
        return PlacementChoice(placements=placements, refused=refused, chosen=placements[policy])
    if not placements:
        raise PlanError("no placement holds the model: " + "; ".join(f"{k}: {v}" for k, v in refused.items()))
    best = max(placements.values(), key=lambda p: (p.throughput_samples_per_s, -POLICIES.index(p.policy)))
    return PlacementChoice(placements=placements, refused=refused, chosen=best)
