"""What a strategy adds to the stages of a pipeline job (``StrategySpec.stages``), so that a
strategy whose workers are pipeline instances -- HetPipe's virtual workers -- is one module: the
stage role (``roles/stage.py``) and the pipeline launcher (``launch/pipeline.py``) call these
hooks and know nothing of the strategy.

- :class:`StagePlug` (``spec.stages``, an import path ``"package.module:function"`` of a function
  ``(settings) -> StagePlug``, loaded by :func:`stage_plug`):
  - ``independent_instances``: the pipeline instances (``strategy.replicas``) are not summed at a
    flush: each stage group stands alone, its instance's loss is told to the host side
    (``lost``) and the others train on;
  - ``instances_return`` (with independent instances): a lost instance comes back (while
    ``job.max_restarts`` allows): the launcher starts new stage processes for it, each learns
    where it starts from ``start_step`` and, once attached, tells the launcher it is in; no
    state passes between instances (the strategy's services hold what a newcomer needs).
    False: a lost one is not brought back;
  - ``start_step(ctx)`` on every stage process, before its parts are built
    (:class:`StartContext`): the job's step it starts from, or None for the job's own (a fresh
    start, or the stages' checkpoint) -- a newcomer of an instance coming back, or a stage of a
    job resumed from the strategy's own checkpoints, learns it there;
  - ``keeps_checkpoints``: the host side writes the job's checkpoints and resumes from them
    (``HostContext.snapshots`` / ``resume_dir``; its ``services`` tell the stages): the stages
    write none and restore none;
  - ``sized_messages``: the stage data's ``split`` may change the parts of a batch whose
    receives a stage already posted (HetPipe's data views after an eviction), so every
    activation and gradient travels after a header with its batch size
    (``pipeline/stage_comm.py``);
  - ``attach(ctx)`` on every stage, once its runtime is built: the stage side
    (:class:`StageSide`: its ``finish()`` after the last update returns the fields the stage
    adds to its result, or raises what the run must fail with);
  - ``place(ctx)`` in the launcher, before any stage starts: the pipeline instances the strategy
    forms itself (:class:`Placed`: each instance's devices, stage 0 first, and its own cut; the
    devices left out are not started), or None for the runner's own layout (instance k on
    ``cluster.workers[k * num_stages : (k + 1) * num_stages]``, one split for all);
  - ``reforms`` / ``reform(ctx, survivors, free, others)`` in the launcher (``flotilla run``
    only: ``flotilla coordinator`` cannot start processes on other devices and refuses a job
    whose plug ``reforms``): an instance lost because one of its stages died (killed, crashed,
    silent: its device counted gone for the rest of the attempt) is formed again from its
    ``survivors`` (its other devices, stage 0 first) and ``free`` devices (no instance holds
    them), beside the ``others`` that train: the new instance (:class:`PlannedInstance`), or
    why none can be formed yet (it waits for a later try), or None: it comes back on its own
    processes (``launch/pipeline_reform.py``);
  - ``host(ctx)`` in the launcher, around the job's attempts: the host side
    (:class:`HostSide`): the services the stages reach (``services``, JSON data handed to every
    stage in ``StageJob.services``), ``lost(instance)`` (the instance's processes are gone: it
    was lost, or newcomers of it were given up before they were in), the weights the job ends with
    (``final_state()``: the whole model's parameters by name, or None: the lead instance's), the
    fields the summary gains (``summary(stages)``) and ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flotilla.core.errors import ConfigError
from flotilla.core.imports import import_by_name

if TYPE_CHECKING:
    import torch
    from torch import nn

    from flotilla.cluster.spec import ClusterSpec
    from flotilla.pipeline.plan import PartitionOptions, PipelinePlan
    from flotilla.pipeline.profile import ModelProfile
    from flotilla.pipeline.runtime import StageRuntime

__all__ = [
    "HostContext",
    "HostSide",
    "StartContext",
    "PlaceContext",
    "Placed",
    "PlannedInstance",
    "SplitData",
    "StageContext",
    "StagePlug",
    "StageSide",
    "lost_instances_return",
    "stage_plug",
]


class SplitData(Protocol):
    """A stage's data (``trainer/pipeline_setup.BatchData``) as a strategy may steer it: ``split``,
    where set, gives the ``(part, parts)`` of each step's batch the stage's instance trains."""

    split: Callable[[int], tuple[int, int]] | None


@dataclass(frozen=True, kw_only=True)
class StageContext:
    """One stage process: its runtime, where it is, its data (whose ``split`` a strategy may set:
    the part of each step's batch its instance trains), the services and the cluster secret."""

    runtime: StageRuntime
    data: SplitData
    instance: int
    stage: int
    num_instances: int
    num_stages: int
    num_minibatches: int  # this run's minibatches (the schedule's)
    model_keys: Mapping[str, str]  # the stage's parameter names -> the whole model's
    all_keys: Mapping[str, torch.Tensor]  # the whole model's parameters (shapes, dtypes) by name
    services: Mapping[str, Any]
    secret: bytes
    join: int = 0  # a newcomer of an instance coming back: the generation it joins (0: none)
    # (its round's serial in the job, never reused: launch/pipeline_instances.Spawn; 0: none)
    arrival: int = 0
    first_step: int = 0  # the job's step the stage starts from (a newcomer: its start_step's)


@dataclass(frozen=True, kw_only=True)
class StartContext:
    """A stage process before its parts are built: where it is, the generation it joins (a
    newcomer of an instance coming back; else 0), the job's steps, the services and the secret."""

    instance: int
    stage: int
    num_instances: int
    num_stages: int
    join: int  # the generation it joins (0: not a newcomer)
    arrival: int = 0  # a newcomer: its round's serial in the job, never reused (0: not a newcomer)
    total_steps: int
    model_keys: Mapping[str, str]
    all_keys: Mapping[str, torch.Tensor]
    services: Mapping[str, Any]
    secret: bytes


@dataclass(frozen=True, kw_only=True)
class HostContext:
    """The launcher's side: the task's model (its initial weights), the cluster secret, the
    address the services listen on and the number of pipeline instances; with
    ``keeps_checkpoints``: where the job's checkpoints go (``snapshots``; None: none), how often
    (``every_steps`` / ``every_s``; 0: not by that trigger) and where a resumed job's come from
    (``resume_dir``), against the job's ``total_steps``."""

    model: nn.Module
    secret: bytes
    host: str
    num_instances: int
    snapshots: Path | None = None
    every_steps: int = 0
    every_s: float = 0.0
    resume_dir: Path | None = None
    total_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class PlaceContext:
    """What ``place`` plans over: the cluster's devices, the task's layers profiled on a
    minibatch of ``share`` samples (``profile_for(share)``: each instance's share of a batch), the
    partitioner's options for this run and the job's batch size."""

    cluster: ClusterSpec
    profile_for: Callable[[int], ModelProfile]
    options: PartitionOptions
    batch_size: int


@dataclass(frozen=True, kw_only=True)
class PlannedInstance:
    """One pipeline instance a strategy placed: its devices (stage i on ``devices[i]``) and its cut."""

    devices: tuple[str, ...]
    plan: PipelinePlan


@dataclass(frozen=True, kw_only=True)
class Placed:
    """The instances a strategy placed, the profile they were cut with, what the summary says of
    the placement (JSON data) and what ``flotilla plan`` prints of it (text)."""

    instances: tuple[PlannedInstance, ...]
    profile: ModelProfile
    summary: dict[str, Any]
    report: str


class StageSide(Protocol):
    def finish(self) -> dict[str, Any]: ...


class HostSide(Protocol):
    services: dict[str, Any]

    def lost(self, instance: int, arrival: int = 0) -> None:
        """Instance ``instance`` is out: lost, or its newcomers given up; ``arrival``: its last
        return's (``launch/pipeline_instances.Spawn``; 0: it never came back)."""

    def final_state(self) -> dict[str, torch.Tensor] | None: ...

    def summary(self, stages: Sequence[Mapping[str, Any]]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class StagePlug(Protocol):
    independent_instances: bool
    instances_return: bool  # (independent instances) a lost one comes back: ``start_step``
    keeps_checkpoints: bool  # its host side checkpoints the job and resumes it
    sized_messages: bool  # its ``split`` may change a batch's parts while receives are posted ahead
    reforms: bool  # a lost instance is formed again on other devices (``reform``)

    def start_step(self, ctx: StartContext) -> int | None: ...

    def attach(self, ctx: StageContext) -> StageSide: ...

    def place(self, ctx: PlaceContext) -> Placed | None: ...

    def reform(
        self,
        ctx: PlaceContext,
        survivors: tuple[str, ...],
        free: tuple[str, ...],
        others: tuple[tuple[str, ...], ...],
    ) -> PlannedInstance | str | None: ...

    def host(self, ctx: HostContext) -> HostSide: ...


def stage_plug(cfg: Any) -> StagePlug | None:
    """The plug of ``cfg``'s strategy (None: a plain pipeline, or not a pipeline job)."""
    path = cfg.strategy_spec.stages
    if not path:
        return None
    make = import_by_name(path, label=f"strategy {cfg.strategy.kind!r} stages", error=ConfigError)
    plug: StagePlug = make(cfg.strategy)
    return plug


def lost_instances_return(plug: StagePlug | None) -> bool:
    """Whether a lost pipeline instance of a job with ``plug`` may come back: always where the
    instances are summed (a plain pipeline's replicas), by ``instances_return`` where independent."""
    return plug is None or not plug.independent_instances or plug.instances_return


def model_keys(layer_ends: Sequence[int], stage: int, module: nn.Module) -> dict[str, str]:
    """A stage's parameter names -> the whole ``nn.Sequential``'s (``split_sequential`` numbers a
    stage's layers from 0)."""
    start = 0 if stage == 0 else int(layer_ends[stage - 1])
    out = {}
    for name, _ in module.named_parameters():
        head, _, rest = name.partition(".")
        out[name] = f"{start + int(head)}.{rest}"
    return out
