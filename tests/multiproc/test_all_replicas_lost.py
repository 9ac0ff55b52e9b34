"""Real processes: every worker holding the model dies (a 2-worker job, both SIGKILLed without
notice, both restarted by the revocation schedule).

- with checkpoints on, the restarted workers find no live replica, load the job's newest
  checkpoint, say so, and the job completes all its steps;
- without, they stop at once with one line naming the lost state (they used to wait 120 s for a
  view nobody would form), and the run says it did not complete.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from ._jobs import FLOTILLA, ROOT

pytestmark = pytest.mark.timeout(400)

JOB = {
    "cluster": {
        "defaults": {"speed": 0.05, "memory_bytes": "1GiB"},  # steps of tens of ms
        "num_workers": 2,
        "revocations": {
            "time_from_step": 1,
            "events": [
                {"at_s": 1.0, "action": "kill", "worker": "w1"},
                {"at_s": 1.5, "action": "kill", "worker": "w0"},
                {"at_s": 2.0, "action": "add", "worker": "w0"},
                {"at_s": 2.0, "action": "add", "worker": "w1"},
            ],
        },
    },
    "job": {
        "model": {"name": "tiny_mlp"},
        "dataset": {"name": "synthetic", "num_samples": 2000, "test_fraction": 0.2},
        "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
        "batch_size": 64,
        "steps": 400,  # (paced: the kills land long before the end on any machine)
        "seed": 0,
        "eval_every_steps": 0,
    },
    "strategy": {"kind": "allreduce", "step_timeout_s": 10.0},
}


def _run(tmp_path: Path, job: dict) -> tuple[int, str, str]:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    run_dir, report = tmp_path / "run", tmp_path / "report"
    args = [
        *FLOTILLA,
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--report",
        str(report),
        "--no-progress",
    ]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=360)
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("w*.log")))
    return proc.returncode, proc.stdout + proc.stderr, logs


def test_with_checkpoints_the_restarted_workers_resume_from_the_newest(tmp_path: Path) -> None:
    job = {**JOB, "checkpoint": {"every_steps": 20, "keep": 2}}
    code, out, logs = _run(tmp_path, job)
    assert code == 0, out[-3000:]
    assert "resuming from the job's newest checkpoint" in logs
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 400


def test_without_checkpoints_they_stop_at_once_naming_the_lost_state(tmp_path: Path) -> None:
    code, out, logs = _run(tmp_path, JOB)
    assert code != 0
    assert "no live replica holds the model state" in logs
    assert "no view containing worker" not in logs  # (the 120 s wait for a view nobody forms)
