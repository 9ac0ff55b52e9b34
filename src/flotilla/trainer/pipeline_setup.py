"""A pipeline job built from a run configuration: the task's layers, plan, schedule, sampler, data.

What the launcher, the stage role, ``flotilla profile``/``flotilla plan`` and the single-process
reference agree on, so they all see the same job:

- ``pipeline_parts`` builds the job's TASK (``trainer.builders.build_task``: the user's
  ``job.task`` or the zoo's), its model (seeded with ``job.seed``) as the ``nn.Sequential`` a
  pipeline cuts (a list of layers is wrapped into one; anything else is one ConfigError line
  naming the task), and its train/eval data (``TaskData``: tensors or a map-style Dataset);
- ``profile_for_config`` profiles those layers on one minibatch of ``job.batch_size`` samples
  (one CPU thread) closed by the task's loss; ``plan_for_run`` cuts them for ``flotilla run``:
  stage i on ``cluster.workers[i]`` (``fixed_stage_plan``: bottleneck-minimising contiguous split
  for those devices); a split that does not fit in memory is refused with the partitioner's
  message; ``plan_for_ends`` costs a given split (a resumed run keeps its checkpoint's split);
- ``make_sampler`` draws full batches only (``drop_last``), so every step splits into the same
  microbatch sizes; ``job_schedule`` is the whole job's schedule;
- ``BatchData`` hands the stage runtime microbatch ``b``: part ``b % m`` of step ``first_step +
  b // m``'s batch, via ``TaskData.batch``;
- the loss is the task's ``loss(output, target)`` (a batch mean); the runtime scales microbatch
  ``b``'s by ``loss_scale(b)`` = its share of the minibatch, so a step's gradients are the
  minibatch mean's;
- ``StageJob`` is what the launcher hands every stage process (``pipeline_job.json``): the run
  configuration, the store, the split, the stages' names and speeds, the job's length, where
  output goes, and the resume point and checkpoint plan (``ResumePoint``, ``StageCheckpointPlan``);
  typed, validated on construction, JSON both ways.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
from flotilla.pipeline.schedule import Schedule, ScheduleKind, make_schedule
from flotilla.pipeline.split import fixed_stage_plan
from flotilla.trainer import builders, optim
from flotilla.trainer.task import Task
from flotilla.trainer.task_load import TaskData

__all__ = [
    "BatchData",
    "PipelineParts",
    "ResumePoint",
    "StageCheckpointPlan",
    "StageJob",
    "job_schedule",
    "make_sampler",
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
    """``model`` as the ``nn.Sequential`` a pipeline splits (a list/tuple of modules or an
    ``nn.ModuleList`` is wrapped into one); one ConfigError line naming the task otherwise."""
    if isinstance(model, nn.Sequential):
        return model
    layers = list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else None
    if layers and all(isinstance(layer, nn.Module) for layer in layers):
        return nn.Sequential(*layers)
    raise ConfigError(
        f"job.task: {cfg.job.task_spec()[0]}: build_model() returned {type(model).__name__}; "
        "pipeline strategies need an nn.Sequential (or a list of layers)"
    )


@dataclass
class PipelineParts:
    """The job's task, its model as an ``nn.Sequential`` and its train/eval data."""

    task: Task
    model: nn.Sequential
    train: TaskData
    eval: TaskData = field(repr=False)


def pipeline_parts(cfg: RunConfig) -> PipelineParts:
    """Build the task, its (seeded) model as an ``nn.Sequential`` and its data (see the module doc)."""
    task = builders.build_task(cfg)
    model = sequential_model(cfg, builders.build_task_model(cfg, task))
    if len(model) == 0:
        raise ConfigError(f"job.task: {cfg.job.task_spec()[0]}: build_model() returned no layers")
    train, evaluation = builders.build_task_data(task)
    return PipelineParts(task=task, model=model, train=train, eval=evaluation)


# ------------------------------------------------------------------------------ planning


def pipeline_cluster(cfg: RunConfig) -> ClusterSpec:
    """The cluster the partitioner plans over: one device per configured worker, in order."""
    return cfg.cluster.spec()


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
    )


def profile_for_config(
    cfg: RunConfig, *, num_warmup: int = 1, num_repeats: int = 3, parts: PipelineParts | None = None
) -> ModelProfile:
    """Profile the task's layers on one minibatch of ``job.batch_size`` training samples, closed by
    the task's loss (``parts``: already built ones; the model's weights are left unchanged)."""
    torch.set_num_threads(1)
    parts = parts if parts is not None else pipeline_parts(cfg)
    x, y = parts.train.batch(range(min(cfg.job.batch_size, parts.train.num_samples)))
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
    num_stages = pipeline_strategy(cfg).num_stages
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


