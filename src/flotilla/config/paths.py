"""Paths inside a run configuration that are relative to the configuration file."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["resolve_strategy_path", "resolve_task_path"]


def resolve_task_path(data: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """Make a relative ``job.task`` file path (``"./my_task.py:Class"``) absolute, relative to
    ``base_dir`` (the config file's directory) if the file is there, else to the current directory:
    every process of the run then finds the same file wherever it starts."""
    job = data.get("job")
    if not isinstance(job, dict) or not isinstance(job.get("task"), str):
        return data
    return {**data, "job": {**job, "task": _absolute(job["task"], base_dir)}}


def resolve_strategy_path(data: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """The same for a user's strategy named by file (``strategy.kind: "./my_strategy.py:SPEC"``)."""
    st = data.get("strategy")
    if not isinstance(st, dict) or not isinstance(st.get("kind"), str):
        return data
    return {**data, "strategy": {**st, "kind": _absolute(st["kind"], base_dir)}}


def _absolute(name: str, base_dir: str) -> str:
    where, sep, attr = name.rpartition(":")
    if not sep or not where.endswith(".py") or os.path.isabs(where):
        return name
    for root in (base_dir, os.getcwd()):
        candidate = os.path.normpath(os.path.join(root, where))
        if os.path.isfile(candidate):
            return f"{candidate}:{attr}"
    return name
