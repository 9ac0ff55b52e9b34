"""A pipeline job built from a run configuration: plan, schedule, sampler, microbatch data.

What the launcher, the stage role, ``flotilla profile``/``flotilla plan`` and the single-process
reference agree on, so they all see the same job:

- ``profile_for_config`` profiles the configured model on one minibatch of ``job.batch_size``
  samples (one CPU thread); ``plan_for_run`` cuts it for ``flotilla run``: stage i on
  ``cluster.workers[i]`` (``fixed_stage_plan``: bottleneck-minimising contiguous split for those
  devices); a split that does not fit in memory is refused with the partitioner's message;
- ``make_sampler`` draws full batches only (``drop_last``), so every step splits into the same
  microbatch sizes; ``job_schedule`` is the whole job's schedule;
- ``BatchData`` hands the stage runtime microbatch ``b``: part ``b % m`` of step ``b // m``'s batch;
- the loss is the job's (``trainer.step.cross_entropy``, the mean over every target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flotilla.cluster.spec import ClusterSpec
from flotilla.config import PipelineStrategy, RunConfig
from flotilla.core.errors import ConfigError
from flotilla.data.sampler import GlobalBatchSampler, shard_bounds
from flotilla.pipeline.plan import PartitionOptions, PipelinePlan
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.profiler import profile_model
from flotilla.pipeline.schedule import Schedule, ScheduleKind, make_schedule
from flotilla.pipeline.split import fixed_stage_plan
from flotilla.trainer import builders
from flotilla.trainer.step import cross_entropy

__all__ = [
    "BatchData",
    "job_schedule",
    "make_sampler",
    "partition_options",
    "pipeline_cluster",
    "pipeline_strategy",
    "plan_for_run",
    "profile_for_config",
    "sequential_model",
]


def pipeline_strategy(cfg: RunConfig) -> PipelineStrategy:
    """``cfg.strategy`` of a pipeline run; ConfigError for any other strategy."""
    st = cfg.strategy
    if not isinstance(st, PipelineStrategy):
        raise ConfigError(f"strategy.kind must be 'pipeline' for a pipeline job, got {st.kind!r}")
    return st


def sequential_model(cfg: RunConfig, model: nn.Module) -> nn.Sequential:
    """``model`` as the ``nn.Sequential`` a pipeline splits; ConfigError otherwise."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"job.model.name: {cfg.job.model.name} is not an nn.Sequential")
    return model


# ------------------------------------------------------------------------------ planning


def pipeline_cluster(cfg: RunConfig) -> ClusterSpec:
    """The cluster the partitioner plans over: one device per configured worker, in order."""
    return cfg.cluster.spec()


def partition_options(cfg: RunConfig) -> PartitionOptions:
    """The partitioner's knobs for this run: schedule, microbatches, optimizer state per weight byte
    (weights + gradient + state: 2 for plain SGD, 3 with momentum, 4 for Adam)."""
    st, opt = pipeline_strategy(cfg), cfg.job.optimizer
    kind = ScheduleKind(st.schedule)
    multiplier = 4.0 if opt.kind == "adam" else (3.0 if opt.momentum > 0 else 2.0)
    pipedream = kind is ScheduleKind.PIPEDREAM
    return PartitionOptions(
        schedule=kind,
        num_microbatches=1 if pipedream else st.num_microbatches,
        vertical_sync=pipedream and st.vertical_sync,
        optimizer_multiplier=multiplier,
    )


def profile_for_config(cfg: RunConfig, *, num_warmup: int = 1, num_repeats: int = 3) -> ModelProfile:
    """Profile the configured model on one minibatch of ``job.batch_size`` training samples."""
    torch.set_num_threads(1)
    data = builders.build_dataset(cfg)
    model = sequential_model(cfg, builders.build_model_for(cfg, data))
    x, y = data.train_tensors()
    n = min(cfg.job.batch_size, int(x.shape[0]))
    return profile_model(
        model,
        x[:n],
        lambda out: cross_entropy(out, y[:n]),
        num_warmup=num_warmup,
        num_repeats=num_repeats,
        device_name="cpu (1 thread)",
    )


def plan_for_run(cfg: RunConfig, profile: ModelProfile) -> PipelinePlan:
    """The split ``flotilla run`` uses: stage i on ``cluster.workers[i]`` (see the module doc)."""
    num_stages = pipeline_strategy(cfg).num_stages
    cluster = pipeline_cluster(cfg)
    if len(cluster.devices) != num_stages:
        raise ConfigError(
            f"strategy.num_stages ({num_stages}) must equal the number of cluster "
            f"workers ({len(cluster.devices)}): stage i runs on cluster.workers[i]"
        )
    if num_stages > profile.num_layers:
        raise ConfigError(
            f"strategy.num_stages ({num_stages}) must be <= the model's {profile.num_layers} layers"
        )
    return fixed_stage_plan(profile, cluster, options=partition_options(cfg))


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
    """Microbatch b of a job: part ``b % m`` of the global batch of step ``b // m``."""

    x: torch.Tensor
    y: torch.Tensor
    sampler: GlobalBatchSampler
    num_microbatches: int

    def indices(self, b: int) -> np.ndarray:
        k, j = divmod(b, self.num_microbatches)
        batch = self.sampler.global_batch(k)
        lo, hi = shard_bounds(len(batch), j, self.num_microbatches)
        return batch[lo:hi]

    def batch_size(self, b: int) -> int:
        k, j = divmod(b, self.num_microbatches)
        lo, hi = shard_bounds(self.sampler.batch_len(k), j, self.num_microbatches)
        return hi - lo

    def input(self, b: int) -> torch.Tensor:
        return self.x[torch.from_numpy(self.indices(b))]

    def target(self, b: int) -> torch.Tensor:
        return self.y[torch.from_numpy(self.indices(b))]

    def loss_scale(self, b: int) -> float:
        return self.batch_size(b) / self.sampler.batch_len(b // self.num_microbatches)
