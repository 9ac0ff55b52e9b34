"""Paths inside a run configuration that are relative to the configuration file."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["resolve_task_path"]


def resolve_task_path(data: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """Make a relative ``job.task`` file path (``"./my_task.py:Class"``) absolute, relative to
    ``base_dir`` (the config file's directory) if the file is there, else to the current directory:
    every process of the run then finds the same file wherever it starts."""
    job = data.get("job")
    if not isinstance(job, dict) or not isinstance(job.get("task"), str):
        return data
    task = job["task"]
    if not isinstance(task, str):
        return data
    where, sep, attr = task.rpartition(":")
    if not sep or not where.endswith(".py") or os.path.isabs(where):
        return data
    for root in (base_dir, os.getcwd()):
        candidate = os.path.normpath(os.path.join(root, where))
        if os.path.isfile(candidate):
            return {**data, "job": {**job, "task": f"{candidate}:{attr}"}}
    return data
