"""Checks and paths of a job, done by the launcher before any process starts.

- The task is built and tried once (:func:`check_job_task`): a task that does not import, lacks a
  method, or whose model output does not fit its loss stops the run with one line, before a
  single child process exists.
- The run's directories (:func:`job_files`): ``output_dir`` (the report directory, else the run
  directory) receives ``model.safetensors``; ``checkpoint_dir`` is ``--resume DIR`` when resuming,
  else ``checkpoint.dir`` (relative to ``output_dir``).
- A resume is checked before anything starts (another configuration's checkpoints, a truncated
  file, an empty directory: one line each), and a fresh run refuses a checkpoint directory that
  already holds checkpoints, so nothing is overwritten by accident.  The default checkpoints
  (``job.auto_checkpoint``) are not refused: a fresh run moves a previous run's aside to
  ``<dir>.prev`` (:func:`set_aside_previous`; one previous set is kept, an older one is removed).
  A checkpoint whose manifest records the settings it was written with (``meta["config"]`` =
  :func:`fingerprinted_config`) is refused naming the settings that changed
  (:func:`config_changes`), not two digests.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.elastic.checkpoint import MANIFEST, latest_checkpoint, list_checkpoints
from flotilla.report.headline import headline_of
from flotilla.trainer import builders, optim
from flotilla.trainer.builders import sync_config_of
from flotilla.trainer.task_load import TaskData, check_task, evaluate_task

__all__ = [
    "check_job_task",
    "find_resume_dir",
    "config_changes",
    "fingerprinted_config",
    "job_files",
    "refuse_changed_config",
    "refuse_existing",
    "set_aside_previous",
]

_MAX_CHANGES_SHOWN = 6

log = get_logger("launcher")


def check_job_task(cfg: RunConfig) -> int:
    """Build the job's task, its model and data once, run the loss on a few samples (``check_task``: it fits,
    does not broadcast outputs against targets, is a scalar); the job's number of steps
    (``job.steps``, or ``job.epochs`` over the task's training data).  A task's
    ``configure_optimizer`` hook is called once and the schedule checked (``optim.check_optimizer``),
    so a bad hook or schedule is refused before anything starts.  Part of the one validation
    (``launch/validation.py``); the workers' devices are its host check."""
    task = builders.build_task(cfg)
    train, _ = builders.build_task_data(task)
    model = builders.build_task_model(cfg, task)
    check_task(task, model, train, cfg.job.task_spec()[0])
    x, y = train.batch([0, 1])  # the headline the task declares must be one of its results
    probe = evaluate_task(task, model, TaskData((x, y)))
    try:
        headline_of(task, [k for k, v in probe.items() if v is not None])
    except ValueError as exc:
        raise ConfigError(f"task {cfg.job.task_spec()[0]}: {exc}") from None
    total = builders.total_steps(cfg, builders.task_sampler(cfg, train))
    optim.check_optimizer(cfg, model, task, total_steps=total)  # a bad hook or schedule: refused now
    if cfg.strategy_spec.build is not None:  # what the workers' strategy is built from (ps: a cosine
        sync_config_of(cfg, total)  # schedule's end, the update rule): refused now, not in a worker
    return total


def fingerprinted_config(cfg: RunConfig) -> dict[str, Any]:
    """The settings :meth:`RunConfig.fingerprint` digests (the job without its length and
    evaluation period, the strategy without its timeouts), as plain JSON data: what a checkpoint
    records (``meta["config"]``) so that a resume with other settings can name them."""
    return cfg.fingerprint_data()


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, sort_keys=True)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The settings that differ between two configuration dicts, one ``"a.b.c: OLD -> NEW"`` per
    dotted key (sorted; a key missing on one side reads as ``unset``)."""
    before, after = _flatten(old), _flatten(new)
    return [
        f"{key}: {_shown(before.get(key))} -> {_shown(after.get(key))}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    ]


def refuse_changed_config(directory: Path, cfg: RunConfig, *, shown: Path | None = None) -> None:
    """A :class:`ConfigError` naming the changed settings when the newest checkpoint under
    ``directory`` was written by another configuration and records its settings; nothing
    otherwise (the checkpoint loader reports a missing, unreadable or older checkpoint)."""
    found = list_checkpoints(directory)
    try:
        manifest = json.loads((found[-1] / MANIFEST).read_text()) if found else {}
    except (OSError, ValueError):
        return
    if not isinstance(manifest, dict) or manifest.get("fingerprint") in (None, cfg.fingerprint()):
        return
    old = manifest.get("meta", {}).get("config") if isinstance(manifest.get("meta"), dict) else None
    changes = config_changes(old, fingerprinted_config(cfg)) if isinstance(old, dict) else []
    if not changes:
        return
    more = len(changes) - _MAX_CHANGES_SHOWN
    listed = "; ".join(changes[:_MAX_CHANGES_SHOWN]) + (f"; and {more} more" if more > 0 else "")
    raise ConfigError(
        f"--resume {shown or directory}: {found[-1].name} was written with other settings ({listed}); "
        "resume with the settings it was written with, or start afresh with another checkpoint.dir"
    )


def refuse_existing(root: Path, directories: list[Path]) -> None:
    """A fresh run must not write into (and prune) another run's checkpoints under ``root``."""
    for directory in directories:
        found = list_checkpoints(directory)
        if found:
            raise ConfigError(
                f"checkpoint.dir {root} already holds checkpoints ({found[-1]}): "
                f"continue with --resume {root}, or choose another checkpoint.dir"
            )


