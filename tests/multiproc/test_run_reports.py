"""`flotilla run` reports when metrics are recorded every Nth step: the records still account
for every sample (``samples``/``interval_s`` since the previous record), so the summary's
per-worker and job throughput count every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._jobs import processes_mentioning, records, start, stop, training_steps

pytestmark = pytest.mark.timeout(120)


def test_sampled_records_still_count_every_sample(tmp_path: Path) -> None:
    args = [
        "run",
        "examples/tiny.yaml",
        "--report",
        str(tmp_path / "report"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "report.metrics_every_steps=4",
        "--set",
        "job.steps=30",
        "--set",
        "job.eval_every_steps=0",
    ]
    proc = start(args, tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=100) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    steps = training_steps(records(tmp_path / "report"))
    committed = [r for r in steps if r["committed"]]
    assert len(committed) < 30  # sampled: not every step has a record
    # 30 committed steps of a global batch of 64 (redone steps, if any, add their own records)
    assert sum(r["samples"] for r in committed) == 30 * 64
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    for w in summary["workers"]:
        mine = [r for r in steps if r["name"] == w["name"]]
        rate = sum(r["samples"] for r in mine) / sum(r["interval_s"] for r in mine)
        assert w["samples_per_s"] == pytest.approx(rate)
        assert (w["device"], w["transport"]) == ("cpu", "gloo")  # (where it computed: docs/gpu.md)
    assert processes_mentioning(str(tmp_path)) == []
