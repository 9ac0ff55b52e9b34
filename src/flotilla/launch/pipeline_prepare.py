"""A pipeline job checked, profiled and planned before any stage starts (``launch/pipeline.py``
step 1-2, shared by ``flotilla run`` and ``flotilla coordinator``, ``launch/pipeline_host.py``):
the task's layers, the profile, the split (a resume's verified and kept, or re-planned), the
checkpoint plan, and the typed job every stage process receives; after a failed attempt, where
the next one starts (:func:`restart_point`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.pipeline_checks import refuse_ties
from flotilla.launch.pipeline_watch import Restarts, StageFailure, clear_attempt_files
from flotilla.launch.prepare import refuse_existing, set_aside_previous
from flotilla.pipeline.plan import PipelinePlan, PlanError
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.schedule import Schedule
from flotilla.pipeline.split import layer_ends_of
from flotilla.ps.snapshot_sets import PATTERN, SUBDIR, find_snapshots
from flotilla.sync.stage_plug import HostContext, PlaceContext, Placed, PlannedInstance, stage_plug
from flotilla.trainer import builders
from flotilla.trainer.pipeline_checkpoint import (
    DEFAULT_EVERY_STEPS,
    checkpoint_root,
    config_fingerprint,
    default_checkpointing,
    resume_point,
    same_shape,
)
from flotilla.trainer.pipeline_job import ResumePoint, StageCheckpointPlan, StageJob
from flotilla.trainer.pipeline_setup import (
    PipelineParts,
    job_schedule,
    make_sampler,
    partition_options,
    pipeline_parts,
    pipeline_strategy,
    plan_for_ends,
    plan_for_run,
    profile_for_config,
)

__all__ = [
    "PreparedPipeline",
    "check_split",
    "host_context",
    "job_file",
    "place_context",
    "placed_instances",
    "prepare_pipeline",
    "restart_point",
]

log = get_logger("pipeline-job")


@dataclass(frozen=True)
class PreparedPipeline:
    """A pipeline job checked, profiled and planned, before any stage starts."""

    parts: PipelineParts
    profile: ModelProfile
    num_steps: int
    plan: PipelinePlan
    schedule: Schedule
    resume: ResumePoint | None
    ck_plan: StageCheckpointPlan | None
    run_dir: Path
    report_dir: Path | None
    # the instances the strategy placed itself (``sync/stage_plug.py``; ``plan`` is the first's),
    # and what the summary says of them; () and None: the runner's own layout
    instances: tuple[PlannedInstance, ...] = ()
    placement: dict[str, Any] | None = None

    @property
    def out_dir(self) -> Path:
        return self.report_dir if self.report_dir is not None else self.run_dir

    def job(self, cfg: RunConfig, resume: ResumePoint | None, plan: PipelinePlan | None = None) -> StageJob:
        """The job file of an attempt (``plan``: a restart's re-planned split; the store's address
        is filled in where the store starts)."""
        plan = plan if plan is not None else self.plan
        return job_file(
            cfg, plan, self.num_steps, self.run_dir, self.report_dir, resume, self.ck_plan, self.instances
        )


def prepare_pipeline(
    cfg: RunConfig,
    report_dir: Path | None,
    run_dir: Path | None,
    resume_dir: Path | None = None,
    *,
    default_checkpoints: bool = True,
) -> PreparedPipeline:
    """Steps 1-2 of the module doc: the task built and checked, profiled, split (a resume's
    split verified), the checkpoint plan; ConfigError or FlotillaError (one line) before any
    stage starts.  ``default_checkpoints``: False leaves checkpoints to a ``checkpoint`` section
    that sets ``every_steps`` (stages on other hosts write under that path on their own host)."""
    pipeline_strategy(cfg)  # ConfigError for any other strategy
    parts = pipeline_parts(cfg)  # the task's layers (traced if need be): checked before anything
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flotilla-pipeline-")).resolve()
    report_dir = Path(report_dir).resolve() if report_dir is not None else None
    out_dir = report_dir if report_dir is not None else run_dir
    plug = stage_plug(cfg)
    own = plug is not None and plug.keeps_checkpoints  # (its host side checkpoints: the stages none)
    ck_plan = None if own else _checkpoint_plan(cfg, out_dir, resume_dir, default_checkpoints)
    num_steps = builders.total_steps(cfg, make_sampler(cfg, parts.train.num_samples))
    if own and resume_dir is not None and find_snapshots(Path(resume_dir)) is None:
        raise ConfigError(
            f"--resume {resume_dir}: no parameter-server snapshot ({PATTERN}) in it or in its {SUBDIR}/: "
            f"strategy {cfg.strategy.kind} resumes from its servers' snapshots"
        )
    placed = placed_instances(cfg, lambda: parts)
    if placed is not None and resume_dir is not None and not own:
        raise FlotillaError(
            f"strategy {cfg.strategy.kind}: a job whose strategy places its own pipeline instances "
            "cannot resume from a checkpoint (it writes none)"
        )
    resume = _resume(cfg, Path(resume_dir), num_steps) if resume_dir is not None and not own else None
    if placed is not None:
        profile, plan = placed.profile, placed.instances[0].plan
    else:
        profile = _profiled(cfg, parts)
        plan = _plan(cfg, profile, resume)
    refuse_ties(cfg, parts.model, [i.plan for i in placed.instances] if placed is not None else [plan])
    out_dir.mkdir(parents=True, exist_ok=True)
    return PreparedPipeline(
        parts=parts,
        profile=profile,
        num_steps=num_steps,
        plan=plan,
        schedule=job_schedule(cfg, num_steps, plan.num_stages if placed is not None else None),
        resume=resume,
        ck_plan=ck_plan,
        run_dir=run_dir,
        report_dir=report_dir,
        instances=placed.instances if placed is not None else (),
        placement=placed.summary if placed is not None else None,
    )


_PROFILES: dict[tuple[str, int | None], ModelProfile] = {}


def _profiled(cfg: RunConfig, parts: PipelineParts, share: int | None = None) -> ModelProfile:
    """The task's layers profiled (``profile_for_config``) once per configuration and share in
    this process: ``flotilla run`` checks the split in ``validate`` and plans it again before the
    stages start, from the same measurement."""
    key = (json.dumps(cfg.to_dict(), sort_keys=True), share)
    if key not in _PROFILES:
        _PROFILES[key] = profile_for_config(cfg, num_warmup=1, num_repeats=2, parts=parts, share=share)
    return _PROFILES[key]


def check_split(cfg: RunConfig, parts: PipelineParts) -> None:
    """The split a fresh ``flotilla run`` would cut (the runner's own layout): ConfigError (one
    line: the device short of memory, a parameter PipeDream cannot tie) when it cannot run."""
    refuse_ties(cfg, parts.model, [plan_for_run(cfg, _profiled(cfg, parts))])


def placed_instances(
    cfg: RunConfig, parts: Callable[[], PipelineParts], profile: ModelProfile | None = None
) -> Placed | None:
    """The instances the strategy places itself (``sync/stage_plug.py``), None: the runner's.
    ``parts``: the task's layers and data, built only if a profile is measured; ``profile``: use
    it as measured (else the layers are profiled at each share the plug asks)."""
    plug = stage_plug(cfg)
    if plug is None:
        return None
    try:
        return plug.place(place_context(cfg, parts, profile))
    except PlanError as exc:
        raise ConfigError(f"strategy.placement: {exc}") from None


def place_context(
    cfg: RunConfig, parts: Callable[[], PipelineParts], profile: ModelProfile | None = None
) -> PlaceContext:
    """What a strategy places its instances over (``sync/stage_plug.py``): the cluster, the
    task's layers profiled at each share asked (``parts`` built only then; ``profile``: that one
    for every share), the partitioner's options and the batch size."""

    def profile_for(share: int) -> ModelProfile:
        if profile is not None:
            return profile
        return _profiled(cfg, parts(), share)

    return PlaceContext(
        cluster=cfg.cluster.spec(),
        profile_for=profile_for,
        options=partition_options(cfg),
        batch_size=cfg.job.batch_size,
    )


