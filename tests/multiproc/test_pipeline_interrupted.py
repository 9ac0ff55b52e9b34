"""Real processes (issue 18, honest endings): ``flotilla run`` of a pipeline interrupted by Ctrl-C
(SIGINT to the launcher, once the stages train) exits 130, leaves no stage behind, and still
writes ``summary.json``: ``completed: false``, ``interrupted``, the error, the steps reached.
The secret is gone from the run directory, which stays 0700.  ``-m slow`` (a second pipeline
start-up; the allreduce case is in ``test_eviction.py``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ._jobs import interrupt, processes_mentioning, start, stop, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIG = """
cluster:
  workers: [{name: fast, speed: 1.0, memory_bytes: 64MiB}, {name: slow, speed: 0.5, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 16}
  dataset: {name: pysource, num_samples: 200, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 8
  steps: 100000
  eval_every_steps: 0
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2, step_timeout_s: 20}
"""


def _step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "stage1.status.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def test_an_interrupted_pipeline_run_writes_an_incomplete_summary(tmp_path: Path) -> None:
    (tmp_path / "pipe.yaml").write_text(CONFIG)
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "launcher.log"
    args = ["run", str(tmp_path / "pipe.yaml"), "--report", str(report), "--run-dir", str(run_dir)]
    proc = start([*args, "--no-progress"], log)
    try:
        wait_for(lambda: _step(run_dir) >= 3 or proc.poll() is not None, 180, "the stages past step 3")
        assert proc.poll() is None, log.read_text()[-3000:]
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] is True, summary
    assert summary["error"] == "interrupted (Ctrl-C)" and summary["strategy"] == "pipeline"
    assert summary["steps"] >= 3 and summary["restarts"] == [] and summary["degraded"] is None
    assert not (run_dir / "secret").exists() and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 30, "every stage gone")
