"""The user task example end to end from Python (examples/own_task/train.py): it trains with the
same processes as `flotilla run`, and the exported model.safetensors loads into the user's own
model and reproduces the reported test metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.trainer.task_load import TaskData, evaluate_task, load_task
from tests.multiproc._jobs import ROOT, processes_mentioning

pytestmark = pytest.mark.timeout(300)


def test_train_py_trains_and_the_exported_model_reproduces_the_metrics(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_task" / "train.py"), "allreduce"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "own_allreduce_py" / "summary.json").read_text())
    assert summary["completed"] and summary["test_accuracy"] >= 0.9  # the example's stated target
    assert f"test accuracy {summary['test_accuracy']:.4f}" in out.stdout

    task = load_task(str(ROOT / "examples/own_task/task.py") + ":Spirals", {"width": 64, "depth": 3})
    model = task.build_model()
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    metrics = evaluate_task(task, model, TaskData(task.eval_data()))
    assert metrics["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-9)
    assert metrics["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    assert not processes_mentioning(str(tmp_path))
