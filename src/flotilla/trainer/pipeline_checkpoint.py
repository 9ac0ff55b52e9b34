"""Per-stage checkpoints of a pipeline job, and resuming from them.

Each stage writes its own part of the model (its layers' ``state_dict``), its optimizer state,
its RNG state and the step under ``<root>/stage<i>`` with the one checkpointer replicas use too
(``trainer/checkpointer.py``: the same layout, safetensors + manifest, atomic).  Invariants:

- flushing schedules (GPipe, 1F1B) checkpoint at the loop's step boundary after a stage's
  update of minibatch ``k`` (the stage engine's unit is one flush): no microbatch of step
  ``k + 1`` has touched the stage, so its state is exactly "after ``k + 1`` steps".  PipeDream
  never flushes (its unit is the whole job): each stage checkpoints right after its own update
  of minibatch ``k`` (``roles/stage.py``), its weights and optimizer then "after ``k + 1``
  updates" -- the minibatches in flight at that moment are not in it (a restart runs them again
  through a refilled pipeline, so a restarted PipeDream run is a valid run, not the
  uninterrupted one's bits); the last stage updates first and stage 0 last, at most
  ``num_stages - 1`` updates later, so PipeDream keeps ``2 + (num_stages - 1) // every_steps``
  checkpoints at least (:func:`keep_needed`);
- every stage checkpoints the same steps (``checkpoint.every_steps``; a wall-clock period would let
  stages pick different steps, so ``every_s`` alone is refused);
- a resume uses the newest step that EVERY stage of the split recorded in stage 0's checkpoint
  has checkpointed, checks each stage's checkpoint (digests, config fingerprint) and that all
  record the same split (``layer_ends``, ``split_points``); a job with the same stages keeps that
  split whatever a new profile would choose;
- **another shape**: the fingerprint leaves out the pipeline's shape (``num_stages``,
  ``num_microbatches``, ``schedule``, ``split_points``: the same update in another arrangement),
  so a job checkpointed as P stages resumes as Q: the launcher plans the new split and every new
  stage rebuilds the old split from the same model (its layers share the model's parameters),
  loads every old stage's checkpoint into it with an optimizer built as that stage's was, and
  takes the weights, optimizer state and learning rate of its own parameters
  (:func:`restore_reshaped`); the RNG state is the old stage's that held its first parameter;
- the last stage's checkpoint carries the training losses so far, so a resumed run reports them
  all; a stage's LR scheduler state (if the job has a schedule) travels in the manifest, and so
  does (``job.precision: fp16``) its loss scale and growth count (``loss_scale`` in the meta:
  every stage's is the same, agreed at every flush, so a re-partitioned resume takes stage 0's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.elastic.checkpoint import (
    Checkpoint,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
)
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.pipeline.split import split_sequential
from flotilla.sync.scaler import LossScaler
from flotilla.trainer.checkpointer import Checkpointer, CheckpointPlan, load_into
from flotilla.trainer.pipeline_job import ResumePoint, StageCheckpointPlan
from flotilla.trainer.pipeline_setup import pipeline_strategy

__all__ = [
    "checkpoint_root",
    "config_fingerprint",
    "default_checkpointing",
    "keep_needed",
    "load_stage",
    "resume_point",
    "restore_loss_scale",
    "restore_reshaped",
    "same_shape",
    "restore_stage",
    "stage_checkpointer",
]


def checkpoint_root(cfg: RunConfig, out_dir: Path) -> Path | None:
    """Where the stages write (``checkpoint.dir``, relative to ``out_dir``), or None without
    ``checkpoint``; ConfigError for a schedule or period the pipeline cannot checkpoint."""
    ck = cfg.checkpoint
    if ck is None:
        return None
    if ck.every_steps is None:
        raise ConfigError(
            "checkpoint.every_steps must be set for the pipeline strategy (stages checkpoint the "
            "same flushed step; every_s alone cannot guarantee that)"
        )
    need = keep_needed(cfg, ck.every_steps)
    if ck.keep < need:
        raise ConfigError(
            f"checkpoint.keep must be >= {need} for this pipeline (a stage that finished step N "
            f"must not drop the newest step every stage wrote before the others wrote N); got {ck.keep}"
        )
    root = Path(ck.dir)
    return root if root.is_absolute() else out_dir / root


DEFAULT_EVERY_STEPS = 10  # the default cadence (job.auto_checkpoint): cost measured in docs/checkpoints.md
DEFAULT_KEEP = 2
DEFAULT_DIR = "checkpoints"


def keep_needed(cfg: RunConfig, every_steps: int) -> int:
    """The fewest checkpoints a stage keeps so that the newest step every stage wrote survives
    (module doc): 2, and for PipeDream, whose stages update up to ``num_stages - 1`` steps apart,
    one more per ``every_steps`` of that lag."""
    settings = pipeline_strategy(cfg)
    if ScheduleKind(settings.schedule).flushes:
        return 2
    return 2 + (settings.num_stages - 1) // max(1, every_steps)


def default_checkpointing(cfg: RunConfig, out_dir: Path) -> tuple[Path, int, int] | None:
    """``(root, every_steps, keep)`` of the default checkpoints a job without a ``checkpoint``
    section writes (``<out_dir>/checkpoints``, every 10 steps, the 2 newest kept -- PipeDream:
    :func:`keep_needed`), or None: the job has a ``checkpoint`` section or
    ``job.auto_checkpoint`` is false."""
    if cfg.checkpoint is not None or not cfg.job.auto_checkpoint:
        return None
    keep = max(DEFAULT_KEEP, keep_needed(cfg, DEFAULT_EVERY_STEPS))
    return out_dir / DEFAULT_DIR, DEFAULT_EVERY_STEPS, keep


def config_fingerprint(cfg: RunConfig) -> str:
    """The run configuration's checkpoint fingerprint (:meth:`RunConfig.fingerprint`)."""
    return cfg.fingerprint()


