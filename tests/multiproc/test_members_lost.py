"""``flotilla run`` names the members a job went on without: a worker that crashes mid-run is
in ``summary.json``'s ``members_lost`` (when and why) and on a ``member lost:`` line, while the
run still completes with the survivors (an elastic run's exit status is not changed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ._jobs import FLOTILLA, ROOT

pytestmark = pytest.mark.timeout(180)


def test_flotilla_run_reports_a_crashed_worker_as_lost(tmp_path: Path) -> None:
    args = ["run", "examples/tiny.yaml", "--report", str(tmp_path), "--no-progress"]
    args += ["--set", "cluster.num_workers=3", "--set", "job.steps=60"]
    env = {**os.environ, "FLOTILLA_FAULT_CRASH": "w2@10"}
    out = subprocess.run(FLOTILLA + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["num_workers"] == 2
    (lost,) = summary["members_lost"]
    assert lost["name"] == "w2" and lost["at_s"] > 0 and lost["why"], lost
    assert "member lost: w2 (worker" in out.stderr


def test_a_run_that_loses_nobody_says_so(tmp_path: Path) -> None:
    args = ["run", "examples/tiny.yaml", "--report", str(tmp_path), "--no-progress"]
    out = subprocess.run(FLOTILLA + args, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["members_lost"] == []
    assert "member lost" not in out.stderr
