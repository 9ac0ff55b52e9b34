"""One validation (issue 37): the configuration-level checks ``flotilla validate`` makes are exactly
the ones ``flotilla run`` makes before it starts anything; what this machine must provide is a
separate host check, so a configuration written for another machine validates here.

- :func:`validate_plan` (no torch): the launch plan's refusal (what the strategy cannot do: a
  resume it cannot continue, revocations it cannot survive, ...: ``cluster/launch_plan.py``) and
  GPU device types under a strategy without a GPU path.
- :func:`validate_task` (imports torch): the task built and tried once
  (:func:`flotilla.launch.prepare.check_job_task`: it imports, its model fits its loss, its
  headline, optimizer hook, schedule and strategy settings build) and, for a pipeline, a model
  that splits into layers and the split ``flotilla run`` cuts (every stage within its device's
  memory, no parameter tied across PipeDream stages) or, where the strategy places its own
  instances (``hetpipe``), a placement that holds the model.  Returns the job's number of steps.
- :func:`validate`: both, in that order (``flotilla validate``).
- :func:`check_host`: every GPU worker finds a CUDA device on this machine.  Not part of
  :func:`validate`.

``flotilla run`` (``launch/local.py``) calls :func:`validate_plan` before it spawns the workers
and :func:`validate_task` while they import torch, then :func:`check_host`; the configuration
was already loaded (schema, strategy settings and their ``check``) by ``config.load_config`` in
both commands.  ``tests/unit/test_one_validation.py`` holds both commands to that.
"""

from __future__ import annotations

from flotilla.cluster.launch_plan import Runner
from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError

__all__ = ["HOST_CHECKS", "check_host", "validate", "validate_plan", "validate_task"]

HOST_CHECKS = ("a worker with device: cuda needs a CUDA device on the machine that runs it",)


def validate_plan(cfg: RunConfig, *, resume: bool = False) -> None:
    """The launch plan's refusal and device types the strategy cannot use (``ConfigError``)."""
    plan = cfg.launch_plan(resume=resume)
    if plan.refusal:
        raise ConfigError(plan.refusal)
    if not plan.gpu:
        for w in cfg.cluster.resolved_workers():
            if w.device != "cpu":
                raise ConfigError(
                    f"cluster: worker {w.name!r} has device cuda; strategy {cfg.strategy.kind} runs on "
                    "cpu only (its spec declares no GPU path: LaunchNeeds.gpu)"
                )


def validate_task(cfg: RunConfig) -> int:
    """The task tried once and, for a pipeline, split into layers; the job's steps."""
    from flotilla.launch.prepare import check_job_task

    steps = check_job_task(cfg)
    if cfg.launch_plan().runner is Runner.PIPELINE:
        from flotilla.launch.pipeline_checks import refuse_small_microbatches, refuse_ties
        from flotilla.launch.pipeline_prepare import check_split, placed_instances
        from flotilla.trainer.pipeline_setup import check_microbatches, pipeline_parts, pipeline_strategy

        check_microbatches(cfg)
        parts = pipeline_parts(cfg)  # the layers (traced, cut at split_points, if need be), not empty
        placed = placed_instances(cfg, lambda: parts)  # (a strategy placing its instances: they fit)
        instances = pipeline_strategy(cfg).replicas if placed is None else len(placed.instances)
        refuse_small_microbatches(cfg, parts.model, instances)
        if placed is None:
            check_split(cfg, parts)  # the runner's split: every stage fits its device
        else:
            refuse_ties(cfg, parts.model, [i.plan for i in placed.instances])
    return steps


def validate(cfg: RunConfig, *, resume: bool = False) -> int:
    """Every configuration-level check of a run (module doc); the job's number of steps."""
    validate_plan(cfg, resume=resume)
    return validate_task(cfg)


def check_host(cfg: RunConfig) -> list[str]:
    """What this machine must provide for ``cfg`` (:data:`HOST_CHECKS`); ``ConfigError``.  Returns
    the warnings to print (CUDA workers sharing a GPU: NCCL refuses that, gloo stages through it)."""
    from flotilla.trainer import builders

    workers = cfg.cluster.resolved_workers()
    for worker in workers:
        builders.worker_device(cfg, worker.name)
    if not any(w.device == "cuda" for w in workers):
        return []
    placement = builders.gpu_placement(cfg, one_host=True)  # (flotilla run: every worker here)
    return [placement.sharing_warning()] if placement.shared else []
