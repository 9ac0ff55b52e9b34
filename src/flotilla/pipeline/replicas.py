"""Pipeline instances side by side (PP x DP, ``strategy.replicas``): where each stage process runs
and which devices the partitioner plans over (pure: no I/O, no torch).

A job of ``P`` stages and ``R`` replicas has ``R * P`` stage processes; process ``g`` is stage
``g % P`` of instance ``g // P`` and runs on ``devices[g]`` (the configured workers, in order).
Every instance uses the same split (the same stage of every instance holds the same layers, so
their gradients can be summed), so the split is planned over one pipeline of ``P`` positions
whose position ``i`` is the weakest of the instances' stage-``i`` devices: the slowest speed and
the least memory of them, and between positions ``i`` and ``i + 1`` the slowest of the instances'
links (least bandwidth, most latency).  With ``R = 1`` that is the cluster itself.

Losing an instance (a stage process of it exits with an error) while another instance is whole:
the launcher announces a new **generation** of the surviving instances in the rendezvous store
(:func:`survivors_after`, :class:`Generation` under :func:`generation_key`); the survivors' stages
re-form (a new stage group per instance, a new replica group per stage position of the
survivors), agree on the state (the most advanced survivor donates) and go on, each instance
taking its new share of every batch; the lowest surviving instance leads (:func:`lead_of`:
checkpoints, evaluations, the weights).  A job left without a whole instance restarts from its
checkpoint as before.

The lost instance comes back (while ``job.max_restarts`` allows): the launcher starts new stage
processes for it with the **plan** of the generation that will hold it (:func:`plan_key`: the
survivors and it, :func:`joined`); each newcomer says it is ready (:func:`ready_key`) once it has
built its part; the launcher then announces that generation, the running instances see it before
an update, agree on it with that update's verdict and move to it after the same step, and the
newcomers receive the state from them.

A group that breaks with every process alive (the network reset a connection): its stages find
no new generation, so each says so under :func:`broken_key` of its generation before it waits for
one; the launcher, having seen no loss for :data:`REGROUP_GRACE_S` since (:class:`RegroupWatch`: a
process that died is seen exit within that), announces the same instances again as the next
generation (:func:`regrouped`), and every stage re-forms as after a loss -- new groups, the state
agreed, the broken step redone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, LinkModel, PairLink
from flotilla.core.errors import ConfigError
from flotilla.pipeline.layout import Layout, StagePlace

__all__ = [
    "Generation",
    "StagePlace",
    "REGROUP_GRACE_S",
    "broken_key",
    "generation_key",
    "joined",
    "joined_key",
    "lead_of",
    "plan_key",
    "ready_key",
    "planning_cluster",
    "RegroupWatch",
    "regroup_note",
    "regrouped",
    "stage_place",
    "survivors_after",
]


def stage_place(index: int, num_stages: int, replicas: int) -> StagePlace:
    """Where stage process ``index`` sits in a job of ``replicas`` instances of ``num_stages``
    stages (module doc); ConfigError out of range."""
    return Layout.uniform(num_stages, replicas).place(index)


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


# ------------------------------------------------------------------------------ losing an instance


@dataclass(frozen=True, slots=True)
class Generation:
    """The pipeline instances training from generation ``number`` on (1: every instance, at the
    start of an attempt), in increasing order.  ``serial``: the launcher's stamp, never reused in
    an attempt (0: the first generation): a number can be planned, given up and planned again,
    or announced after a plan of the same number was given up, so the groups a generation forms
    are named by its serial (:meth:`tag`), never meeting in a namespace where a process given
    up left its rendezvous keys.  Not part of equality.  No instance at all: instances that stand
    alone, their state held elsewhere (HetPipe's VWs: the servers), all lost while one comes
    back (:func:`survivors_after` with ``alone``)."""

    number: int
    instances: tuple[int, ...]
    serial: int = field(default=0, compare=False)

    @property
    def tag(self) -> str:
        """The suffix of this generation's group namespaces ("" for serial 0)."""
        return f".{self.serial}" if self.serial else ""

    def __post_init__(self) -> None:
        if self.number < 1 or list(self.instances) != sorted(set(self.instances)):
            raise ConfigError(f"a generation needs a number >= 1 and instances in order, got {self}")

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"number": self.number, "instances": list(self.instances), "serial": self.serial}
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Generation:
        """The generation of :meth:`to_bytes`; ConfigError for anything else."""
        try:
            data = json.loads(raw.decode())
            serial = int(data.get("serial", 0))
            if serial < 0:
                raise ValueError(f"serial must be >= 0, got {serial}")
            return cls(int(data["number"]), tuple(int(i) for i in data["instances"]), serial)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"not a pipeline generation: {type(exc).__name__}: {exc}") from None


