"""``coordinator.json``: where ``flotilla run`` tells its workers (and tools) how to reach its
coordinator: ``{"address", "secret_file", "pid"}``, written atomically (written, fsynced,
renamed) once the job has passed its checks and the coordinator listens.

The launcher starts its workers BEFORE that, so that each one imports torch while the launcher
checks the job (two interpreters' start-up at once instead of one after the other); a worker
then waits here for the file.  A worker whose launcher dies is killed with it (the supervisor's
PR_SET_PDEATHSIG), so the wait needs no other way out than its time limit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flotilla.core.errors import FlotillaError

__all__ = ["FILE_NAME", "await_coordinator_file", "read_coordinator_file"]

FILE_NAME = "coordinator.json"


def read_coordinator_file(run_dir: Path) -> dict:
    path = Path(run_dir) / FILE_NAME
    if not path.exists():
        raise FlotillaError(f"{path} not found: is `flotilla run --run-dir {run_dir}` running?")
    return json.loads(path.read_text())


def await_coordinator_file(path: Path, *, timeout_s: float = 600.0, poll_s: float = 0.005) -> dict:
    """The contents of ``path`` once it exists (it appears whole: renamed into place)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise FlotillaError(f"{path} did not appear within {timeout_s:.0f} s: no coordinator to join")
        time.sleep(poll_s)
    info = json.loads(path.read_text())
    if not isinstance(info, dict) or not isinstance(info.get("address"), str):
        raise FlotillaError(f"{path}: not a coordinator file (no address)")
    return info
