"""A pipeline job built from a run configuration: the task's layers, plan, schedule, sampler, data.

What the launcher, the stage role, ``flotilla profile``/``flotilla plan`` and the single-process
reference agree on, so they all see the same job:

- ``pipeline_parts`` builds the job's TASK (``trainer.builders.build_task``: the user's
  ``job.task`` or the zoo's), its model (seeded with ``job.seed``) as the ``nn.Sequential`` a
  pipeline cuts (a list of layers is wrapped into one; any other module is traced and cut at
  ``strategy.split_points``, ``pipeline/trace.py``; what cannot be is one ConfigError line
  naming the task), and its train/eval data (``TaskData``: tensors or a map-style Dataset);
- ``profile_for_config`` profiles those layers on one minibatch of ``job.batch_size`` samples
  (one CPU thread) closed by the task's loss; ``plan_for_run`` cuts them for ``flotilla run``:
  stage i on ``cluster.workers[i]`` (``fixed_stage_plan``: bottleneck-minimising contiguous split
  for those devices; with ``strategy.replicas`` R > 1, stage i of instance r on
  ``cluster.workers[r * num_stages + i]``, one split for all instances planned over the weakest
  device of each position: ``pipeline/replicas.py``); a split that does not fit in memory is
  refused with the partitioner's message; ``plan_for_ends`` costs a given split (a resumed run
  keeps its checkpoint's split);
- ``make_sampler`` draws full batches only (``drop_last``), so every step splits into the same
  microbatch sizes; ``job_schedule`` is the whole job's schedule;
- ``BatchData`` hands the stage runtime microbatch ``b``: part ``b % m`` of step ``first_step +
  b // m``'s batch (of instance r's part r of R of it, with replicas), via ``TaskData.batch``;
- the loss is the task's ``loss(output, target)`` (a batch mean); the runtime scales microbatch
  ``b``'s by ``loss_scale(b)`` = its share of the GLOBAL minibatch, so a step's gradients (summed
  over the instances, with replicas) are the minibatch mean's;
- what the launcher hands every stage process is ``trainer/pipeline_job.py``'s ``StageJob``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from flotilla.cluster.launch_plan import Runner
from flotilla.cluster.spec import ClusterSpec
from flotilla.config import PipelineStrategy, RunConfig
from flotilla.core.errors import ConfigError
from flotilla.data.sampler import GlobalBatchSampler, shard_bounds
from flotilla.pipeline.model_check import check_layers
from flotilla.pipeline.plan import PartitionOptions, PipelinePlan, evaluate_plan
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.profiler import profile_model
from flotilla.pipeline.replicas import planning_cluster
from flotilla.pipeline.schedule import Schedule, ScheduleKind, make_schedule
from flotilla.pipeline.split import fixed_stage_plan
from flotilla.pipeline.trace import trace_layers
from flotilla.trainer import builders, optim
from flotilla.trainer.task import Task
from flotilla.trainer.task_load import TaskData

__all__ = [
    "BatchData",
    "PipelineParts",
    "as_module",
    "job_schedule",
    "layers_of",
    "make_sampler",
    "check_microbatches",
    "partition_options",
    "pipeline_cluster",
    "pipeline_parts",
    "pipeline_strategy",
    "plan_for_ends",
    "plan_for_run",
    "profile_for_config",
    "sequential_model",
]


def pipeline_strategy(cfg: RunConfig) -> PipelineStrategy:
    """``cfg.strategy`` of a pipeline run; ConfigError for any other strategy."""
    if cfg.launch_plan().runner is not Runner.PIPELINE:
        raise ConfigError(f"strategy.kind must be 'pipeline' for a pipeline job, got {cfg.strategy.kind!r}")
    return cast(PipelineStrategy, cfg.strategy)  # (the strategy the pipeline runner runs)


def sequential_model(cfg: RunConfig, model: Any) -> nn.Sequential:
    """``model`` as the ``nn.Sequential`` of layers a pipeline splits: an ``nn.Sequential`` as it
    is, a list/tuple of modules or an ``nn.ModuleList`` wrapped into one, any other module traced
    and cut at ``strategy.split_points`` (``pipeline/trace.py``: the layers share its parameters;
    an ``nn.Sequential`` given split points is traced too); one ConfigError line otherwise."""
    return layers_of(model, pipeline_strategy(cfg).split_points, f"job.task: {cfg.job.task_spec()[0]}")


def layers_of(model: Any, points: Sequence[str] | None, where: str) -> nn.Sequential:
    """:func:`sequential_model` with the given split points (a checkpoint's, when resuming one
    written with others); ``where`` prefixes a refusal."""
    layers = list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else None
    if layers and all(isinstance(layer, nn.Module) for layer in layers):
        model = nn.Sequential(*layers)
    if isinstance(model, nn.Sequential) and points is None:
        return model
    if isinstance(model, nn.Module):
        return trace_layers(model, points, where=where)
    raise ConfigError(
        f"{where}: build_model() returned {type(model).__name__}; pipeline strategies need an "
        "nn.Module (or a list of layers)"
    )


def as_module(model: Any) -> Any:
    """A list/tuple of modules or an ``nn.ModuleList`` as the ``nn.Sequential`` of them (so a
    re-trace at other split points, a resume of another shape, starts from the same untraced
    modules); anything else as it is."""
    if (
        isinstance(model, (list, tuple, nn.ModuleList))
        and model
        and all(isinstance(m, nn.Module) for m in model)
    ):
        return nn.Sequential(*model)
    return model


@dataclass
class PipelineParts:
    """The job's task, its model as an ``nn.Sequential`` of layers (``source``: the module holding
    the same parameters under the user's names) and its train/eval data."""

    task: Task
    model: nn.Sequential
    train: TaskData
    eval: TaskData = field(repr=False)
    source: nn.Module = field(repr=False, default_factory=nn.Sequential)