def generation_key(number: int) -> str:
    """The rendezvous-store key of generation ``number``'s announcement."""
    return f"pp/generation/{number}"


def plan_key(number: int) -> str:
    """Where the newcomers of generation ``number`` read it before it is announced."""
    return f"pp/plan/{number}"


REGROUP_GRACE_S = 1.0  # a broken group's launcher waits this long for a loss before it regroups


def broken_key(number: int) -> str:
    """Set by a stage whose group broke in generation ``number`` and who found no newer one."""
    return f"pp/broken/{number}"


@dataclass
class RegroupWatch:
    """When the launcher announces the same instances again (module doc): ``due(number, broken,
    now)`` is True once a group of generation ``number`` was seen broken (``broken``: its
    :func:`broken_key` is set) for ``grace_s`` with the generation unchanged (no loss)."""

    grace_s: float = REGROUP_GRACE_S
    _since: tuple[int, float] | None = None  # (generation, when first seen broken)

    def due(self, number: int, broken: bool, now: float) -> bool:
        if not broken:
            return False
        if self._since is None or self._since[0] != number:
            self._since = (number, now)
        return now - self._since[1] >= self.grace_s


def regroup_note(broken: int, reached_step: int, nxt: Generation) -> str:
    """The launcher's line when it announces ``nxt`` after generation ``broken``'s group broke."""
    return (
        f"a pipeline group broke in generation {broken} with every instance alive (the job at step "
        f"{reached_step}): instances {', '.join(map(str, nxt.instances))} re-form as generation {nxt.number}"
    )


def regrouped(current: Generation) -> Generation:
    """The next generation after a group of ``current`` broke with every instance alive."""
    return Generation(current.number + 1, current.instances)


def ready_key(number: int, index: int) -> str:
    """Set by newcomer stage process ``index`` once it is ready to join generation ``number``."""
    return f"pp/ready/{number}/{index}"


def joined_key(number: int, index: int) -> str:
    """Set by newcomer stage process ``index`` once it holds the state, in generation ``number``."""
    return f"pp/joined/{number}/{index}"


def joined(current: Generation, instance: int) -> Generation:
    """The next generation: ``current``'s instances and ``instance`` coming back."""
    if instance in current.instances:
        raise ConfigError(f"pipeline instance {instance} is already in generation {current.number}")
    return Generation(current.number + 1, tuple(sorted((*current.instances, instance))))


def survivors_after(current: Generation, lost: int, *, alone: bool = False) -> Generation | None:
    """The next generation once a stage process of instance ``lost`` failed: that instance is out
    (None: no whole instance is left; ``current`` itself when that instance was out already).
    ``alone``: the instances stand alone and their state is held elsewhere, and one will come
    back: a generation of none (the job waits for the return) rather than None."""
    if lost not in current.instances:
        return current
    left = tuple(i for i in current.instances if i != lost)
    return Generation(current.number + 1, left) if left or alone else None


def lead_of(generation: Generation) -> int:
    """The instance that checkpoints, evaluates and writes the weights: the lowest surviving one."""
    if not generation.instances:
        raise ConfigError(f"no pipeline instance trains in generation {generation.number}")
    return generation.instances[0]
