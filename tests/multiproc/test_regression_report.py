"""A regression task end to end (examples/own_task/regression.yaml): `flotilla run` reports its
headline metric, test RMSE (lower is better), in the summary, the summary table, every
evaluation record and eval_vs_time.png, and no test_accuracy anywhere; the exported model
reproduces the reported RMSE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.report.metrics import read_jsonl
from flotilla.trainer.task_load import TaskData, evaluate_task, load_task

from ._jobs import ROOT, processes_mentioning, start, stop

pytestmark = pytest.mark.timeout(180)

EXAMPLE = ROOT / "examples" / "own_task"


def test_regression_reports_rmse_and_no_accuracy(tmp_path: Path) -> None:
    report = tmp_path / "report"
    args = [
        "run",
        str(EXAMPLE / "regression.yaml"),
        "--report",
        str(report),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = start(args + ["--set", "job.steps=300"], tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=160) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    out = (tmp_path / "launcher.log").read_text()
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] and summary["headline"] == "rmse" and summary["headline_mode"] == "min"
    assert summary["test_rmse"] <= 0.35  # the example's stated target
    evals = read_jsonl(report / "evals.jsonl")
    assert [e["step"] for e in evals] == [100, 200, 300]
    assert all(e["headline"] == "rmse" and e["test_rmse"] > 0 for e in evals)
    assert all("test_accuracy" not in e for e in [summary, *summary["evals"], *evals])
    assert "test_rmse (min)" in out and "accuracy" not in out
    assert (report / "eval_vs_time.png").stat().st_size > 10_000

    task = load_task(str(EXAMPLE / "regression.py") + ":Regression", {"num_samples": 5000})
    model = task.build_model()
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    again = evaluate_task(task, model, TaskData(task.eval_data()))
    assert again["rmse"] == pytest.approx(summary["test_rmse"], rel=1e-5)
    assert processes_mentioning(str(tmp_path)) == []