def pipeline_parts(cfg: RunConfig) -> PipelineParts:
    """Build the task, its (seeded) model as an ``nn.Sequential`` and its data (see the module doc)."""
    task = builders.build_task(cfg)
    built = as_module(builders.build_task_model(cfg, task))
    model = sequential_model(cfg, built)
    if len(model) == 0:
        raise ConfigError(f"job.task: {cfg.job.task_spec()[0]}: build_model() returned no layers")
    train, evaluation = builders.build_task_data(task)
    return PipelineParts(task, model, train, evaluation, built)  # (the layers share its parameters)


# ------------------------------------------------------------------------------ planning


def pipeline_cluster(cfg: RunConfig) -> ClusterSpec:
    """The cluster the partitioner plans over: one device per configured worker, in order (with
    ``strategy.replicas`` > 1 one position per stage, the weakest of the instances' devices:
    ``pipeline/replicas.py``; ConfigError when the workers are not ``num_stages x replicas``)."""
    st = pipeline_strategy(cfg)
    if st.replicas == 1:
        return cfg.cluster.spec()
    return planning_cluster(cfg.cluster.spec(), st.num_stages, st.replicas)


def partition_options(cfg: RunConfig) -> PartitionOptions:
    """The partitioner's knobs for this run: schedule, microbatches, optimizer state per weight byte
    (weights + gradient + state: 2 for plain SGD, 3 with momentum, 4 for Adam and AdamW)."""
    st = pipeline_strategy(cfg)
    kind = ScheduleKind(st.schedule)
    multiplier = optim.state_per_weight(cfg.job.optimizer)
    pipedream = kind is ScheduleKind.PIPEDREAM
    return PartitionOptions(
        schedule=kind,
        num_microbatches=1 if pipedream else st.num_microbatches,
        vertical_sync=pipedream and st.vertical_sync,
        optimizer_multiplier=multiplier,
        in_flight=st.in_flight() if pipedream else None,  # (hetpipe: s_local + 1)
    )


def profile_for_config(
    cfg: RunConfig,
    *,
    num_warmup: int = 1,
    num_repeats: int = 3,
    parts: PipelineParts | None = None,
    share: int | None = None,
) -> ModelProfile:
    """Profile the task's layers on one minibatch of each pipeline instance's share of
    ``job.batch_size`` training samples (all of it with one instance; ``share``: a number of
    instances a placement decides), closed by the task's loss, in fp32 (``parts``: already built
    ones; the model's weights are left unchanged)."""
    torch.set_num_threads(1)
    parts = parts if parts is not None else pipeline_parts(cfg)
    if share is None:  # (what one instance's stages hold)
        share = cfg.job.batch_size // (pipeline_strategy(cfg).replicas or 1)
    x, y = parts.train.batch(range(min(share, parts.train.num_samples)))
    check_layers(parts.model, x)  # one line naming the layer, before anything starts
    return profile_model(
        parts.model,
        x,
        lambda out: parts.task.loss(out, y),
        num_warmup=num_warmup,
        num_repeats=num_repeats,
        device_name="cpu (1 thread)",
    )


def _check_stage_count(cfg: RunConfig, profile: ModelProfile) -> int:
    st = pipeline_strategy(cfg)
    num_stages = st.num_stages
    if st.replicas > 1:  # (the workers are num_stages x replicas, or a ConfigError)
        planning_cluster(cfg.cluster.spec(), num_stages, st.replicas)
    num_devices = len(pipeline_cluster(cfg).devices)
    if num_devices != num_stages:
        raise ConfigError(
            f"strategy.num_stages ({num_stages}) must equal the number of cluster "
            f"workers ({num_devices}): stage i runs on cluster.workers[i]"
        )
    if num_stages > profile.num_layers:
        raise ConfigError(
            f"strategy.num_stages ({num_stages}) must be <= the model's {profile.num_layers} layers"
        )
    return num_stages


def plan_for_run(cfg: RunConfig, profile: ModelProfile) -> PipelinePlan:
    """The split ``flotilla run`` uses: stage i on ``cluster.workers[i]`` (see the module doc)."""
    _check_stage_count(cfg, profile)
    return fixed_stage_plan(profile, pipeline_cluster(cfg), options=partition_options(cfg))