def _resume(cfg: RunConfig, resume_dir: Path, num_steps: int) -> ResumePoint:
    """The stages' resume point: the newest step all stages of its split checkpointed, verified."""
    fingerprint = config_fingerprint(cfg)
    step, ends, points = resume_point(resume_dir, fingerprint)
    if step >= num_steps:
        raise FlotillaError(f"resume {resume_dir}: its checkpoint is at step {step}, the job has {num_steps}")
    log.info("resuming from step %d of %s (%d stage(s), split %s)", step, resume_dir, len(ends), ends)
    return ResumePoint(
        dir=resume_dir.resolve(),
        step=step,
        layer_ends=tuple(ends),
        fingerprint=fingerprint,
        split_points=tuple(points) if points is not None else None,
    )


def _plan(cfg: RunConfig, profile: ModelProfile, resume: ResumePoint | None) -> PipelinePlan:
    """The checkpoint's split for a job of its shape; a new plan otherwise (a resume onto another
    number of stages, or other split points, re-partitions: ``pipeline_checkpoint``)."""
    if resume is not None and same_shape(cfg, resume):
        return plan_for_ends(cfg, profile, list(resume.layer_ends))
    if resume is not None:
        log.info(
            "re-partitioning: the checkpoint has %d stage(s), the job %d",
            len(resume.layer_ends),
            pipeline_strategy(cfg).num_stages,
        )
    return plan_for_run(cfg, profile)


