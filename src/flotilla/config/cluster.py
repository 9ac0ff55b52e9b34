"""The ``cluster`` section: the workers of a run (speed, memory, device type, node), the links
between them, heartbeats, and the revocation schedule (``revocations``, :mod:`.revocations`).

:meth:`ClusterConfig.spec` turns the section into the one cluster description,
:class:`flotilla.cluster.spec.ClusterSpec` (one device per worker, same names), which the
partitioner, placement and the simulator read.  The section's validator builds that spec, so a
configuration that loads always yields a valid ``ClusterSpec`` (link pairs name known workers,
no pair twice) and a revocation schedule that can be planned on its workers (events name known
workers and find them alive; a trace starts as many workers as the cluster has).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from flotilla.cluster.link_costs import ModelCosts
from flotilla.cluster.revocations import RevocationAction
from flotilla.cluster.spec import DEFAULT_BANDWIDTH_GBPS, ClusterSpec, DeviceSpec, LinkModel, PairLink
from flotilla.comm.shaping import Shaping
from flotilla.config.base import Size, _fail, _matching, _Model
from flotilla.config.revocations import RevocationsConfig, check_revocations
from flotilla.core.errors import ConfigError

Speed = Annotated[float, Field(gt=0, le=1)]  # relative to the fastest device (SPEC §8)
_NAME_CHARS = "1-64 letters, digits, '_', '-' or '.'"
WorkerName = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", _NAME_CHARS)]
DeviceType = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", _NAME_CHARS)]  # "cpu", "cuda", "V100"
# where a worker computes (issue 34), apart from its device class ``type`` (a free label: "V100" is
# emulated on cpu unless ``device: cuda``); unset: cuda for ``type: cuda``, else cpu
Compute = Literal["cpu", "cuda"]
NodeName = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", _NAME_CHARS)]
HostName = Annotated[str, _matching(r"[A-Za-z0-9_.:-]{1,253}", "a host name or an IP address")]
Bandwidth = Annotated[float, Field(gt=0)]  # gigabits per second
Latency = Annotated[float, Field(ge=0, le=3600)]  # seconds


class SlowdownConfig(_Model):
    """Transient slowdowns (SPEC §8), seeded per worker: with probability ``p`` a step takes
    ``factor`` times longer, times a log-normal jitter exp(N(0, ``jitter_sigma``²))."""

    p: float = Field(default=0.0, ge=0, le=1)
    factor: float = Field(default=1.0, ge=1, le=1000)
    jitter_sigma: float = Field(default=0.0, ge=0, le=5)
    seed: int = Field(default=0, ge=0)


class WorkerDefaults(_Model):
    """Values given to every worker entry that omits them."""

    speed: Speed = 1.0
    memory_bytes: Size = 8 * 2**30
    type: DeviceType = "cpu"
    device: Compute | None = None
    node: NodeName = "local"
    slowdown: SlowdownConfig | None = None


class WorkerEntry(_Model):
    """One worker as written in the file; omitted fields come from ``cluster.defaults``."""

    name: WorkerName | None = None
    speed: Speed | None = None
    memory_bytes: Size | None = None
    type: DeviceType | None = None
    device: Compute | None = None
    node: NodeName | None = None
    slowdown: SlowdownConfig | None = None


class WorkerSpec(_Model):
    """One worker with every field resolved (see :meth:`ClusterConfig.resolved_workers`)."""

    name: WorkerName
    speed: Speed
    memory_bytes: Size
    type: DeviceType = "cpu"
    device: Compute = "cpu"  # where it computes (resolved: see ``Compute``)
    node: NodeName = "local"
    slowdown: SlowdownConfig | None = None


class LinkPair(_Model):
    """The link between workers ``a`` and ``b`` (symmetric); latency defaults to ``links.latency_s``."""

    a: WorkerName
    b: WorkerName
    bandwidth_gbps: Bandwidth
    latency_s: Latency | None = None


class LinksConfig(_Model):
    """Latency-bandwidth model of the links: defaults for every pair, ``pairs`` override them."""

    bandwidth_gbps: Bandwidth = DEFAULT_BANDWIDTH_GBPS
    latency_s: Latency = 0.0
    pairs: tuple[LinkPair, ...] = ()
    # run over these links: every worker's and stage's traffic takes at least what they model
    # (comm/shaping.py, docs/links.md); off: they are what the planner and the simulator assume
    emulate: bool = False

    def model(self) -> LinkModel:
        """The :class:`flotilla.cluster.spec.LinkModel` of this section."""
        pairs = tuple(
            PairLink(a=p.a, b=p.b, bandwidth_gbps=p.bandwidth_gbps, latency_s=p.latency_s) for p in self.pairs
        )
        return LinkModel(default_bandwidth_gbps=self.bandwidth_gbps, latency_s=self.latency_s, pairs=pairs)


class ClusterConfig(_Model):
    """The workers of a run: a list of entries, or ``num_workers`` copies of the defaults."""

    defaults: WorkerDefaults = WorkerDefaults()
    workers: tuple[WorkerEntry, ...] | None = Field(default=None, min_length=1)
    num_workers: int | None = Field(default=None, ge=1, le=4096)
    min_workers: int | None = Field(default=None, ge=1)
    host: HostName = "127.0.0.1"
    heartbeat_timeout_s: float = Field(default=10.0, gt=0, le=3600)  # silent worker declared dead
    # ring neighbours ping each other every half interval; silent for 1.5 intervals: suspected
    peer_heartbeat_s: float = Field(default=0.25, ge=0.02, le=60)
    links: LinksConfig = LinksConfig()
    revocations: RevocationsConfig = RevocationsConfig()

    @field_validator("links", "revocations", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        """``revocations: null`` (e.g. ``--set cluster.revocations=null`` over an example that
        has some): none, as an empty section."""
        return {} if value is None else value

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.workers is None and self.num_workers is None:
            raise _fail("set one of workers, num_workers", "workers")
        if self.workers is not None and self.num_workers not in (None, len(self.workers)):
            raise _fail(
                f"must equal the length of workers ({len(self.workers)}) when both are set "
                f"(got {self.num_workers})",
                "num_workers",
            )
        total = self.effective_num_workers()
        if self.min_workers is not None and self.min_workers > total:
            raise _fail(f"must be <= the number of workers ({total}) (got {self.min_workers})", "min_workers")
        names = [worker.name for worker in self.resolved_workers()]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise _fail(f"duplicate worker names {duplicates} (unnamed entry i is 'w<i>')", "workers")
        try:
            self.spec()
        except ConfigError as err:
            raise _fail(str(err), "links") from None
        check_revocations(self.revocations, names)
        return self

    def effective_num_workers(self) -> int:
        """The number of workers: ``len(workers)`` or ``num_workers``."""
        return len(self.workers) if self.workers is not None else int(self.num_workers or 0)

    def effective_min_workers(self) -> int:
        """How many workers must have joined before training starts (default: all of them)."""
        return self.min_workers if self.min_workers is not None else self.effective_num_workers()

    def resolved_workers(self) -> list[WorkerSpec]:
        """Every worker with defaults applied and names filled (``w{index}`` when omitted)."""
        entries = self.workers or (WorkerEntry(),) * self.effective_num_workers()
        return [self._resolve(entry, f"w{index}") for index, entry in enumerate(entries)]

    def _resolve(self, entry: WorkerEntry, default_name: str) -> WorkerSpec:
        d = self.defaults
        kind = entry.type if entry.type is not None else d.type
        device = entry.device if entry.device is not None else d.device
        return WorkerSpec(
            name=entry.name if entry.name is not None else default_name,
            speed=entry.speed if entry.speed is not None else d.speed,
            memory_bytes=entry.memory_bytes if entry.memory_bytes is not None else d.memory_bytes,
            type=kind,
            device=device if device is not None else ("cuda" if kind == "cuda" else "cpu"),
            node=entry.node if entry.node is not None else d.node,
            slowdown=entry.slowdown if entry.slowdown is not None else d.slowdown,
        )

    def spec(self) -> ClusterSpec:
        """The cluster description: one device per resolved worker (same order and names) and
        the links of the ``links`` section."""
        devices = tuple(
            DeviceSpec(name=w.name, type=w.type, node=w.node, speed=w.speed, memory_bytes=w.memory_bytes)
            for w in self.resolved_workers()
        )
        return ClusterSpec(devices=devices, links=self.links.model())

    def link_shaping(self, me: str) -> Shaping | None:
        """The shaping process ``me`` installs (``comm/shaping.install``): None unless
        ``links.emulate``."""
        if not self.links.emulate:
            return None
        return Shaping(me=me, costs=ModelCosts(self.links.model()))

    def worker(self, name: str) -> WorkerSpec:
        """The resolved worker ``name``; a name that only a revocation adds (an ``add`` event, a
        trace's ``spot-k``) gets the cluster's defaults."""
        for worker in self.resolved_workers():
            if worker.name == name:
                return worker
        return self._resolve(WorkerEntry(), name)

    def revocation_plan(
        self, *, horizon_s: float | None = None, horizon_steps: int | None = None
    ) -> tuple[RevocationAction, ...]:
        """The sorted revocation plan on this cluster's workers, up to the horizons
        (:func:`flotilla.cluster.revocations.plan_revocations`; a random rate without
        ``stop_s`` needs ``horizon_s``)."""
        names = [worker.name for worker in self.resolved_workers()]
        return self.revocations.plan(names, horizon_s=horizon_s, horizon_steps=horizon_steps)
