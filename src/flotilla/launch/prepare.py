"""Checks and paths of a job, done by the launcher before any process starts.

- The task is built and tried once (:func:`check_job_task`): a task that does not import, lacks a
  method, or whose model output does not fit its loss stops the run with one line, before a
  single child process exists.
- The run's directories (:func:`job_files`): ``output_dir`` (the report directory, else the run
  directory) receives ``model.safetensors``; ``checkpoint_dir`` is ``--resume DIR`` when resuming,
  else ``checkpoint.dir`` (relative to ``output_dir``).
- A resume is checked before anything starts (another configuration's checkpoints, a truncated
  file, an empty directory: one line each), and a fresh run refuses a checkpoint directory that
  already holds checkpoints, so nothing is overwritten by accident.
"""

from __future__ import annotations

from pathlib import Path

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.elastic.checkpoint import latest_checkpoint, list_checkpoints
from flotilla.trainer import builders
from flotilla.trainer.task_load import check_task

__all__ = ["check_job_task", "job_files", "refuse_existing"]


def check_job_task(cfg: RunConfig) -> int:
    """Check every worker's device (a GPU type needs CUDA here and strategy allreduce), build the
    job's task, its model and data once, run the loss on two samples; the job's number of steps
    (``job.steps``, or ``job.epochs`` over the task's training data)."""
    for worker in cfg.cluster.resolved_workers():
        builders.worker_device(cfg, worker.name)
    task = builders.build_task(cfg)
    train, _ = builders.build_task_data(task)
    check_task(task, builders.build_task_model(cfg, task), train, cfg.job.task_spec()[0])
    return builders.total_steps(cfg, builders.task_sampler(cfg, train))


def refuse_existing(root: Path, directories: list[Path]) -> None:
    """A fresh run must not write into (and prune) another run's checkpoints under ``root``."""
    for directory in directories:
        found = list_checkpoints(directory)
        if found:
            raise ConfigError(
                f"checkpoint.dir {root} already holds checkpoints ({found[-1]}): "
                f"continue with --resume {root}, or choose another checkpoint.dir"
            )


def job_files(
    cfg: RunConfig, *, output_dir: Path, resume_dir: Path | None, total_steps: int
) -> dict[str, str | None]:
    """The directories the workers need (see the module doc), checked; absolute, since workers
    may start in another directory.  ``total_steps``: the job's length (from :func:`check_job_task`)."""
    output_dir = output_dir.resolve()
    resume_dir = resume_dir.resolve() if resume_dir is not None else None
    checkpoint_dir: Path | None = None
    if resume_dir is not None:
        ckpt = latest_checkpoint(resume_dir, fingerprint=cfg.fingerprint())
        checkpoint_dir = resume_dir
        if ckpt.step >= total_steps:
            raise ConfigError(
                f"--resume {resume_dir}: its newest checkpoint is at step {ckpt.step}, the job has "
                f"{total_steps} steps: nothing left to train"
            )
    elif cfg.checkpoint is not None:
        checkpoint_dir = Path(cfg.checkpoint.dir)
        if not checkpoint_dir.is_absolute():
            checkpoint_dir = output_dir / checkpoint_dir
        refuse_existing(checkpoint_dir, [checkpoint_dir])
    return {
        "output_dir": str(output_dir),
        "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir is not None else None,
        "resume_dir": str(resume_dir) if resume_dir is not None else None,
    }