def host_context(
    cfg: RunConfig,
    prep: PreparedPipeline,
    model: Any,
    secret: bytes,
    num_instances: int,
    resume_dir: Path | None = None,
    *,
    default_checkpoints: bool = True,
) -> HostContext:
    """What the strategy's launcher side is given (``sync/stage_plug.py``); where its plug keeps
    the job's checkpoints, where they go -- ``<report or run dir>/ps-snapshots`` -- and how often:
    the ``checkpoint`` section's ``every_steps`` / ``every_s``, else (``default_checkpoints`` and
    ``job.auto_checkpoint``) every 10 steps; a resumed job always keeps writing there."""
    plug = stage_plug(cfg)
    snapshots, every_steps, every_s = None, 0, 0.0
    if plug is not None and plug.keeps_checkpoints:
        ck = cfg.checkpoint
        if ck is not None:
            every_steps, every_s = ck.every_steps or 0, ck.every_s or 0.0
        elif default_checkpoints and cfg.job.auto_checkpoint:
            every_steps = DEFAULT_EVERY_STEPS
        if every_steps or every_s or resume_dir is not None:
            snapshots = prep.out_dir / SUBDIR
    return HostContext(
        model=model,
        secret=secret,
        host=cfg.cluster.host,
        num_instances=num_instances,
        snapshots=snapshots,
        every_steps=every_steps,
        every_s=every_s,
        resume_dir=Path(resume_dir) if resume_dir is not None else None,
        total_steps=prep.num_steps,
    )


