"""Per-stage checkpoints of a pipeline job, and resuming from them.

Each stage writes its own part of the model (its layers' ``state_dict``), its optimizer state,
its RNG state and the step with :func:`flotilla.elastic.checkpoint.write_checkpoint` under
``<root>/stage<i>`` (safetensors + manifest, atomic).  Invariants:

- checkpoints are taken only by flushing schedules (GPipe, 1F1B), at the loop's step boundary
  after a stage's update of minibatch ``k`` (the stage engine's unit is one flush): no microbatch
  of step ``k + 1`` has touched the stage, so its state is exactly "after ``k + 1`` steps".
  PipeDream never flushes and is refused;
- every stage checkpoints the same steps (``checkpoint.every_steps``; a wall-clock period would let
  stages pick different steps, so ``every_s`` alone is refused);
- a resume uses the newest step that EVERY stage has checkpointed, checks each stage's checkpoint
  (digests, config fingerprint) and that all record the same split (``layer_ends``), and keeps that
  split whatever a new profile would choose;
- the last stage's checkpoint carries the training losses so far, so a resumed run reports them
  all; a stage's LR scheduler state (if the job has a schedule) travels in the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    write_checkpoint,
)
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.sync.state import export_state, import_state
from flotilla.trainer.pipeline_job import StageCheckpointPlan
from flotilla.trainer.pipeline_setup import pipeline_strategy

__all__ = [
    "StageCheckpointer",
    "checkpoint_root",
    "config_fingerprint",
    "default_checkpointing",
    "load_stage",
    "resume_point",
    "restore_stage",
]


def checkpoint_root(cfg: RunConfig, out_dir: Path) -> Path | None:
    """Where the stages write (``checkpoint.dir``, relative to ``out_dir``), or None without
    ``checkpoint``; ConfigError for a schedule or period the pipeline cannot checkpoint."""
    ck = cfg.checkpoint
    if ck is None:
        return None
    schedule = pipeline_strategy(cfg).schedule
    if not ScheduleKind(schedule).flushes:
        raise ConfigError(
            f"checkpoint needs a flushing schedule (gpipe, 1f1b); strategy.schedule is {schedule!r}"
        )
    if ck.every_steps is None:
        raise ConfigError(
            "checkpoint.every_steps must be set for the pipeline strategy (stages checkpoint the "
            "same flushed step; every_s alone cannot guarantee that)"
        )
    if ck.keep < 2:
        raise ConfigError(
            "checkpoint.keep must be >= 2 for the pipeline strategy (a stage that finished step N "
            f"must not drop N - every_steps before the others wrote N); got {ck.keep}"
        )
    root = Path(ck.dir)
    return root if root.is_absolute() else out_dir / root


DEFAULT_EVERY_STEPS = 10  # the default cadence (job.auto_checkpoint): cost measured in docs/checkpoints.md
DEFAULT_KEEP = 2
DEFAULT_DIR = "checkpoints"


def default_checkpointing(cfg: RunConfig, out_dir: Path) -> tuple[Path, int, int] | None:
    """``(root, every_steps, keep)`` of the default checkpoints a job without a ``checkpoint``
    section writes (``<out_dir>/checkpoints``, every 10 steps, the 2 newest kept), or None: the
    job has a ``checkpoint`` section, ``job.auto_checkpoint`` is false, or the schedule never
    flushes (PipeDream: nothing to checkpoint)."""
    if cfg.checkpoint is not None or not cfg.job.auto_checkpoint:
        return None
    if not ScheduleKind(pipeline_strategy(cfg).schedule).flushes:
        return None
    return out_dir / DEFAULT_DIR, DEFAULT_EVERY_STEPS, DEFAULT_KEEP


def config_fingerprint(cfg: RunConfig) -> str:
    """The run configuration's checkpoint fingerprint (:meth:`RunConfig.fingerprint`)."""
    return cfg.fingerprint()


@dataclass
class StageCheckpointer:
    """Writes stage ``stage_idx``'s checkpoint of a step (the loop's boundary rule says which:
    every ``plan.every_steps`` committed steps); ``losses``: the last stage's training losses so far."""

    plan: StageCheckpointPlan
    stage_idx: int
    layer_ends: list[int]
    losses: list[float] = field(default_factory=list)

    def write(
        self,
        step: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Mapping[str, Any] | None = None,
    ) -> Path:
        """The state after ``step`` committed steps (a flush boundary); ``scheduler``: the LR
        scheduler's state (``optim.scheduler_state``)."""
        meta, tensors = export_state(module, optimizer, {})
        return write_checkpoint(
            self.plan.root / f"stage{self.stage_idx}",
            step=step,
            parts={
                "state": {f"t{i}": t for i, t in enumerate(tensors)},
                "rng": {"torch": torch.get_rng_state()},
            },
            meta={
                "state": meta,
                "stage_idx": self.stage_idx,
                "layer_ends": self.layer_ends,
                "losses": self.losses[:step],
            },
            fingerprint=self.plan.fingerprint,
            keep=self.plan.keep,
            scheduler=scheduler,
        )


def _steps_of(directory: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in list_checkpoints(directory)}


def resume_point(resume_dir: Path, num_stages: int, fingerprint: str) -> tuple[int, list[int]]:
    """``(step, layer_ends)`` of the newest step every stage checkpointed under ``resume_dir``,
    each stage's checkpoint verified; CheckpointError (one line) when there is none or they differ."""
    per_stage = [_steps_of(resume_dir / f"stage{i}") for i in range(num_stages)]
    common = set.intersection(*per_stage) if per_stage else set()
    if not common:
        found = ", ".join(f"stage{i}: {sorted(s) or 'none'}" for i, s in enumerate(per_stage))
        raise CheckpointError(
            f"resume {resume_dir}: no step checkpointed by all {num_stages} stages ({found})"
        )
    step = max(common)
    ends = [load_stage(resume_dir, i, step, fingerprint).meta.get("layer_ends") for i in range(num_stages)]
    if any(e != ends[0] for e in ends) or not isinstance(ends[0], list):
        raise CheckpointError(
            f"resume {resume_dir}: the stages' checkpoints of step {step} record different splits"
        )
    return step, [int(e) for e in ends[0]]


def load_stage(resume_dir: Path, stage_idx: int, step: int, fingerprint: str) -> Checkpoint:
    """Stage ``stage_idx``'s verified checkpoint of ``step``."""
    path = resume_dir / f"stage{stage_idx}" / f"ckpt-{step:09d}"
    ckpt = load_checkpoint(path, fingerprint=fingerprint)
    if ckpt.meta.get("stage_idx") != stage_idx:
        raise CheckpointError(f"checkpoint {path}: written by stage {ckpt.meta.get('stage_idx')}")
    return ckpt


def restore_stage(ckpt: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """Load a stage checkpoint into ``module``/``optimizer`` and torch's RNG; returns the losses so far."""
    state = ckpt.parts["state"]
    try:
        import_state(module, optimizer, ckpt.meta["state"], [state[f"t{i}"] for i in range(len(state))])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt.path}: does not fit this stage ({exc})") from exc
    torch.set_rng_state(ckpt.parts["rng"]["torch"])
    return [float(v) for v in ckpt.meta.get("losses", [])]