RESUME_AUTO = "auto"


def find_resume_dir(cfg: RunConfig, output_dir: Path | None) -> Path:
    """``--resume auto``: the job's own checkpoint directory under ``output_dir`` (the report
    directory, else the run directory) -- ``checkpoint.dir``, or the default ``checkpoints`` --
    when it holds a checkpoint (a pipeline's: under ``stage<i>/``; strategy ps: its shards'
    ``ps-snapshots``); ConfigError naming where it looked otherwise.  The newest complete
    checkpoint in it is picked (and checked) as for ``--resume DIR``."""
    if cfg.launch_plan().num_servers or _plug_keeps_checkpoints(cfg):  # (ps, hetpipe: shards' snapshots)
        return _find_ps_snapshots(output_dir)
    where = Path(cfg.checkpoint.dir) if cfg.checkpoint is not None else Path("checkpoints")
    if not where.is_absolute():
        if output_dir is None:
            raise ConfigError(
                "--resume auto needs the run's --report directory (or --run-dir without --report) to "
                "find its checkpoints; or name the directory: --resume DIR"
            )
        where = Path(output_dir) / where
    if list_checkpoints(where) or any(list_checkpoints(d) for d in sorted(where.glob("stage*"))):
        return where
    raise ConfigError(f"--resume auto: no checkpoint under {where}; name the directory: --resume DIR")


def _plug_keeps_checkpoints(cfg: RunConfig) -> bool:
    from flotilla.sync.stage_plug import stage_plug

    plug = stage_plug(cfg)
    return plug is not None and plug.keeps_checkpoints


def _find_ps_snapshots(output_dir: Path | None) -> Path:
    from flotilla.ps.snapshot_sets import SUBDIR, find_snapshots

    if output_dir is None:
        raise ConfigError(
            "--resume auto needs the run's --report directory (or --run-dir without --report) to find "
            "its parameter-server snapshots; or name the directory: --resume DIR"
        )
    where = Path(output_dir) / SUBDIR
    found = find_snapshots(where)
    if found is None:
        raise ConfigError(
            f"--resume auto: no parameter-server snapshot under {where}; name the directory: --resume DIR"
        )
    return found


def set_aside_previous(directory: Path, *, has_checkpoints: bool | None = None) -> Path | None:
    """A fresh run's default checkpoints go where a previous run's went: those are moved aside to
    ``<directory>.prev`` (replacing an older set there: one previous set is kept), and said;
    returns where they went (None: ``directory`` held no checkpoint).  ``has_checkpoints``: the
    caller already looked (a pipeline's are under ``stage<i>/``)."""
    found = bool(list_checkpoints(directory)) if has_checkpoints is None else has_checkpoints
    if not found:
        return None
    aside = directory.with_name(directory.name + ".prev")
    if aside.exists():
        shutil.rmtree(aside)
    directory.rename(aside)
    log.warning("a fresh run: the previous run's checkpoints in %s moved aside to %s", directory, aside)
    return aside


def job_files(
    cfg: RunConfig,
    *,
    output_dir: Path,
    resume_dir: Path | None,
    total_steps: int,
    default_checkpoints: bool = False,
) -> dict[str, str | None]:
    """The directories the workers need (see the module doc), checked; absolute, since workers
    may start in another directory.  ``total_steps``: the job's length (from :func:`check_job_task`).
    ``default_checkpoints``: ``cfg.checkpoint`` is the launcher's default, not the user's: a fresh
    run moves a previous run's checkpoints aside (:func:`set_aside_previous`) instead of refusing
    to start."""
    output_dir = output_dir.resolve()
    resume_dir = resume_dir.resolve() if resume_dir is not None else None
    checkpoint_dir: Path | None = None
    if resume_dir is not None:
        refuse_changed_config(resume_dir, cfg)
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
        if default_checkpoints:
            set_aside_previous(checkpoint_dir)
        else:
            refuse_existing(checkpoint_dir, [checkpoint_dir])
    return {
        "output_dir": str(output_dir),
        "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir is not None else None,
        "resume_dir": str(resume_dir) if resume_dir is not None else None,
    }
