"""The simulator's inputs and its result (pure data; ``docs/simulator.md``).

- :class:`DeviceClass` / :class:`SimCluster`: a cluster described compactly -- counts of devices
  per class (type, speed relative to the reference device, devices per node, price per
  device-hour), the links within a node and between nodes, and optional transient slowdowns (the
  runtime's own :class:`~flotilla.cluster.emulation.TransientSlowdown`, drawn per worker with the
  runtime's seeding);
- :class:`SimJob`: the job -- steps, one worker's compute per step on the reference device, the
  bytes of the model, the samples per worker step, the cost of an evaluation and a checkpoint;
- :class:`Recovery`: what a revocation costs -- detection, forming the next view, a
  replacement's start-up;
- :class:`Change`: a revocation or an arrival at a time (a revocation schedule's or a spot
  trace's replay, ``cluster/revocation_trace.py``);
- :class:`SimResult`: what a simulation predicts.

Invariants (checked on construction, ``ValueError`` naming the field): counts, steps and bytes
are integers >= 1 (bytes >= 0), speeds and times > 0 (costs >= 0), prices >= 0.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from flotilla.cluster.comm_cost import message_s
from flotilla.cluster.emulation import TransientSlowdown
from flotilla.cluster.spec import Link
from flotilla.pipeline.profile import ModelProfile

__all__ = [
    "Change",
    "DeviceClass",
    "Recovery",
    "SimCluster",
    "SimDevice",
    "SimJob",
    "SimResult",
    "layers_of",
]


def _positive(owner: str, name: str, value: float, *, zero: bool = False) -> None:
    ok = (
        isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    )
    if not ok:
        raise ValueError(f"{owner}.{name} must be a number {'>= 0' if zero else '> 0'}, got {value!r}")


def _count(owner: str, name: str, value: int, *, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}.{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceClass:
    """``count`` devices of one kind: ``speed`` relative to the reference device (compute time =
    reference time / speed), ``per_node`` of them in one machine, ``price_per_hour`` each,
    ``memory_bytes`` each (0: not limited -- only placements that respect memory read it:
    HetPipe's virtual workers, ``sim/hetpipe.py``)."""

    type: str
    count: int
    speed: float = 1.0
    per_node: int = 1
    price_per_hour: float = 0.0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or not self.type:
            raise ValueError(f"DeviceClass.type must be a non-empty string, got {self.type!r}")
        _count("DeviceClass", "count", self.count)
        _positive("DeviceClass", "speed", self.speed)
        _count("DeviceClass", "per_node", self.per_node)
        _positive("DeviceClass", "price_per_hour", self.price_per_hour, zero=True)
        _count("DeviceClass", "memory_bytes", self.memory_bytes, least=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimDevice:
    """One device of an expanded cluster (``SimCluster.devices``)."""

    name: str
    type: str
    node: str
    speed: float
    price_per_hour: float
    memory_bytes: int = 0  # (0: not limited)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimCluster:
    """Device classes, the links within a node and between nodes, transient slowdowns, and the
    message plane's own cost per message (``message_plane``: signing, framing, copies, as a
    latency-bandwidth pair that ``flotilla calibrate`` fits; ``None``: nothing beyond the link),
    paid by every message-plane transfer (:meth:`message_s`) on top of the link's."""

    classes: tuple[DeviceClass, ...]
    intra_node: Link = Link(bandwidth_gbps=100.0, latency_s=5e-6)
    inter_node: Link = Link(bandwidth_gbps=10.0, latency_s=5e-5)
    slowdown: TransientSlowdown | None = None
    message_plane: Link | None = None

    def __post_init__(self) -> None:
        if not self.classes or not all(isinstance(c, DeviceClass) for c in self.classes):
            raise ValueError(
                f"SimCluster.classes must be a non-empty tuple of DeviceClass, got {self.classes!r}"
            )
        if len({c.type for c in self.classes}) != len(self.classes):
            raise ValueError(f"SimCluster.classes: each type once, got {[c.type for c in self.classes]}")

    def devices(self) -> tuple[SimDevice, ...]:
        """Every device, class by class: ``<type>-<i>`` on node ``<type>-n<i // per_node>``."""
        return tuple(
            SimDevice(name=f"{c.type}-{i}", type=c.type, node=f"{c.type}-n{i // c.per_node}", speed=c.speed,
                      price_per_hour=c.price_per_hour, memory_bytes=c.memory_bytes)
            for c in self.classes
            for i in range(c.count)
        )  # fmt: skip

    def spare(self, name: str) -> SimDevice:
        """A device that arrives under ``name`` (a trace's new slot): of the first class, alone
        on its node."""
        c = self.classes[0]
        return SimDevice(
            name=name, type=c.type, node=f"{name}-node", speed=c.speed, price_per_hour=c.price_per_hour,
            memory_bytes=c.memory_bytes,
        )  # fmt: skip

    def link_among(self, devices: list[SimDevice] | tuple[SimDevice, ...]) -> Link:
        """The slowest link among ``devices``: within a node if they share one, else between."""
        return self.intra_node if len({d.node for d in devices}) <= 1 else self.inter_node

    def message_s(self, num_bytes: float, devices: list[SimDevice] | tuple[SimDevice, ...]) -> float:
        """One message-plane message of ``num_bytes`` among ``devices`` (``comm_cost.message_s``)."""
        return message_s(num_bytes, self.link_among(devices), self.message_plane)

    def rng_of(self, index: int) -> random.Random:
        """Worker ``index``'s slowdown draws, seeded as the runtime seeds them."""
        seed = self.slowdown.seed if self.slowdown is not None else 0
        return random.Random(seed * 1_000_003 + index)

    def compute_s(self, base_s: float, device: SimDevice, rng: random.Random) -> float:
        """One step's compute on ``device``: ``base_s / speed``, times a drawn transient factor."""
        f = self.slowdown.draw(rng) if self.slowdown is not None else 1.0
        return base_s * f / device.speed


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """``steps`` steps; ``step_s``: one worker's compute per step (forward, backward, update) on a
    device of speed 1; ``model_bytes``: the parameters' bytes (what one exchange moves);
    ``batch_per_worker``: samples per worker step (0: samples are not counted); ``eval_s`` every
    ``eval_every_steps`` and ``checkpoint_s`` every ``checkpoint_every_steps`` (0: never).
    Pipelines (``sim/pipeline.py``) need the model's layers: ``profile``, measured on a device of
    speed 1 for ``profile.batch_size`` samples, and ``global_batch``, the samples of one step;
    placements that respect memory (HetPipe's) ``optimizer_multiplier``: the bytes training keeps
    per parameter byte (weights, gradient, optimizer state: 3 for SGD with momentum, 4 for Adam);
    pipelines ``optimizer_s``: the optimizer's step over each profiled layer's parameters on a
    device of speed 1 (one per layer of ``profile``; empty: not measured, free)."""

    steps: int
    step_s: float
    model_bytes: int
    batch_per_worker: int = 0
    eval_every_steps: int = 0
    eval_s: float = 0.0
    checkpoint_every_steps: int = 0
    checkpoint_s: float = 0.0
    profile: ModelProfile | None = None
    global_batch: int = 0
    optimizer_multiplier: float = 3.0
    optimizer_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _count("SimJob", "steps", self.steps)
        _count("SimJob", "global_batch", self.global_batch, least=0)
        if self.profile is not None and not isinstance(self.profile, ModelProfile):
            raise ValueError(f"SimJob.profile must be a ModelProfile, got {type(self.profile).__name__}")
        _positive("SimJob", "step_s", self.step_s)
        _count("SimJob", "model_bytes", self.model_bytes, least=0)
        _count("SimJob", "batch_per_worker", self.batch_per_worker, least=0)
        _count("SimJob", "eval_every_steps", self.eval_every_steps, least=0)
        _count("SimJob", "checkpoint_every_steps", self.checkpoint_every_steps, least=0)
        _positive("SimJob", "eval_s", self.eval_s, zero=True)
        _positive("SimJob", "checkpoint_s", self.checkpoint_s, zero=True)
        _positive("SimJob", "optimizer_multiplier", self.optimizer_multiplier)
        if not self.optimizer_multiplier >= 1:
            raise ValueError(f"SimJob.optimizer_multiplier must be >= 1, got {self.optimizer_multiplier!r}")
        if self.optimizer_s:
            if self.profile is None or len(self.optimizer_s) != self.profile.num_layers:
                layers = self.profile.num_layers if self.profile is not None else 0
                raise ValueError(
                    f"SimJob.optimizer_s: one time per profiled layer ({layers}), got {len(self.optimizer_s)}"
                )
            for t in self.optimizer_s:
                _positive("SimJob", "optimizer_s", t, zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """A revocation's costs: ``detect_s`` until the survivors notice (peer heartbeats),
    ``repair_s`` to form the next view, ``startup_s`` for a replacement to start and ask to join."""

    detect_s: float = 0.2
    repair_s: float = 0.05
    startup_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("detect_s", "repair_s", "startup_s"):
            _positive("Recovery", name, getattr(self, name), zero=True)


@dataclass(frozen=True, slots=True)
class Change:
    """At ``at_s`` (simulated seconds from the first step) device ``name`` is revoked
    (``kill``) or arrives (not ``kill``); an arrival is ready to join ``ready_s`` after it
    arrives (None: ``Recovery.startup_s``, a process starting; a worker woken from a stop is
    running already: ``sim/schedule.py``); ``cause_s``: the stop that led to a revocation (its
    recovery is measured from then, else from ``at_s``) or to a return."""

    at_s: float
    kill: bool
    name: str
    ready_s: float | None = None
    cause_s: float | None = None  # (a revocation caused earlier -- a stop: its recovery counts from then)

    @property
    def since_s(self) -> float:
        """When what this change does began (a revocation's recovery counts from then)."""
        return self.at_s if self.cause_s is None else self.cause_s

    def ready_at(self, recovery: Recovery) -> float:
        """When this arrival is ready to join."""
        return self.at_s + (recovery.startup_s if self.ready_s is None else self.ready_s)


@dataclass(kw_only=True, slots=True)
class SimResult:
    """A simulation's prediction: ``steps`` of the job done in ``time_s`` simulated seconds
    (``completed``: all of them); ``device_s`` device-seconds held (alive devices, start-up
    included) and their ``cost``; ``timeline``: (time, steps done, live workers) at each unit's
    end; ``recoveries_s``: from each revocation instant (every device revoked then: a trace
    node's group) to the next committed unit; ``samples``: samples
    trained (when the job counts them); ``events``: the simulator's event count; ``parts``: where
    a step's time goes, per component (seconds per step, e.g. ``stage0.device_s``: a driver's
    own breakdown, for comparison with a real run's records; may be empty)."""

    strategy: str
    steps: int
    time_s: float
    completed: bool
    device_s: float = 0.0
    cost: float = 0.0
    samples: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    recoveries_s: list[float] = field(default_factory=list)
    events: int = 0
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.time_s if self.time_s > 0 else 0.0

    def summary(self) -> dict[str, object]:
        """The JSON-ready figures (no timeline)."""
        return {
            "strategy": self.strategy,
            "steps": self.steps,
            "time_s": round(self.time_s, 6),
            "completed": self.completed,
            "steps_per_s": round(self.steps_per_s, 6),
            "samples": self.samples,
            "device_hours": round(self.device_s / 3600.0, 6),
            "cost": round(self.cost, 6),
            "recoveries": len(self.recoveries_s),
            "recovery_p50_s": round(statistics.median(self.recoveries_s), 6) if self.recoveries_s else None,
            "events": self.events,
            "note": self.note,
            "parts": {k: round(v, 9) for k, v in self.parts.items()},
        }


def layers_of(job: SimJob, what: str) -> ModelProfile:
    """``job.profile`` for a simulation of ``what`` that needs the model's layers and the samples
    of a step (pipelines, HetPipe); ValueError naming the field otherwise."""
    if job.profile is None:
        raise ValueError(
            f"SimJob.profile: {what}'s simulation needs the model's layer profile (flotilla simulate "
            "measures it from a training config, as flotilla plan does; a sizing file has no model)"
        )
    if job.global_batch < 1:
        raise ValueError(f"SimJob.global_batch must be >= 1 for {what}, got {job.global_batch}")
    return job.profile
