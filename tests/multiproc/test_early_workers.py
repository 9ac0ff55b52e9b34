"""``flotilla run`` starts its workers before it checks the job, so that each one imports torch
meanwhile (``launch/coordinator_file.py``): a job the check refuses still ends with one line, exit
code 2, and no process left behind -- the waiting workers are killed before they join anything --
and a reused run directory's old ``coordinator.json`` is never joined."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc._jobs import processes_mentioning

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]

BROADCASTING = """
import torch
import torch.nn.functional as F
from torch import nn


class Broadcasts:
    def build_model(self):
        return nn.Linear(3, 1)

    def train_data(self):
        x = torch.randn(64, 3)
        return x, x.sum(1)  # targets (N,) against outputs (N, 1): mse_loss broadcasts

    def eval_data(self):
        return self.train_data()

    def loss(self, output, target):
        return F.mse_loss(output, target)

    def metrics(self, output, target):
        return {}
"""


def _config(tmp_path: Path, task: str, workers: int = 3) -> Path:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        json.dumps(
            {
                "cluster": {"num_workers": workers},
                "job": {"task": task, "steps": 4, "batch_size": 16, "eval_every_steps": 0},
                "strategy": {"kind": "allreduce"},
            }
        )
    )
    return cfg


def _run(cfg: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "flotilla.cli.main",
        "run",
        str(cfg),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280)


def test_a_refused_job_leaves_no_worker_behind(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(BROADCASTING)
    run_dir = tmp_path / "run"
    out = _run(_config(tmp_path, f"{tmp_path / 'task.py'}:Broadcasts"), run_dir)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "broadcast" in errors[0], out.stderr[-3000:]
    assert not processes_mentioning(str(run_dir))
    assert not (run_dir / "coordinator.json").exists()  # nobody was ever told where to go
    assert sorted(p.name for p in run_dir.glob("w*.log")) == [
        "w0.log",
        "w1.log",
        "w2.log",
    ]  # they had started


def test_an_old_coordinator_file_is_never_joined(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"address": "tcp://127.0.0.1:9", "secret_file": str(run_dir / "secret"), "pid": 1}
    (run_dir / "coordinator.json").write_text(json.dumps(stale))
    cmd = [sys.executable, "-m", "flotilla.cli.main", "run", "examples/tiny.yaml", "--set", "job.steps=4"]
    cmd += ["--run-dir", str(run_dir), "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "coordinator.json").read_text())["address"] != stale["address"]
    assert not processes_mentioning(str(run_dir))
