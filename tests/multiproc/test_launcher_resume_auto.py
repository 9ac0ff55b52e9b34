"""A dead launcher (it hosts the coordinator): SIGKILL it mid-run -- its workers die with it --
then ``flotilla run CONFIG --report R --resume auto`` finds the job's newest checkpoint under
``R`` by itself, says where, and completes the job; ``--resume auto`` with nothing to resume from
is one line naming where it looked (tests/unit/test_resume_auto.py).  The fault is handed in by
the test (it kills the launcher)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from flotilla.elastic.checkpoint import list_checkpoints

from ._jobs import processes_mentioning, start, stop, wait_for

pytestmark = pytest.mark.timeout(200)

SETS = [
    "--set", "job.steps=60",
    "--set", "job.eval_every_steps=0",
    "--set", "checkpoint.every_steps=5",
    "--set", "cluster.defaults.speed=0.05",  # steps of tens of ms: the kill lands mid-run
]  # fmt: skip


def _run(tmp_path: Path, name: str, *extra: str):
    args = ["run", "examples/tiny.yaml", "--report", str(tmp_path / "report"), "--no-progress"]
    return start([*args, "--run-dir", str(tmp_path / name), *SETS, *extra], tmp_path / f"{name}.log")


def test_a_killed_launcher_is_resumed_by_resume_auto(tmp_path: Path) -> None:
    ck = tmp_path / "report" / "checkpoints"
    first = _run(tmp_path, "run1")
    try:
        wait_for(lambda: len(list_checkpoints(ck)) >= 2, 150, "two checkpoints")
        os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its workers die with it
        first.wait(timeout=30)
    finally:
        stop(first)
    wait_for(lambda: processes_mentioning(str(tmp_path / "run1")) == [], 30, "the workers' exit")
    killed_at = int(list_checkpoints(ck)[-1].name.split("-")[1])
    assert 0 < killed_at < 60
    second = _run(tmp_path, "run2", "--resume", "auto")
    try:
        assert second.wait(timeout=150) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    finally:
        stop(second)
    assert f"resuming from the checkpoints in {ck.resolve()}" in (tmp_path / "run2.log").read_text()
    logs = "".join(p.read_text() for p in (tmp_path / "run2").glob("w*.log"))
    assert f"at step {killed_at}" in logs  # resumed from the newest checkpoint the first run wrote
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 60
    assert processes_mentioning(str(tmp_path)) == []
