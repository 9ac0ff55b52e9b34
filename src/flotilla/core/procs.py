"""A child process started by a launcher: the record ``kill_all`` and the supervisors share."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Child"]


@dataclass(slots=True)
class Child:
    """A started role process (worker, server or pipeline stage) and where its log goes."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    exit_handled: bool = False
