"""Reports for any metric: the task's headline metric (name and direction) in the evaluation
records, the summary, the live line, the summary table and the plots; no ``test_accuracy`` for a
task without accuracy; records of the old shape (``test_accuracy: None``) read the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from rich.console import Console

from flotilla.launch.progress import status_table, summary_table
from flotilla.report.headline import (
    Headline,
    eval_fields,
    headline_of,
    headline_value,
    normalize_eval,
)
from flotilla.report.metrics import EVAL_PLOT, EVALS_FILE, MetricsWriter
from flotilla.report.plots import make_plots
from flotilla.report.summary import pipeline_summary, run_summary, write_summary
from flotilla.roles.metrics_sink import MetricsSink, WorkerInfo
from flotilla.trainer.task import ClassificationTask, LanguageModelTask, Task
from flotilla.trainer.zoo_tasks import ZooTask

REGRESSION_EV = {"loss": 0.04, "mse": 0.04, "rmse": 0.2}
CLASSIFICATION_EV = {"loss": 0.3, "accuracy": 0.91}


class _Plain:  # a task that does not subclass flotilla.Task
    pass


class _Rmse:
    headline = ("rmse", "min")


class _Targeted:
    target = ("rmse", 0.3, "min")


def test_default_headline_is_accuracy_if_the_task_has_it_else_the_loss() -> None:
    assert headline_of(_Plain(), CLASSIFICATION_EV) == Headline("accuracy", "max")
    assert headline_of(_Plain(), REGRESSION_EV) == Headline("loss", "min")
    assert headline_of(_Targeted(), REGRESSION_EV) == Headline("rmse", "min")  # the target's metric
    assert headline_of(_Targeted(), {"loss": 1.0}) == Headline("loss", "min")  # target not evaluated


def test_declared_headline_wins_and_is_checked() -> None:
    assert headline_of(_Rmse(), {**REGRESSION_EV, "accuracy": 0.5}) == Headline("rmse", "min")
    with pytest.raises(ValueError, match=r"headline 'rmse' is not one of its evaluation results \['loss'\]"):
        headline_of(_Rmse(), {"loss": 1.0})
    bad = type("Bad", (), {"headline": ("rmse", "lowest")})()
    with pytest.raises(ValueError, match="must be 'max' or 'min'"):
        headline_of(bad, REGRESSION_EV)
    with pytest.raises(ValueError, match=r"must be \(metric, 'max' or 'min'\)"):
        headline_of(type("Bad", (), {"headline": "rmse"})(), REGRESSION_EV)


def test_task_classes_declare_their_headline_and_a_malformed_one_fails_at_definition() -> None:
    assert ClassificationTask.headline == ("accuracy", "max")
    assert LanguageModelTask.headline == ("perplexity", "min")
    zoo = ZooTask(model="tiny_mlp", dataset="synthetic")
    assert headline_of(zoo, CLASSIFICATION_EV) == Headline("accuracy", "max")
    assert Task.headline is None
    with pytest.raises(ValueError, match="must be 'max' or 'min'"):
        type("Wrong", (Task,), {"headline": ("rmse", "down")})


def test_eval_fields_of_a_regression_have_no_accuracy() -> None:
    fields = eval_fields(_Rmse(), REGRESSION_EV)
    assert fields == {
        "test_loss": 0.04,
        "test_mse": 0.04,
        "test_rmse": 0.2,
        "headline": "rmse",
        "headline_mode": "min",
    }
    assert headline_value(fields) == (Headline("rmse", "min"), 0.2)
    cls = eval_fields(_Plain(), CLASSIFICATION_EV)
    assert cls["test_accuracy"] == 0.91 and cls["headline"] == "accuracy"


def test_old_shaped_records_are_normalized() -> None:
    old = {"step": 3, "time_s": 1.0, "test_accuracy": None, "test_loss": 0.5, "test_rmse": 0.7}
    new = normalize_eval(old)
    assert "test_accuracy" not in new and new["headline"] == "loss" and new["headline_mode"] == "min"
    cls = normalize_eval({"test_accuracy": 0.8, "test_loss": 0.5})
    assert cls["headline"] == "accuracy" and cls["test_accuracy"] == 0.8
    named = {
        "test_accuracy": 0.8,
        "test_loss": 0.5,
        "test_rmse": 1.0,
        "headline": "rmse",
        "headline_mode": "min",
    }
    assert normalize_eval(named) == named
    assert normalize_eval({"steps": 4}) == {"steps": 4}  # no evaluation: nothing to name


def _snap(final: dict, evals: list[dict]) -> dict:
    worker = {"name": "w0", "speed": 1.0, "state": "done", "step": 10, "samples": 640, "busy_s": 1.0}
    return {
        "final": final,
        "evals": evals,
        "workers": [worker],
        "members": [0],
        "epoch": 1,
        "done": True,
        "elapsed_s": 2.0,
    }


def test_run_summary_of_a_regression_shows_rmse_and_no_accuracy(tmp_path: Path) -> None:
    ev = {"step": 5, "time_s": 1.0, **eval_fields(_Rmse(), REGRESSION_EV)}
    final = {**eval_fields(_Rmse(), REGRESSION_EV), "steps": 10, "digest": "d"}
    summary = run_summary(_snap(final, [ev]), strategy="allreduce")
    assert summary["headline"] == "rmse" and summary["headline_mode"] == "min"
    assert summary["test_rmse"] == 0.2 and summary["test_loss"] == 0.04
    assert "test_accuracy" not in summary and all("test_accuracy" not in e for e in summary["evals"])
    on_disk = json.loads(write_summary(tmp_path, summary).read_text())
    assert "test_accuracy" not in on_disk and on_disk["test_rmse"] == 0.2


def test_run_summary_of_an_old_worker_result_drops_the_none_accuracy() -> None:
    final = {"test_accuracy": None, "test_loss": 0.04, "test_rmse": 0.2, "steps": 10}
    evals = [{"step": 5, "time_s": 1.0, "test_accuracy": None, "test_loss": 0.1}]
    summary = run_summary(_snap(final, evals), strategy="allreduce")
    assert "test_accuracy" not in summary and summary["headline"] == "loss"
    assert summary["evals"] == [
        {"step": 5, "time_s": 1.0, "test_loss": 0.1, **Headline("loss", "min").fields()}
    ]


def test_run_summary_of_a_classification_keeps_test_accuracy() -> None:
    final = {**eval_fields(_Plain(), CLASSIFICATION_EV), "steps": 10}
    summary = run_summary(_snap(final, []), strategy="allreduce")
    assert summary["test_accuracy"] == 0.91 and summary["headline"] == "accuracy"


def test_a_run_that_never_evaluated_names_no_headline_and_is_still_written(tmp_path: Path) -> None:
    summary = run_summary(_snap({}, []), strategy="allreduce")
    assert summary["headline"] is None and summary["test_loss"] is None and "test_accuracy" not in summary
    write_summary(tmp_path, summary)
    with pytest.raises(ValueError, match="headline"):
        write_summary(tmp_path, {k: v for k, v in summary.items() if k != "headline"})


def test_pipeline_summary_reports_the_tasks_results(tmp_path: Path) -> None:
    class _Sched:
        num_minibatches, num_stages, num_microbatches, vertical_sync = 4, 1, 2, False
        kind = type("K", (), {"value": "gpipe"})()

    class _Plan:
        predicted_step_s = 0.1

        def to_dict(self) -> dict:
            return {}

    job = {"layer_ends": [3], "stage_names": ["s0"], "speeds": [1.0], "config": {"job": {"batch_size": 8}}}
    stage = {"step_losses": {"0": 1.0, "1": 0.5}, "stage_idx": 0, "wall_s": 1.0, "compute_s": 0.5}
    stage |= {"slept_s": 0.0, "peak_in_flight": 1, "peak_weight_copies": 1}
    summary = pipeline_summary(
        job=job,
        stages=[stage],
        schedule=cast(Any, _Sched()),
        plan=cast(Any, _Plan()),
        evaluation={**REGRESSION_EV, "accuracy": None},
        job_wall_s=1.5,
        gantt=tmp_path / "g.png",
        gantt_modelled=None,
        headline=Headline("rmse", "min"),
    )
    assert summary["headline"] == "rmse" and summary["test_rmse"] == 0.2 and "test_accuracy" not in summary
    assert summary["evals"][0]["test_rmse"] == 0.2 and "test_accuracy" not in summary["evals"][0]


def _render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def _status_snap(evals: list[dict]) -> dict:
    worker = {
        "worker_id": 0,
        "name": "w0",
        "speed": 1.0,
        "state": "training",
        "step": 40,
        "samples_per_s": 100.0,
        "loss": 0.5,
        "membership_epoch": 1,
        "samples": 800,
    }
    return {"workers": [worker], "members": [0], "evals": evals, "epoch": 1, "elapsed_s": 3.0}


def test_live_line_shows_the_headline_metric() -> None:
    ev = {"step": 5, "time_s": 1.0, **eval_fields(_Rmse(), REGRESSION_EV)}
    title = str(status_table(_status_snap([ev]), 100).title)
    assert "test rmse 0.2000" in title and "acc" not in title
    assert "test" not in str(status_table(_status_snap([]), 100).title)  # nothing evaluated yet
    old = {"step": 5, "time_s": 1.0, "test_accuracy": 0.9, "test_loss": 0.3}
    assert "test accuracy 0.9000" in str(status_table(_status_snap([old]), 100).title)


def test_summary_table_shows_the_headline_first_and_no_accuracy_row() -> None:
    summary = {"completed": True, "steps": 10, "strategy": "allreduce", "workers": []}
    summary |= eval_fields(_Rmse(), REGRESSION_EV)
    rows = [line for line in _render(summary_table(summary)).splitlines() if line.startswith("│")]
    names = [r.strip("│ ").split("│")[0].strip() for r in rows]
    assert names[:5] == ["completed", "test_rmse (min)", "test_loss", "test_mse", "steps"]
    assert not any("accuracy" in n for n in names)


def test_eval_plot_draws_the_headline(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        for step in range(20):
            rec = {"time_s": 10.0 + step, "worker_id": 0, "step": step, "loss": 1.0 / (step + 1)}
            writer.write(rec | {"samples": 8, "epoch": 0, "membership_epoch": 1})
    assert [p.name for p in make_plots(tmp_path)] == ["loss_vs_time.png", "throughput_vs_time.png"]
    with MetricsWriter(tmp_path, filename=EVALS_FILE, required=("time_s", "step")) as writer:
        for step in (5, 10, 15):
            ev = {"loss": 1.0 / step, "mse": 1.0 / step, "rmse": step**-0.5}
            writer.write({"time_s": 10.0 + step, "step": step, **eval_fields(_Rmse(), ev)})
    paths = make_plots(tmp_path)
    assert [p.name for p in paths][-1] == EVAL_PLOT
    assert paths[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[-1].stat().st_size > 10_000


def test_metrics_sink_writes_evaluations_without_a_none_accuracy(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, clock_spread=False)
    info = WorkerInfo(worker_id=0, name="w0", speed=1.0, pid=1)
    new = {"kind": "eval", "step": 5, "time_s": 1.0, **eval_fields(_Rmse(), REGRESSION_EV)}
    old = {"kind": "eval", "step": 9, "time_s": 2.0, "test_accuracy": None, "test_loss": 0.1}
    sink.ingest_batch(info, 0, [new, old])
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / EVALS_FILE).read_text().splitlines()]
    assert [e["headline"] for e in lines] == ["rmse", "loss"]
    assert all("test_accuracy" not in e for e in lines + sink.evals)


def test_headline_module_is_pure() -> None:
    code = (
        "import sys, flotilla.report.headline; print(sorted({'torch', 'zmq', 'socket'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_job_s_steps_are_not_a_lagging_rank_0_s_own() -> None:
    """adpsgd / partial_reduce: a straggler that is rank 0 ends once the others finished the job's
    steps and reports its own count; the summary says the job's (the furthest worker's last + 1)."""
    snap = _snap({"steps": 245}, [])
    snap["workers"] = [dict(snap["workers"][0], name=n, step=s) for n, s in (("w3", 244), ("w0", 627))]
    assert run_summary(snap, strategy="adpsgd")["steps"] == 628
    assert run_summary(snap, strategy="adpsgd")["num_workers"] == 2  # (both finished; one view member)
    assert run_summary(_snap({"steps": 11}, []), strategy="allreduce")["steps"] == 11  # (all alike)
    stopped = dict(snap, done=False)  # (a job stopped at a step: that step, as reported)
    assert run_summary(stopped, strategy="adpsgd")["steps"] == 245
