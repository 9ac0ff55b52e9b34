"""The public Python surface: build or load a configuration and run it with your task.

``import flotilla`` re-exports these names::

    import flotilla
    from my_task import Digits                      # a class with the task methods (docs/tasks.md)

    cfg = {"cluster": {"num_workers": 2},                # or a YAML file's path, or make_config(...)
           "job": {"batch_size": 64, "steps": 300},     # (no job.task: run's task= gives it)
           "strategy": {"kind": "allreduce"}}
    summary = flotilla.run(cfg, task=Digits(width=64), report_dir="runs/digits")
    print(summary["test_accuracy"], summary["model_file"])

:func:`run` starts the same processes with the same guarantees as ``flotilla run`` (a coordinator,
worker/server/stage processes, a supervisor that reaps them all) and returns the run's summary.
A task object never crosses a process boundary: every process rebuilds it from its class's name
and its keyword arguments (``Task`` subclasses record them; otherwise pass ``task_args``), so the
class must live in an importable module or a file -- in a script, guard the script's own work
with ``if __name__ == "__main__":`` since every worker imports that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.config import RunConfig, apply_overrides, load_config, validate_config
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.spec import StrategyContext, StrategySettings, StrategySpec
from flotilla.trainer.task_load import require_task, task_name_of

__all__ = [
    "Outcome",
    "Proposal",
    "Regime",
    "StrategyContext",
    "StrategySettings",
    "StrategySpec",
    "SyncStrategy",
    "Traits",
    "make_config",
    "run",
]

Source = str | os.PathLike[str] | Mapping[str, Any] | RunConfig
"""What :func:`make_config` and :func:`run` accept: a YAML path, a mapping or a validated config."""


def make_config(source: Source, overrides: Sequence[str] = ()) -> RunConfig:
    """A validated configuration from a YAML file path, a mapping or a :class:`RunConfig`, with
    ``--set``-style ``overrides`` (``"job.steps=50"``); a :class:`ConfigError` names the field."""
    if isinstance(source, RunConfig):
        return validate_config(apply_overrides(source.to_dict(), overrides)) if overrides else source
    if isinstance(source, Mapping):
        return validate_config(apply_overrides(dict(source), overrides))
    return load_config(source, overrides)


def _task_fields(task: Any, task_args: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``job.task`` and ``job.task_args`` of ``task``: a name (``"module:Class"``/``"file.py:Class"``),
    a class, or an instance (its recorded ``task_args`` are used)."""
    if isinstance(task, str):
        name, args = task, dict(task_args or {})
    elif isinstance(task, type):
        name, args = task_name_of(task), dict(task_args or {})
    else:
        require_task(task, type(task).__name__)
        name = task_name_of(task)
        recorded = getattr(task, "task_args", None)
        if task_args is None and not isinstance(recorded, dict):
            raise ConfigError(
                f"task {type(task).__name__}: pass task_args=... (its constructor's keyword arguments), "
                "or subclass flotilla.Task, which records them"
            )
        args = dict(task_args if task_args is not None else recorded or {})
    return name, args


def _with_task(
    cfg: Source, overrides: Sequence[str], task: Any, task_args: Mapping[str, Any] | None
) -> RunConfig:
    """``cfg`` (with ``overrides``) training ``task`` instead of its own -- or without one of its
    own: a mapping or a file may leave out ``job.task`` / ``job.model`` when ``task`` is given."""
    name, args = _task_fields(task, task_args)
    fields = {"task": name, "task_args": args, "model": None, "dataset": None}
    if not isinstance(cfg, (RunConfig, Mapping)):  # (a file: its relative paths resolved against it)
        return load_config(cfg, [*overrides, *(f"job.{k}={json.dumps(v)}" for k, v in fields.items())])
    data = apply_overrides(cfg.to_dict() if isinstance(cfg, RunConfig) else dict(cfg), overrides)
    data["job"] = {**(data.get("job") or {}), **fields}
    return validate_config(data)


def run(
    cfg: Source,
    *,
    task: Any = None,
    task_args: Mapping[str, Any] | None = None,
    report_dir: str | os.PathLike[str] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    resume: str | os.PathLike[str] | None = None,
    progress: bool = False,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Run a job on this machine, as ``flotilla run`` does, and return its summary.

    ``task`` replaces the configuration's task (see :func:`_with_task`); ``report_dir`` receives
    the reports and ``model.safetensors``; ``resume`` continues from a checkpoint directory.
    Raises :class:`FlotillaError` (one line) if the configuration, the task or the run fails.
    """
    from flotilla.launch.local import Launcher, write_reports

    run_cfg = make_config(cfg, overrides) if task is None else _with_task(cfg, overrides, task, task_args)
    report = Path(report_dir) if report_dir is not None else None
    launcher = Launcher(
        run_cfg,
        report_dir=report,
        run_dir=Path(run_dir) if run_dir is not None else None,
        progress=progress,
        resume_dir=Path(resume) if resume is not None else None,
    )
    result = launcher.run()
    if report is not None:
        write_reports(report, result.summary)
    if result.exit_code != 0 or not result.summary.get("completed"):
        raise FlotillaError(
            f"the run did not complete (exit code {result.exit_code}); logs: {result.run_dir}"
        )
    return dict(result.summary, run_dir=str(result.run_dir))
