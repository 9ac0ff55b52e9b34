"""What a data-parallel worker writes and reads on disk: checkpoints, resume, the exported model.

The launcher tells every worker (in the coordinator's join reply, ``files``) where the run's
output goes (``output_dir``: the report directory, else the run directory), where checkpoints go
(``checkpoint_dir``) and where to resume from (``resume_dir``).

- **Checkpoints** (strategy ``allreduce``): rank 0 writes the committed state -- the model's
  ``state_dict``, the optimizer state and its learning-rate schedule's state, and the step (= the
  sampler's position: the global-batch sampler is a pure function of the step; randomness is
  seeded per unit from the step, so no RNG state is needed) -- when the loop's boundary rule
  says so (``trainer/boundary.py``: every ``checkpoint.every_steps``-th committed step and/or
  once ``checkpoint.every_s`` seconds passed since the last one), with the settings the config
  fingerprint covers (``trainer/checkpointer.py``, the writer stages use too:
  safetensors + manifest, atomic, keep N).
  Every replica holds the same committed state, so one writer suffices -- except a strategy's
  *local* state (``SyncStrategy.local_state_dict``, e.g. DiLoCo's inner optimizer state, which
  differs between workers): at the same steps every rank writes its own beside the checkpoints
  (``local/step-<step>/rank-<rank>.safetensors``, with the view's size).
- **Resume**: every worker loads the newest checkpoint of ``resume_dir`` (verified: same config
  fingerprint, complete files) before its first view, and its strategy takes back the local state
  its rank saved at that step when the view has the same size (else rank 0's, with a warning);
  the replicas then agree as usual. With
  ``on_abort: redo`` a resumed run commits exactly the steps an uninterrupted run would, so its
  final weights are bitwise equal.
- **Export**: the worker that reports the job's result writes ``model.safetensors`` (the final
  weights as one plain ``state_dict`` of the user's model) into ``output_dir``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save
from torch import nn

from flotilla.config import RunConfig
from flotilla.core.atomic_io import atomic_write_bytes, atomic_write_json
from flotilla.core.log import get_logger
from flotilla.elastic.checkpoint import (
    Checkpoint,
    export_model,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from flotilla.trainer.checkpointer import Checkpointer, CheckpointPlan, load_into
from flotilla.trainer.optim import OptimizerBundle, restore_scheduler

log = get_logger("worker.files")

MODEL_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobFiles:
    output_dir: Path | None = None
    checkpoint_dir: Path | None = None
    resume_dir: Path | None = None

    @classmethod
    def from_reply(cls, raw: Any) -> JobFiles:
        raw = raw if isinstance(raw, dict) else {}

        def path(key: str) -> Path | None:
            value = raw.get(key)
            return Path(value) if isinstance(value, str) and value else None

        return cls(
            output_dir=path("output_dir"),
            checkpoint_dir=path("checkpoint_dir"),
            resume_dir=path("resume_dir"),
        )


def checkpointer(cfg: RunConfig, files: JobFiles) -> Checkpointer:
    """Rank 0's checkpoint writer (``trainer/checkpointer.py``: the one writer of stages and
    replicas): ``checkpoint.dir`` with the settings the config fingerprint covers, written in the
    background (training waits only for the copy to host memory); disabled without a
    ``checkpoint`` section or a directory."""
    ck = cfg.checkpoint
    if ck is None or files.checkpoint_dir is None:
        return Checkpointer(None)
    return Checkpointer(
        CheckpointPlan(
            directory=files.checkpoint_dir,
            keep=ck.keep,
            fingerprint=cfg.fingerprint(),
            settings=cfg.fingerprint_data(),  # recorded: a resume with other settings names them
        ),
        background=True,
    )


@dataclass(slots=True)
class Restored:
    """A checkpoint loaded into the model and optimizer: its step, the strategy's own state (for
    the strategy the worker builds next, or holds: ``SyncStrategy.load_state_dict``) and where it
    was (the ranks' local states lie beside it: :func:`read_local_state`)."""

    step: int
    strategy: dict[str, torch.Tensor] = field(default_factory=dict)
    directory: Path | None = None


LOCAL_DIR = "local"  # beside the checkpoints: local/step-<step>/rank-<rank>.safetensors


def _local_path(directory: Path, step: int, rank: int) -> Path:
    return directory / LOCAL_DIR / f"step-{step:09d}" / f"rank-{rank}.safetensors"


def write_local_state(
    directory: Path, step: int, rank: int, world_size: int, state: Mapping[str, torch.Tensor], keep: int
) -> Path:
    """Rank ``rank``'s own state at ``step`` (``SyncStrategy.local_state_dict``), atomically, with
    the view's size; keeps the ``keep + 1`` newest steps of this rank."""
    path = _local_path(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    atomic_write_bytes(path, st_save(plain, metadata={"world_size": str(world_size), "step": str(step)}))
    steps = sorted((directory / LOCAL_DIR).glob("step-*"))
    for old in steps[: max(0, len(steps) - keep - 1)]:
        (old / f"rank-{rank}.safetensors").unlink(missing_ok=True)
        try:
            old.rmdir()
        except OSError:  # another rank's file is still there, or another rank removed it first
            pass
    return path


def read_local_state(
    directory: Path, step: int, rank: int, world_size: int
) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s local state saved at ``step`` in a view of ``world_size`` (None: there is
    none, or it was saved by a view of another size)."""
    path = _local_path(directory, step, rank)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("world_size") != str(world_size):
            return None
        return {k: f.get_tensor(k) for k in f.keys()}  # (safe_open has no __iter__)


def restore(cfg: RunConfig, files: JobFiles, model: nn.Module, opt: OptimizerBundle) -> Restored | None:
    """Load the newest checkpoint of ``files.resume_dir`` into ``model``, the optimizer and its
    schedule.  (No RNG state: every unit seeds its own, ``trainer/replica.unit_seed``.)"""
    if files.resume_dir is None:
        return None
    return restore_from(cfg, files.resume_dir, model, opt)


def restore_lost(cfg: RunConfig, files: JobFiles, model: nn.Module, opt: OptimizerBundle) -> Restored | None:
    """Every replica is gone mid-run: the newest checkpoint this job wrote, or None."""
    if cfg.checkpoint is None or files.checkpoint_dir is None or not list_checkpoints(files.checkpoint_dir):
        return None
    return restore_from(cfg, files.checkpoint_dir, model, opt)


def _complete_local(directory: Path, step: int) -> bool:
    """Whether every rank of the view that saved local state at ``step`` did (no local state at
    all is complete too)."""
    where = directory / LOCAL_DIR / f"step-{step:09d}"
    files = sorted(where.glob("rank-*.safetensors"))
    if not files:
        return not (directory / LOCAL_DIR).is_dir()
    try:
        with safe_open(str(files[0]), framework="pt") as f:
            world = int((f.metadata() or {}).get("world_size", "0"))
    except Exception:
        return False
    return {p.name for p in files} >= {f"rank-{r}.safetensors" for r in range(world)}


def _newest_complete(directory: Path, fingerprint: str) -> Checkpoint:
    """The newest checkpoint whose ranks all saved their local state (a kill while they wrote it
    leaves the checkpoint of rank 0 without them: it is not complete); else the newest."""
    for path in reversed(list_checkpoints(directory)):
        step = int(path.name.split("-")[1])
        if _complete_local(directory, step):
            return load_checkpoint(path, fingerprint=fingerprint)
    return latest_checkpoint(directory, fingerprint=fingerprint)


def restore_from(cfg: RunConfig, directory: Path, model: nn.Module, opt: OptimizerBundle) -> Restored:
    ckpt = _newest_complete(directory, cfg.fingerprint())
    step = load_into(ckpt, model, opt.optimizer)
    restore_scheduler(opt, ckpt.scheduler)
    log.info("resumed from %s at step %d", ckpt.path, step)
    return Restored(step, dict(ckpt.parts.get("strategy", {})), directory)


def export(files: JobFiles, model: nn.Module) -> Path | None:
    """Write ``model.safetensors`` into the run's output directory (if it has one)."""
    if files.output_dir is None:
        return None
    return export_model(files.output_dir / MODEL_FILE, model.state_dict())


RESULT_FILE = "result.json"


def write_result(files: JobFiles, result: dict[str, Any]) -> Path | None:
    """The job's result, when no coordinator is left to receive it: ``result.json`` in the run's
    output directory (atomic)."""
    if files.output_dir is None:
        return None
    path = files.output_dir / RESULT_FILE
    atomic_write_json(path, result)
    return path
