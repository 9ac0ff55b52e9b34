"""Run reports: metrics.jsonl round-trip, summary validation, plots with workers joining/leaving."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from flotilla.report.metrics import METRICS_FILE, MetricsWriter, read_metrics, read_run_records
from flotilla.report.plots import make_plots
from flotilla.report.summary import write_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(worker_id, step, time_s, loss, membership_epoch=0, **extra):
    return {
        "time_s": time_s,
        "worker_id": worker_id,
        "step": step,
        "loss": loss,
        "samples": 32,
        "epoch": step // 50,
        "membership_epoch": membership_epoch,
        **extra,
    }


def _write_three_workers(report_dir):
    """Workers 0 and 1 run 100 steps; worker 2 leaves after step 49 (membership epoch 1)."""
    with MetricsWriter(report_dir) as writer:
        for step in range(100):
            view = 0 if step < 50 else 1
            for wid in (0, 1, 2):
                if wid == 2 and step >= 50:
                    continue
                t = 0.1 * step * (1.0 + 0.2 * wid) + 0.001 * wid
                writer.write(
                    _record(
                        wid,
                        step,
                        1000.0 + t,
                        2.3 * math.exp(-step / 30) + 0.01 * wid,
                        view,
                        samples_per_s=320.0,
                        phase="train",
                    )
                )


def test_jsonl_round_trip_with_numpy_values(tmp_path):
    records = [
        _record(0, 0, 1.5, 2.25),
        _record(1, 0, np.float64(1.75), np.float32(2.5), speed=np.int64(3), note="x"),
    ]
    with MetricsWriter(tmp_path) as writer:
        for r in records:
            writer.write(r)
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2
    back = read_metrics(tmp_path)
    assert back[0] == records[0]
    assert back[1]["time_s"] == 1.75 and back[1]["loss"] == 2.5 and back[1]["speed"] == 3
    assert type(back[1]["speed"]) is int and back[1]["note"] == "x"


def test_writer_appends_across_instances_and_threads(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write(_record(0, 0, 0.0, 1.0))
    writer = MetricsWriter(tmp_path)

    def run(worker_id):
        for step in range(50):
            writer.write(_record(worker_id, step, step, 1.0))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    writer.close()
    records = read_metrics(tmp_path)
    assert len(records) == 1 + 4 * 50
    assert sorted((r["worker_id"], r["step"]) for r in records[1:]) == [
        (k, s) for k in range(4) for s in range(50)
    ]
    with pytest.raises(ValueError, match="closed"):
        writer.write(_record(0, 1, 1.0, 1.0))


def test_writer_rejects_missing_keys(tmp_path):
    bad = _record(0, 0, 0.0, 1.0)
    del bad["membership_epoch"]
    with MetricsWriter(tmp_path) as writer, pytest.raises(ValueError, match="membership_epoch"):
        writer.write(bad)
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_reader_skips_torn_last_line(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(_record(0, 0, 0.0, 1.0))
    with open(tmp_path / METRICS_FILE, "a") as fh:
        fh.write('{"time_s": 1.0, "worker_')
    assert len(read_metrics(tmp_path)) == 1


def test_run_records_merge_metrics_and_spools(tmp_path):
    """What the coordinator received, then each worker's spool; evaluations and step-less records out."""
    lines = {
        METRICS_FILE: [{"step": 0, "name": "w0"}, {"kind": "eval", "step": 0}, {"kind": "train", "step": 1}],
        "records-w1.jsonl": [{"step": 2, "name": "w1"}, {"event": "no step"}],
        "records-w0.jsonl": [{"step": 3, "name": "w0"}],
        "other.jsonl": [{"step": 9}],
    }
    for name, recs in lines.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [r["step"] for r in read_run_records(tmp_path)] == [0, 1, 3, 2]
    assert read_run_records(tmp_path / "absent") == []


def test_summary_written_and_validated(tmp_path):
    summary = {
        "test_accuracy": np.float64(0.95),
        "steps": 1250,
        "wall_s": 61.5,
        "samples_per_s": 4100.0,
        "num_workers": np.int64(4),
        "extra": {"a": [1, 2]},
    }
    path = write_summary(tmp_path, summary)
    assert path == tmp_path / "summary.json"
    loaded = json.loads(path.read_text())
    assert loaded["test_accuracy"] == 0.95 and loaded["num_workers"] == 4
    assert loaded["extra"] == {"a": [1, 2]}
    for key in ("test_accuracy", "steps", "wall_s", "samples_per_s", "num_workers"):
        partial = {k: v for k, v in summary.items() if k != key}
        with pytest.raises(ValueError, match=key):
            write_summary(tmp_path / "other", partial)
    with pytest.raises(ValueError, match="test_accuracy"):
        write_summary(tmp_path, {**summary, "test_accuracy": 1.5})
    assert not (tmp_path / "other").exists()


def test_plots_with_worker_leaving_midway(tmp_path):
    _write_three_workers(tmp_path)
    paths = make_plots(tmp_path)
    assert sorted(p.name for p in paths) == ["loss_vs_time.png", "throughput_vs_time.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 10_000  # a real chart, not an empty canvas
    assert not list(tmp_path.glob(".*.tmp"))


def test_plots_handle_join_gap_and_single_record_worker(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(40):
            writer.write(_record("a", step, 0.05 * step, 1.0 / (1 + step)))
            if 10 <= step < 15 or step >= 30:  # worker b joins, leaves, rejoins
                writer.write(_record("b", step, 0.05 * step + 0.01, 1.0 / (1 + step), step // 10))
        writer.write(_record("c", 39, 2.0, float("nan"), 3))  # one record, NaN loss
    paths = make_plots(tmp_path, window=3)
    assert len(paths) == 2 and all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_plots_empty_file_and_bad_window(tmp_path):
    MetricsWriter(tmp_path).close()
    assert make_plots(tmp_path) == []
    with pytest.raises(ValueError, match="window"):
        make_plots(tmp_path, window=0)
    with pytest.raises(FileNotFoundError):
        make_plots(tmp_path / "missing")


def test_rate_smoothing_and_gap_segmentation():
    from flotilla.report.plots import _segments, _smoothed_rate

    t = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 5.0, 5.1, 5.2])
    assert [(s.start, s.stop) for s in _segments(t)] == [(0, 5), (5, 8)]
    times, rate = _smoothed_rate(t[:5], np.full(5, 32.0), window=2)
    np.testing.assert_allclose(times, t[1:5])
    np.testing.assert_allclose(rate, np.full(4, 320.0))