def stage_checkpointer(
    plan: StageCheckpointPlan,
    stage_idx: int,
    layer_ends: list[int],
    losses: list[float],
    split_points: list[str] | None = None,
    scaler: LossScaler | None = None,
) -> Checkpointer:
    """Stage ``stage_idx``'s writer: the one checkpointer (``trainer/checkpointer.py``) into
    ``plan.root/stage<i>``, with the stage's place in the split, its RNG state, (the last
    stage) ``losses``, the training losses so far (the list the stage appends to), and (fp16)
    ``scaler``'s state when it writes."""

    def meta(step: int) -> dict[str, Any]:
        out = {
            "stage_idx": stage_idx,
            "layer_ends": layer_ends,
            "split_points": split_points,
            "losses": losses[:step],
        }
        if scaler is not None:
            out["loss_scale"] = scaler.state_dict()
        return out

    where = plan.root / f"stage{stage_idx}"
    return Checkpointer(  # (written in the background: the stage waits only for the copy)
        CheckpointPlan(directory=where, keep=plan.keep, fingerprint=plan.fingerprint),
        meta=meta,
        rng=True,
        background=True,
    )


def _steps_of(directory: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in list_checkpoints(directory)}


def resume_point(resume_dir: Path, fingerprint: str) -> tuple[int, list[int], list[str] | None]:
    """``(step, layer_ends, split_points)`` of the newest step every stage of the split recorded in
    stage 0's checkpoint of that step wrote, with that same split, under ``resume_dir`` (a step
    whose stages are missing or record other splits -- checkpoints of two runs of different
    shapes in one directory -- is passed over for an older one), each checkpoint verified;
    CheckpointError (one line, naming each step passed over) when there is none."""
    seen = []
    for step in sorted(_steps_of(resume_dir / "stage0"), reverse=True):
        first = load_stage(resume_dir, 0, step, fingerprint)
        ends, points = first.meta.get("layer_ends"), first.meta.get("split_points")
        if not isinstance(ends, list) or not ends:
            raise CheckpointError(f"checkpoint {first.path}: records no split")
        stages = range(1, len(ends))
        missing = [i for i in stages if step not in _steps_of(resume_dir / f"stage{i}")]
        if missing:
            seen.append(
                f"step {step}: {len(ends)} stages, missing in " + ", ".join(f"stage{i}" for i in missing)
            )
            continue
        other = [
            i
            for i in stages
            if (m := load_stage(resume_dir, i, step, fingerprint).meta).get("layer_ends") != ends
            or m.get("split_points") != points
        ]
        if other:  # (a newer split's stage 0 beside an older split's stage i: not one checkpoint)
            seen.append(
                f"step {step}: the stages record different splits ({', '.join(f'stage{i}' for i in other)})"
            )
            continue
        return step, [int(e) for e in ends], points
    raise CheckpointError(
        f"resume {resume_dir}: no step checkpointed by all stages of its split ("
        + ("; ".join(seen) if seen else "stage0: none")
        + ")"
    )


