"""Where a stage process starts (``roles/stage.py`` calls these before it builds its parts):

- :func:`start_step_of`: the job's step -- the strategy's ``start_step`` (``sync/stage_plug.py``:
  a newcomer of an independent instance coming back, a stage of a job resumed from the
  strategy's own checkpoints), else the job's first (a fresh start, or the stages' checkpoint);
- :func:`reshape_of`: what a resume from a stage checkpoint of another split needs to
  re-partition its state.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.config import RunConfig
from flotilla.core.errors import FlotillaError
from flotilla.pipeline.replicas import StagePlace
from flotilla.roles.stage_parts import Reshape
from flotilla.sync.stage_plug import StagePlug, StartContext
from flotilla.trainer import optim
from flotilla.trainer.pipeline_checkpoint import same_shape
from flotilla.trainer.pipeline_job import StageJob
from flotilla.trainer.pipeline_setup import PipelineParts, layers_of, pipeline_strategy

__all__ = ["reshape_of", "start_step_of"]


def start_step_of(
    plug: StagePlug,
    job: StageJob,
    place: StagePlace,
    join: int,
    keys: dict[str, str],
    parts: PipelineParts,
    secret: bytes,
    *,
    arrival: int = 0,
) -> int:
    """The step stage process ``place`` starts from: the strategy's ``start_step``, else the
    job's first; FlotillaError for a newcomer (``join``) of an independent instance where the
    strategy brings none back, or a step outside the job."""
    if join and not plug.instances_return:
        raise FlotillaError(
            f"stage process {place.index}: a lost pipeline instance of this strategy does not come back"
        )
    step = plug.start_step(
        StartContext(
            instance=place.replica,
            stage=place.stage,
            num_instances=job.replicas,
            num_stages=len(job.ends_of(place.replica)),
            join=join,
            arrival=arrival,
            total_steps=job.total_steps,
            model_keys=keys,
            all_keys=dict(parts.model.named_parameters()),
            services=job.services,
            secret=secret,
        )
    )
    if step is None:
        return job.first_step
    if not job.first_step <= step < job.total_steps:
        raise FlotillaError(
            f"stage process {place.index}: the strategy starts it at step {step}, outside the job "
            f"(steps {job.first_step} .. {job.total_steps - 1})"
        )
    return step


def reshape_of(cfg: RunConfig, job: StageJob, parts: PipelineParts) -> Reshape | None:
    """What a resume from a checkpoint of another split needs (None: the same split, or no resume)."""
    if job.resume is None or same_shape(cfg, job.resume):
        return None
    points = job.resume.split_points
    current = pipeline_strategy(cfg).split_points
    same_layers = (tuple(current) if current is not None else None) == points
    old = parts.model if same_layers else layers_of(parts.source, points, "resume")

    def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return optim.build_optimizer(
            cfg, module, parts.task, total_steps=job.total_steps, clip_locally=False
        ).optimizer

    return Reshape(old, make_optimizer)
