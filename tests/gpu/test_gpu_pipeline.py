"""A 2-stage pipeline run on CUDA (skipped without CUDA: see conftest.py).

``examples/pipeline_lm.yaml`` (character transformer, 1F1B, 2 stages) with fewer steps and
``cluster.defaults.type=cuda`` on every stage: the run completes, its loss falls and its test loss
is below the bound the CPU pipeline tests use (tests/multiproc/test_pipeline_run.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ..multiproc._jobs import processes_mentioning, start, stop

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

STEPS = 40


def test_two_stage_pipeline_run_on_cuda(tmp_path: Path) -> None:
    args = [
        "run",
        "examples/pipeline_lm.yaml",
        "--report",
        str(tmp_path / "report"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "cluster.workers=[{name: fast, speed: 1.0, memory_bytes: 256MiB, type: cuda}, "
        "{name: slow, speed: 1.0, memory_bytes: 256MiB, type: cuda}]",
        "--set",
        f"job.steps={STEPS}",
        "--set",
        "job.dataset.num_samples=4000",
    ]
    proc = start(args, tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=280) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS and summary["num_workers"] == 2
    losses = summary["train_losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, "loss did not fall"
    assert 0 < summary["test_accuracy"] < 1 and summary["test_loss"] < 4.6
    assert processes_mentioning(str(tmp_path)) == []