def same_shape(cfg: RunConfig, resume: ResumePoint) -> bool:
    """Whether the job cuts the model as the checkpoint did (same stage count and layers)."""
    points = pipeline_strategy(cfg).split_points
    return len(resume.layer_ends) == pipeline_strategy(cfg).num_stages and resume.split_points == (
        tuple(points) if points is not None else None
    )


def load_stage(resume_dir: Path, stage_idx: int, step: int, fingerprint: str) -> Checkpoint:
    """Stage ``stage_idx``'s verified checkpoint of ``step``."""
    path = resume_dir / f"stage{stage_idx}" / f"ckpt-{step:09d}"
    ckpt = load_checkpoint(path, fingerprint=fingerprint)
    if ckpt.meta.get("stage_idx") != stage_idx:
        raise CheckpointError(f"checkpoint {path}: written by stage {ckpt.meta.get('stage_idx')}")
    if "model" not in ckpt.parts:  # (the launcher's resume check sees it before any stage starts)
        raise CheckpointError(
            f"checkpoint {path}: written in the stage layout before the one checkpointer "
            "(parts 'state', 'rng'); this version cannot load it: start a new checkpoint.dir"
        )
    return ckpt


def restore_stage(ckpt: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """Load a stage checkpoint into ``module``/``optimizer`` and torch's RNG; returns the losses so far."""
    load_into(ckpt, module, optimizer)
    return [float(v) for v in ckpt.meta.get("losses", [])]


def restore_reshaped(
    resume: ResumePoint,
    old_layers: nn.Sequential,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[list[float], Mapping[str, Any] | None, dict[str, Any] | None]:
    """Restore ``module``/``optimizer`` (a stage of the new split) from the checkpoints of the old
    split ``resume.layer_ends`` of ``old_layers`` (layers sharing the model's parameters with the
    new split); returns the losses so far, the LR scheduler's state and the loss scale's (fp16;
    else None: module doc)."""
    mine = list(module.parameters())
    ids = {id(p) for p in mine}
    losses: list[float] = []
    scheduler: Mapping[str, Any] | None = None
    scale: dict[str, Any] | None = None
    rng = None
    for i, part in enumerate(split_sequential(old_layers, list(resume.layer_ends))):
        ckpt = load_stage(resume.dir, i, resume.step, resume.fingerprint)
        old_opt = make_optimizer(part)
        got = restore_stage(ckpt, part, old_opt)  # the weights land in the shared parameters
        losses = got if len(got) > len(losses) else losses
        scheduler = ckpt.scheduler if scheduler is None else scheduler
        scale = ckpt.meta.get("loss_scale") if scale is None else scale
        held = [p for p in part.parameters() if id(p) in ids]
        for p in held:
            if p in old_opt.state:
                optimizer.state[p] = old_opt.state[p]
        if rng is None and (not mine or any(p is mine[0] for p in held)):
            rng = ckpt.parts["rng"]["torch"]
    if rng is not None:
        torch.set_rng_state(rng)
    return losses, scheduler, scale


def restore_loss_scale(scaler: LossScaler | None, state: Mapping[str, Any] | None) -> None:
    """Give ``scaler`` (fp16's) the loss scale a stage checkpoint recorded (``meta["loss_scale"]``);
    nothing without a scaler or a recorded scale (a checkpoint of another precision has another
    fingerprint: it is never resumed here)."""
    if scaler is not None and state is not None:
        scaler.load_state_dict(dict(state))
