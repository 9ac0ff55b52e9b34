"""The trackers behind ``report.trackers`` (``report/trackers.py``), in one process: the MLflow
backend read back with MLflow's client, a tracker that is not installed or fails, flattening."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flotilla.report import tracker_backends, trackers
from flotilla.report.trackers import MLflowBackend, StepMeans, Tracker, flatten, make_tracker

mlflow_tracking = pytest.importorskip("mlflow.tracking", reason="the dev extra installs mlflow-skinny")


def test_the_mlflow_backend_writes_metrics_params_and_markers_mlflows_client_reads(tmp_path: Path) -> None:
    tracker = make_tracker(["mlflow"], tmp_path / "rep", mlflow_experiment="exp")
    assert tracker is not None
    (backend,) = tracker.backends
    assert isinstance(backend, MLflowBackend)
    tracker.params({"job": {"batch_size": 48, "optimizer": {"kind": "adam"}}, "trackers": ["mlflow"]})
    for step in range(1500):  # more than one log_batch
        tracker.scalar("train/loss", 1.0 / (step + 1), step)
    tracker.scalar("eval/test_acc@1 (%)", 0.5, 3)  # (a task's metric name MLflow would refuse)
    tracker.event("revocation", "kill w2 (pid 1)", 40)
    tracker.event("lost", "w2", 41)
    tracker.text("config", "```yaml\njob: {}\n```", 0)
    tracker.close()
    client = mlflow_tracking.MlflowClient(tracking_uri=backend.uri)
    run = client.get_run(backend.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "rep"
    assert run.data.params == {"job.batch_size": "48", "job.optimizer.kind": "adam", "trackers": '["mlflow"]'}
    history = client.get_metric_history(backend.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1500))
    assert {m.step: m.value for m in history}[9] == pytest.approx(0.1)
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "events/revocation")] == [
        (40, 1.0)
    ]
    assert [m.value for m in client.get_metric_history(backend.run_id, "eval/test_acc_1 ___")] == [0.5]
    events = Path(client.download_artifacts(backend.run_id, "events.txt", str(tmp_path))).read_text()
    assert events == "step 40: revocation: kill w2 (pid 1)\nstep 41: lost: w2\n"


def test_a_tracker_that_is_not_installed_is_one_line_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert make_tracker(["mlflow"], tmp_path) is None
        assert make_tracker(None, tmp_path) is None  # (the default: silent)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "tracker mlflow is not installed: pip install 'flotilla[mlflow]' (the mlflow-skinny package); "
        "the run goes on without it"
    )


def test_an_mlflow_store_that_cannot_be_opened_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert make_tracker(["mlflow"], tmp_path, mlflow_uri="nosuchscheme://x") is None
    assert any("tracker mlflow: nosuchscheme://x:" in r.getMessage() for r in caplog.records)


class _Broken:
    def scalars(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        raise OSError("disk full")


class _Kept:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float, int]] = []

    def scalars(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        self.seen.extend((tag, value, step) for tag, value in values.items())


def test_a_failing_backend_is_dropped_once_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    kept = _Kept()
    tracker = Tracker([_Broken(), kept])
    with caplog.at_level(logging.WARNING):
        tracker.scalar("a", 1.0, 0)
        tracker.scalar("a", 2.0, 1)
    assert kept.seen == [("a", 1.0, 0), ("a", 2.0, 1)] and tracker.backends == [kept]
    assert [r.getMessage() for r in caplog.records] == [
        "tracker _Broken failed (OSError: disk full); the run goes on without it"
    ]


def test_tensorboard_reads_back_every_value_of_a_grouped_event_under_its_own_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    monkeypatch.setattr(tracker_backends, "TB_HANDOFF_EVENTS", 4)  # (bursts of 4; the rest at close)
    tracker = make_tracker(["tensorboard"], tmp_path)
    assert tracker is not None
    for step in range(50):  # one event per step holding three series, as the coordinator writes them
        series = {"worker/w0/loss": 1.0 / (step + 1), "worker/w0/step_s": 0.25, "n": step}
        tracker.scalars(series, step, 1_000_000.0 + step)  # (stamped with the records' arrival)
    tracker.scalar("eval/test_accuracy", 0.5, 49)
    tracker.event("revocation", "w1 killed", 20)
    tracker.close()
    ea = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    got = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    assert [e.wall_time for e in ea.Scalars("n")] == [1_000_000.0 + s for s in range(50)]
    assert got["worker/w0/loss"] == [(s, pytest.approx(1.0 / (s + 1))) for s in range(50)]
    assert got["worker/w0/step_s"] == [(s, 0.25) for s in range(50)]
    assert got["n"] == [(s, float(s)) for s in range(50)]
    assert got["eval/test_accuracy"] == [(49, 0.5)] and got["events/revocation"] == [(20, 1.0)]
    assert any("events" in t for t in ea.Tags()["tensors"])  # the markers' text


def test_a_step_is_released_once_every_live_worker_passed_it_with_its_workers_series() -> None:
    means = StepMeans()
    means.add(0, 1.0, 100.0, 2, {"worker/w0/loss": 1.0}, now=10.0)
    means.add(0, 3.0, 50.0, 2, {"worker/w1/loss": 3.0}, now=11.0)
    means.add(1, 2.0, 100.0, 2, {"worker/w0/loss": 2.0}, now=12.0)
    assert means.ready(below=1) == [
        (0, {"train/loss": 2.0, "train/samples_per_s": 150.0, "cluster/workers_in_view": 2,
             "worker/w0/loss": 1.0, "worker/w1/loss": 3.0}, 11.0),
    ]  # fmt: skip
    assert means.ready(below=1) == []  # (each step once)
    assert means.ready(None) == [
        (1, {"train/loss": 2.0, "train/samples_per_s": 100.0, "cluster/workers_in_view": 2,
             "worker/w0/loss": 2.0}, 12.0)
    ]  # fmt: skip


def test_held_tensorboard_events_are_handed_over_by_the_heartbeat_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    backend = tracker_backends.TensorBoardBackend(tmp_path)
    clock = [100.0]
    monkeypatch.setattr(tracker_backends.time, "monotonic", lambda: clock[0])
    backend._handed = clock[0]
    handed: list[object] = []
    monkeypatch.setattr(backend._writer, "add_event", handed.append)
    backend.scalars({"a": 1.0}, 0)
    backend.tick()
    assert handed == [] and len(backend._held) == 1  # (held: younger than TB_HANDOFF_S)
    clock[0] += tracker_backends.TB_HANDOFF_S  # ... a stalled job: no event comes, the heartbeat's tick does
    backend.tick()
    assert len(handed) == 1 and backend._held == []
    monkeypatch.undo()
    backend.close()


def test_flatten_names_every_leaf_by_its_path() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": "x", "f": [1, 2], "g": {}}) == {
        "a.b": "1",
        "a.c.d": "null",
        "e": "x",
        "f": "[1, 2]",
        "g": "{}",
    }
