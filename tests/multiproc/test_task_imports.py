"""A task file imports the modules next to it, as ``python train.py`` would, under ``flotilla run``:
in the launcher and in every worker or pipeline-stage process, with no PYTHONPATH set, started from
another directory.  A task named ``"module:Class"`` is found in the directory ``flotilla run`` is
started from (the console script alone would not have it on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc._jobs import processes_mentioning

pytestmark = pytest.mark.timeout(300)

SIBLING = """
import torch
import torch.nn.functional as F
from torch import nn


def make_data(num_samples, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 4, generator=g)
    return x, (x[:, 0] > 0).long()


class Halves:
    def __init__(self, num_samples=256):
        self.num_samples = num_samples

    def build_model(self):
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def train_data(self):
        return make_data(self.num_samples, 0)

    def eval_data(self):
        return make_data(64, 1)

    def loss(self, output, target):
        return F.cross_entropy(output, target)

    def metrics(self, output, target):
        return {"accuracy": float((output.argmax(1) == target).float().mean())}
"""

TRAIN = """
from tasks import Halves  # a module next to this file, as in a script


class MyTask(Halves):
    pass
"""

STRATEGIES = {
    "allreduce": "cluster: {num_workers: 2}\nstrategy: {kind: allreduce}\n",
    "pipeline": (
        "cluster: {workers: [{name: a, memory_bytes: 256MiB}, {name: b, memory_bytes: 256MiB}]}\n"
        "strategy: {kind: pipeline, schedule: gpipe, num_stages: 2, num_microbatches: 2}\n"
    ),
}


def _flotilla() -> list[str]:
    script = Path(sys.executable).parent / "flotilla"  # the console script a user runs
    return [str(script)] if script.is_file() else [sys.executable, "-m", "flotilla.cli.main"]


def _project(tmp_path: Path, strategy: str, task: str) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "tasks.py").write_text(SIBLING)
    (project / "train.py").write_text(TRAIN)
    job = (
        f"job: {{task: {task!r}, task_args: {{num_samples: 256}}, optimizer: {{kind: sgd, lr: 0.1}},"
        " batch_size: 32, steps: 4, seed: 0, eval_every_steps: 0}\n"
    )
    (project / "job.yaml").write_text(STRATEGIES[strategy] + job)
    return project


def _run(tmp_path: Path, config: Path, cwd: Path, *, report: bool = True) -> str:
    """``flotilla run CONFIG`` from ``cwd`` without PYTHONPATH; its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_dir = tmp_path / "run"
    cmd = [*_flotilla(), "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    if report:
        cmd += ["--report", str(tmp_path / "report")]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert not processes_mentioning(str(run_dir))
    assert f"logs: {run_dir.resolve()}" in out.stderr
    return out.stderr


@pytest.mark.parametrize("strategy", ["allreduce", "pipeline"])
def test_a_task_file_imports_its_neighbour_in_every_process(tmp_path: Path, strategy: str) -> None:
    project = _project(tmp_path, strategy, "./train.py:MyTask")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stderr = _run(tmp_path, project / "job.yaml", cwd=elsewhere)
    report = (tmp_path / "report").resolve()
    assert json.loads((report / "summary.json").read_text())["completed"]
    assert f"model: {report / 'model.safetensors'}" in stderr and f"report: {report}" in stderr


def test_a_module_task_is_found_in_the_current_directory(tmp_path: Path) -> None:
    """(and without --report the output names where the model went, and that no report was written)"""
    project = _project(tmp_path, "allreduce", "train:MyTask")
    stderr = _run(tmp_path, Path("job.yaml"), cwd=project, report=False)
    model = (tmp_path / "run" / "model.safetensors").resolve()
    assert model.is_file() and f"model: {model}" in stderr
    assert "report: none written" in stderr
