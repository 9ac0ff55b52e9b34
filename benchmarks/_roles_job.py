"""A job whose roles are started by hand -- ``flotilla coordinator`` and one ``flotilla worker`` per
member, each its own process (no launcher, whose death would take the workers with it) -- so that
the coordinator can be SIGKILLed alone.  Used by ``crash_recovery.py --coordinator dead``.

Records: the coordinator's ``metrics.jsonl`` while it lived, then each worker's spooled
``records-<name>.jsonl`` beside it (``roles/link.py``: what the coordinator could no longer
receive); :func:`records` merges both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import Children, python
from flotilla.comm.auth import generate_secret, read_secret_file, write_secret_file
from flotilla.report.metrics import read_run_records
from flotilla.roles.coordinator_clock import coordinator_t0_unix

ROOT = Path(__file__).resolve().parents[1]
GONE_LINE = "coordinator's process is gone"


@dataclass
class RolesJob:
    job_dir: Path
    report: Path
    secret: Path
    coordinator: subprocess.Popen
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    address: str = ""

    def poll(self) -> int | None:
        """None while a worker runs (the job goes on without its coordinator); else 0."""
        return None if any(p.poll() is None for p in self.workers.values()) else 0


def _spawn(args: list[str], log: Path, children: Children) -> subprocess.Popen:
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [python(), "-m", "flotilla.cli.main", *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    children.procs.append(proc)
    return proc


def start(sets: dict[str, Any], world: int, job_dir: Path, children: Children, timeout_s: float) -> RolesJob:
    report, secret = job_dir / "report", job_dir / "secret"
    write_secret_file(secret, generate_secret())
    set_args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    coord_log = job_dir / "coordinator.log"
    args = [
        "coordinator",
        str(ROOT / "examples/tiny.yaml"),
        "--secret-file",
        str(secret),
        "--report",
        str(report),
    ]
    coord = _spawn([*args, *set_args], coord_log, children)
    job = RolesJob(job_dir, report, secret, coord)
    deadline = time.monotonic() + timeout_s
    while "listening on" not in coord_log.read_text(errors="replace"):
        if coord.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(
                f"the coordinator did not start:\n{coord_log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.05)
    job.address = coord_log.read_text().split("listening on", 1)[1].split()[0]
    for i in range(world):
        name = f"w{i}"
        wargs = ["worker", "--coordinator", job.address, "--secret-file", str(secret), "--name", name]
        job.workers[name] = _spawn(wargs, job_dir / f"{name}.log", children)
    return job


def t0_unix(job: RolesJob) -> float:
    """The coordinator's t0 (records' ``time_s`` are seconds since it) on this machine's clock."""
    return coordinator_t0_unix(job.address, read_secret_file(job.secret), sender="bench-roles")


def kill_coordinator(job: RolesJob, timeout_s: float) -> bool:
    """SIGKILL the coordinator; True once every worker's log says it noticed."""
    os.killpg(job.coordinator.pid, signal.SIGKILL)
    job.coordinator.wait()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = [(job.job_dir / f"{n}.log").read_text(errors="replace") for n in job.workers]
        if all(GONE_LINE in text for text in logs):
            return True
        time.sleep(0.05)
    return False


def records(report: Path) -> list[dict]:
    return read_run_records(report)


def stop(job: RolesJob) -> None:
    for proc in [job.coordinator, *job.workers.values()]:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