def _checkpoint_plan(
    cfg: RunConfig, out_dir: Path, resume_dir: Path | None, default_checkpoints: bool = True
) -> StageCheckpointPlan | None:
    """The stages' checkpoints: the ``checkpoint`` section's (a fresh run refuses a directory
    holding some), else the default ones (``default_checkpointing``: a fresh run moves a
    previous run's from ``<out_dir>/checkpoints`` to ``checkpoints.prev``), written where a
    resumed run resumed from."""
    root = checkpoint_root(cfg, out_dir)  # (also checks schedule, every_steps and keep)
    num_stages = pipeline_strategy(cfg).num_stages
    stage_dirs = lambda r: [r / f"stage{i}" for i in range(num_stages)]
    if root is not None and cfg.checkpoint is not None and cfg.checkpoint.every_steps is not None:
        every, keep = cfg.checkpoint.every_steps, cfg.checkpoint.keep
        if resume_dir is None:
            refuse_existing(root, stage_dirs(root))
    elif default_checkpoints and (default := default_checkpointing(cfg, out_dir)) is not None:
        root, every, keep = default
        if resume_dir is None:  # a previous run's: moved aside to <root>.prev
            set_aside_previous(root, has_checkpoints=any(d.exists() for d in stage_dirs(root)))
    else:
        return None
    if resume_dir is not None:
        root = Path(resume_dir)  # a resumed run keeps writing where it resumed from
    return StageCheckpointPlan(
        root=root.resolve(), every_steps=every, keep=keep, fingerprint=config_fingerprint(cfg)
    )


def job_file(
    cfg: RunConfig,
    plan: PipelinePlan,
    num_steps: int,
    run_dir: Path,
    report_dir: Path | None,
    resume: ResumePoint | None,
    checkpoint: StageCheckpointPlan | None,
    instances: tuple[PlannedInstance, ...] = (),
) -> StageJob:
    """What every stage process reads (the store's address is filled in where the store starts):
    stage i of instance k on ``cluster.workers[k * num_stages + i]``, or the ``instances`` a
    strategy placed (each on its devices, with its own split)."""
    if instances:
        names = tuple(n for i in instances for n in i.devices)
        ends = tuple(tuple(layer_ends_of(i.plan)) for i in instances)
        replicas = len(instances)
    else:
        names = tuple(w.name for w in cfg.cluster.resolved_workers())
        ends, replicas = (tuple(layer_ends_of(plan)),), int(pipeline_strategy(cfg).replicas or 1)
    return StageJob(
        config=cfg.to_dict(),
        store_host="",
        store_port=0,
        layer_ends=ends[0],
        instance_ends=ends if len(set(ends)) > 1 else (),  # (one split for all: the runner's rule)
        stage_names=names,
        speeds=tuple(float(cfg.cluster.worker(n).speed) for n in names),
        total_steps=num_steps,
        run_dir=run_dir,
        report_dir=report_dir,
        resume=resume,
        checkpoint=checkpoint,
        replicas=replicas,
    )


def restart_point(
    cfg: RunConfig,
    failure: StageFailure,
    restarts: Restarts,
    ck_plan: StageCheckpointPlan | None,
    num_steps: int,
    run_dir: Path,
) -> ResumePoint | None:
    """Where the job restarts after ``failure`` (None: from the start); the failure itself
    (FlotillaError) when no restart is allowed (``pipeline_watch.Restarts``)."""
    free = failure.nobody_failed
    if ck_plan is None or not restarts.allowed(failure.reached_step, nobody_failed=free):
        note = restarts.give_up_note(failure.reached_step, nobody_failed=free) if restarts.records else ""
        raise FlotillaError(f"{failure.line}; {note}" if note else failure.line) from None
    try:
        resume: ResumePoint | None = _resume(cfg, ck_plan.root, num_steps)
    except FlotillaError as exc:  # (CheckpointError: no step every stage checkpointed yet)
        log.warning("no checkpoint to restart from: %s", exc)
        resume = None
    rec = restarts.add(failure, resume.step if resume is not None else 0)
    log.warning(
        "%s; restarting every stage from %s (%s)",
        failure.line,
        f"step {rec['resumed_from_step']}" if resume is not None else "the start",
        "free: its group broke and no stage failed of its own cause"
        if rec["nobody_failed"]
        else f"restart {restarts.paid} of at most {restarts.max_restarts}",
    )
    clear_attempt_files(run_dir)
    return resume
