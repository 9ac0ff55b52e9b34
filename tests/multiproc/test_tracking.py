"""Experiment tracking (issue 36 item 1, ``report/trackers.py``): a ``flotilla run`` with a
scheduled kill writes TensorBoard event files under ``<report>/tensorboard`` and an MLflow run into
the file store ``<report>/mlruns``, live, and each library's own reader (TensorBoard's
``EventAccumulator``, MLflow's ``MlflowClient``) finds in them what the JSONL records say: the
loss of every step (the mean over the workers), the workers in view dropping from 3 to 2, the
evaluations, a revocation marker at the step the kill came, and the configuration (MLflow: as
parameters)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from flotilla.report.metrics import read_jsonl

from ._jobs import start, stop

pytestmark = pytest.mark.timeout(300)
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="the dev extra installs tensorboard"
)
mlflow_tracking = pytest.importorskip("mlflow.tracking", reason="the dev extra installs mlflow-skinny")

CONFIG = {
    "cluster": {
        "workers": [{"name": "w0"}, {"name": "w1"}, {"name": "w2"}],
        "host": "127.0.0.1",
        "revocations": {"events": [{"at_step": 40, "action": "kill", "worker": "w2"}]},
    },
    "job": {
        "task": "examples/own_task/task.py:Spirals",
        "task_args": {"width": 32, "depth": 2, "num_samples": 2000, "num_arms": 3, "noise": 0.15, "seed": 0},
        "optimizer": {"kind": "adam", "lr": 0.003},
        "batch_size": 48,
        "steps": 120,
        "eval_every_steps": 40,
    },
    "strategy": {"kind": "allreduce"},
    "report": {"trackers": ["tensorboard", "mlflow"]},
}


def test_a_run_writes_tensorboard_events_and_an_mlflow_run_that_match_its_records(tmp_path: Path) -> None:
    config, report, log = tmp_path / "job.json", tmp_path / "report", tmp_path / "run.log"
    task = Path(__file__).resolve().parents[2] / CONFIG["job"]["task"]
    config.write_text(json.dumps({**CONFIG, "job": {**CONFIG["job"], "task": f"{task}"}}))
    proc = start(["run", str(config), "--report", str(report), "--no-progress"], log)
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    ea = event_accumulator.EventAccumulator(
        str(report / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    ea.Reload()
    scalars = {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}

    losses: dict[int, list[float]] = defaultdict(list)
    own: dict[str, dict[int, float]] = defaultdict(dict)  # each worker's committed losses by step
    for r in read_jsonl(report / "metrics.jsonl"):
        if r.get("committed") and "loss" in r:
            losses[int(r["step"])].append(float(r["loss"]))
            own[r["name"]][int(r["step"])] = float(r["loss"])
    assert sorted(scalars["train/loss"]) == sorted(losses) == list(range(120))
    for step, values in losses.items():
        assert scalars["train/loss"][step] == pytest.approx(statistics.fmean(values), rel=1e-6)
    assert set(own) == {"w0", "w1", "w2"}  # every worker's own series, step for step
    for name, by_step in own.items():
        assert scalars[f"worker/{name}/loss"] == pytest.approx(by_step, rel=1e-6), name
        assert scalars[f"worker/{name}/step_s"].keys() == by_step.keys()
    assert len(ea.Scalars("train/loss")) == 120  # (each step written once)
    workers = scalars["cluster/workers_in_view"]
    assert workers[0] == 3 and workers[119] == 2

    evals = [e for e in read_jsonl(report / "evals.jsonl")]
    assert evals and {int(e["step"]) for e in evals} == set(scalars["eval/test_accuracy"])
    for e in evals:
        assert scalars["eval/test_accuracy"][int(e["step"])] == pytest.approx(e["test_accuracy"])

    (revocation,) = read_jsonl(report / "revocations.jsonl")
    (marked,) = scalars["events/revocation"]  # one marker, at the step the launcher killed at
    assert revocation["action"] == "kill" and marked == revocation["step"] >= 40
    assert scalars["events/lost"]  # and the member lost it made
    assert "config" in " ".join(ea.Tags()["tensors"])  # the resolved configuration, as text

    _check_mlflow(report, scalars, revocation_step=marked)


def _check_mlflow(report: Path, scalars: dict[str, dict[int, float]], revocation_step: int) -> None:
    """The same series in the MLflow run, read back with MLflow's client."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_tracking.MlflowClient(tracking_uri=(report / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("flotilla")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == report.name
    assert run.data.params["job.batch_size"] == "48" and run.data.params["strategy.kind"] == "allreduce"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history.keys() == scalars["train/loss"].keys()
    for step, value in history.items():
        assert value == pytest.approx(scalars["train/loss"][step], rel=1e-6)
    workers = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "cluster/workers_in_view")}
    assert workers[0] == 3 and workers[119] == 2
    evals = {m.step for m in client.get_metric_history(run.info.run_id, "eval/test_accuracy")}
    assert evals == set(scalars["eval/test_accuracy"])
    (marker,) = client.get_metric_history(run.info.run_id, "events/revocation")
    assert marker.step == revocation_step
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.md", "events.txt"} <= artifacts


def test_a_pipeline_job_is_tracked_like_any_other(tmp_path: Path) -> None:
    """Its stages report through the pipeline's host, which records through the same sink: the
    last stage's loss of every step, and the periodic evaluation."""
    from flotilla.launch.pipeline import run_pipeline_job

    from ._pipeline_job import pipeline_cfg

    cfg = pipeline_cfg(tmp_path, "report.trackers=[tensorboard]")
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", progress=False)
    assert summary["completed"]
    ea = event_accumulator.EventAccumulator(str(report / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    scalars = {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}
    losses = {r["step"]: r["loss"] for r in read_jsonl(report / "metrics.jsonl") if r["loss"] is not None}
    assert sorted(losses) == list(range(1, 9)) and scalars["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert (
        scalars["worker/slow/loss"] == pytest.approx(losses, rel=1e-6) and "worker/fast/loss" not in scalars
    )
    (periodic,) = [e for e in read_jsonl(report / "evals.jsonl") if e["step"] == 4]
    assert scalars["eval/test_accuracy"] == pytest.approx({4: periodic["test_accuracy"]})