def plan_for_ends(cfg: RunConfig, profile: ModelProfile, layer_ends: list[int]) -> PipelinePlan:
    """The cost of the given split, stage i on ``cluster.workers[i]`` (a resumed run's split)."""
    num_stages = _check_stage_count(cfg, profile)
    if len(layer_ends) != num_stages:
        raise ConfigError(f"a split of {num_stages} stage(s) needs {num_stages} layer ends, got {layer_ends}")
    cluster = pipeline_cluster(cfg)
    names = [(d.name,) for d in cluster.devices]
    return evaluate_plan(profile, cluster, None, partition_options(cfg), layer_ends, names)


# ------------------------------------------------------------------------------ schedule and data


def make_sampler(cfg: RunConfig, num_train: int) -> GlobalBatchSampler:
    """Full batches only (``drop_last``): every step splits into the same microbatch sizes."""
    if cfg.job.batch_size > num_train:
        raise ConfigError(
            f"job.batch_size ({cfg.job.batch_size}) must be <= the {num_train} training samples"
        )
    return GlobalBatchSampler(
        num_samples=num_train, global_batch_size=cfg.job.batch_size, seed=cfg.job.seed, drop_last=True
    )


def job_schedule(cfg: RunConfig, num_steps: int, num_stages: int | None = None) -> Schedule:
    """The job's whole schedule.  PipeDream: one unit (and one update per stage) per minibatch of
    ``job.batch_size``; ``vertical_sync`` only applies to it (flushed schedules are synchronous).
    ``num_stages``: an instance's own stage count (a placed HetPipe virtual worker), else the
    strategy's."""
    st = pipeline_strategy(cfg)
    kind = ScheduleKind(st.schedule)
    p = st.num_stages if num_stages is None else num_stages
    if kind is ScheduleKind.PIPEDREAM:
        return make_schedule(kind, p, 1, num_steps, st.vertical_sync, st.in_flight())
    check_microbatches(cfg)
    return make_schedule(kind, p, st.num_microbatches, num_steps)


def check_microbatches(cfg: RunConfig) -> None:
    """ConfigError if a flushing schedule's ``strategy.num_microbatches`` exceeds the batch
    (``flotilla validate`` and every stage make this check)."""
    st = pipeline_strategy(cfg)
    if ScheduleKind(st.schedule).flushes and st.num_microbatches > cfg.job.batch_size:
        raise ConfigError(
            f"strategy.num_microbatches ({st.num_microbatches}) must be <= job.batch_size "
            f"({cfg.job.batch_size})"
        )


@dataclass
class BatchData:
    """Microbatch b of a job: part ``b % m`` of the global batch of step ``first_step + b // m``
    (``first_step`` > 0 when a run resumes from a checkpoint); with ``replicas`` R > 1, part
    ``b % m`` of this instance's part ``replica`` of R of that batch (contiguous, as
    ``np.array_split``).  A microbatch's loss is scaled by its share of the global batch (the
    instances' gradients are summed), or with ``own_batch`` of its instance's part (independent
    instances: each one's loss is the mean over its own part: ``sync/stage_plug.py``).  ``split``:
    where the instances' shares change during the run, the ``(part, parts)`` of each step (a
    strategy's hook: e.g. hetpipe's data views after a virtual worker was evicted)."""

    data: TaskData
    sampler: GlobalBatchSampler
    num_microbatches: int
    first_step: int = 0
    replica: int = 0
    replicas: int = 1
    own_batch: bool = False
    split: Callable[[int], tuple[int, int]] | None = None
    _cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def share(self, step: int) -> tuple[int, int]:
        """``(part, parts)``: this instance's part of ``step``'s global batch."""
        return self.split(step) if self.split is not None else (self.replica, self.replicas)

    def _bounds(self, b: int) -> tuple[int, int, int]:
        """``(step, lo, hi)``: microbatch ``b``'s rows ``[lo, hi)`` of its step's global batch."""
        k, j = divmod(b, self.num_microbatches)
        step = self.first_step + k
        r_lo, r_hi = shard_bounds(self.sampler.batch_len(step), *self.share(step))
        lo, hi = shard_bounds(r_hi - r_lo, j, self.num_microbatches)
        return step, r_lo + lo, r_lo + hi

    def indices(self, b: int) -> np.ndarray:
        step, lo, hi = self._bounds(b)
        return self.sampler.global_batch(step)[lo:hi]

    def batch_size(self, b: int) -> int:
        _, lo, hi = self._bounds(b)
        return hi - lo

    def _batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached is None or self._cached[0] != b:
            self._cached = (b, self.data.batch(self.indices(b)))
        return self._cached[1]

    def input(self, b: int) -> torch.Tensor:
        return self._batch(b)[0]

    def target(self, b: int) -> torch.Tensor:
        return self._batch(b)[1]

    def loss_scale(self, b: int) -> float:
        step = self.first_step + b // self.num_microbatches
        whole = self.sampler.batch_len(step)
        if self.own_batch:
            lo, hi = shard_bounds(whole, *self.share(step))
            whole = hi - lo
        return self.batch_size(b) / whole