def job_schedule(cfg: RunConfig, num_steps: int) -> Schedule:
    """The job's whole schedule.  PipeDream: one unit (and one update per stage) per minibatch of
    ``job.batch_size``; ``vertical_sync`` only applies to it (flushed schedules are synchronous)."""
    st = pipeline_strategy(cfg)
    kind = ScheduleKind(st.schedule)
    if kind is ScheduleKind.PIPEDREAM:
        return make_schedule(kind, st.num_stages, 1, num_steps, st.vertical_sync)
    if st.num_microbatches > cfg.job.batch_size:
        raise ConfigError(
            f"strategy.num_microbatches ({st.num_microbatches}) must be <= job.batch_size "
            f"({cfg.job.batch_size})"
        )
    return make_schedule(kind, st.num_stages, st.num_microbatches, num_steps)


@dataclass
class BatchData:
    """Microbatch b of a job: part ``b % m`` of the global batch of step ``first_step + b // m``
    (``first_step`` > 0 when a run resumes from a checkpoint)."""

    data: TaskData
    sampler: GlobalBatchSampler
    num_microbatches: int
    first_step: int = 0
    _cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def indices(self, b: int) -> np.ndarray:
        k, j = divmod(b, self.num_microbatches)
        batch = self.sampler.global_batch(self.first_step + k)
        lo, hi = shard_bounds(len(batch), j, self.num_microbatches)
        return batch[lo:hi]

    def batch_size(self, b: int) -> int:
        k, j = divmod(b, self.num_microbatches)
        lo, hi = shard_bounds(self.sampler.batch_len(self.first_step + k), j, self.num_microbatches)
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
        return self.batch_size(b) / self.sampler.batch_len(self.first_step + b // self.num_microbatches)


# ------------------------------------------------------------------------------ the job file


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumePoint:
    """Where the stages resume: the newest step every stage checkpointed under ``dir``."""

    dir: Path
    step: int
    layer_ends: tuple[int, ...]
    fingerprint: str


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCheckpointPlan:
    """Every stage writes its part under ``root/stage<i>`` every ``every_steps`` steps, keeps ``keep``."""

    root: Path
    every_steps: int
    keep: int
    fingerprint: str

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep < 1:
            raise ConfigError(
                f"checkpoint every_steps and keep must be >= 1, got {self.every_steps}, {self.keep}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageJob:
    """What the launcher hands every stage process (module doc)."""

    config: dict[str, Any]  # the validated run configuration (RunConfig.to_dict())
    store_host: str
    store_port: int
    layer_ends: tuple[int, ...]
    stage_names: tuple[str, ...]
    speeds: tuple[float, ...]
    total_steps: int
    run_dir: Path
    report_dir: Path | None = None
    resume: ResumePoint | None = None
    checkpoint: StageCheckpointPlan | None = None

    def __post_init__(self) -> None:
        p = len(self.layer_ends)
        if p < 1 or len(self.stage_names) != p or len(self.speeds) != p:
            raise ConfigError(
                f"a pipeline job needs one name and speed per stage: {p} layer ends, "
                f"{len(self.stage_names)} names, {len(self.speeds)} speeds"
            )
        if self.total_steps < 1:
            raise ConfigError(f"a pipeline job needs total_steps >= 1, got {self.total_steps}")
        if self.resume is not None and tuple(self.resume.layer_ends) != tuple(self.layer_ends):
            raise ConfigError(
                f"resume split {self.resume.layer_ends} differs from the job's {self.layer_ends}"
            )

    @property
    def num_stages(self) -> int:
        return len(self.layer_ends)

    @property
    def first_step(self) -> int:
        """The step the stages start at (the resume point's, else 0)."""
        return self.resume.step if self.resume is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (paths as strings)."""
        return _plain(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> StageJob:
        """The job of :meth:`to_json`; ConfigError (one line) for anything else."""
        try:
            raw = dict(json.loads(text))
            resume, ck, report = (
                raw.pop("resume", None),
                raw.pop("checkpoint", None),
                raw.pop("report_dir", None),
            )
            raw.update(
                layer_ends=tuple(int(e) for e in raw["layer_ends"]),
                stage_names=tuple(str(n) for n in raw["stage_names"]),
                speeds=tuple(float(v) for v in raw["speeds"]),
                run_dir=Path(raw["run_dir"]),
            )
            return cls(
                **raw,
                report_dir=Path(report) if report else None,
                resume=_resume_point(resume) if resume else None,
                checkpoint=StageCheckpointPlan(**{**ck, "root": Path(ck["root"])}) if ck else None,
            )
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"not a pipeline stage job: {type(exc).__name__}: {exc}") from None


def _resume_point(raw: dict[str, Any]) -> ResumePoint:
    return ResumePoint(
        dir=Path(raw["dir"]),
        step=int(raw["step"]),
        layer_ends=tuple(int(e) for e in raw["layer_ends"]),
        fingerprint=str(raw["fingerprint"]),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
