"""Real processes: the pipeline stages meet in an authenticated rendezvous store (``roles/stage.py``
over ``comm.store_auth.AuthStore``, the run's secret in ``<run_dir>/secret``).

An outsider with no secret plants junk under every key the stage group's creation reads, as soon
as the launcher has published the store's port (``pipeline_job.json``) and before any stage has
started: the job must run as if nothing happened (no stage fails, so no restart: restarts are off,
a failure would end the run), and the run directory holding the secret is 0700.
"""

from __future__ import annotations

import datetime as dt
import json
import stat
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from flotilla.config import load_config
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

pytestmark = pytest.mark.timeout(240)

JUNK = b"\xff" * 64  # gloo reads a length from it: std::length_error -> ValueError
CONFIG = """
cluster:
  workers: [{name: fast, speed: 1.0, memory_bytes: 64MiB}, {name: slow, speed: 1.0, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 16}
  dataset: {name: pysource, num_samples: 200, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 8
  steps: 4
  eval_every_steps: 0
  auto_checkpoint: false
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2, step_timeout_s: 20}
"""


def _plant(run_dir: Path, done: dict) -> None:
    """Once the store's port is published: junk under the stage group's keys (instance 0's group,
    epoch 1, 2 ranks: namespace ``pp/0/epoch/1/``, ``roles/stage.py``)."""
    job_file = run_dir / "pipeline_job.json"
    deadline = time.monotonic() + 120
    while not job_file.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    job = json.loads(job_file.read_text())
    store = dist.TCPStore(
        job["store_host"], job["store_port"], is_master=False, timeout=dt.timedelta(seconds=10)
    )
    for rank in range(2):
        store.set(f"pp/0/epoch/1//0/{rank}", JUNK)
        store.set(f"pp/0/epoch/1//arrive/{rank}", JUNK)
    done["before_any_stage"] = not any(run_dir.glob("stage*.status.json"))
    done["planted"] = 4


def test_junk_planted_in_a_pipelines_store_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "pipe.yaml").write_text(CONFIG)
    cfg = load_config(tmp_path / "pipe.yaml", [])
    run_dir = tmp_path / "run"
    done: dict = {}
    planter = threading.Thread(target=_plant, args=(run_dir, done), daemon=True)
    planter.start()
    sup = Supervisor(run_dir)
    summary = run_pipeline_job(cfg, tmp_path / "report", run_dir, False, supervisor=sup)
    planter.join(timeout=30)
    assert done.get("planted") == 4, "the junk was never planted"
    assert done["before_any_stage"], "a stage reported before the junk was in place: nothing was tested"
    assert summary["completed"] and summary["restarts"] == [] and summary["degraded"] is None
    assert summary["steps"] == 4 and len(summary["train_losses"]) == 4
    text = "".join(p.read_text() for p in sorted(run_dir.glob("stage*.log")))
    assert "_M_create" not in text and "Traceback" not in text, text[-3000:]
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "secret").stat().st_mode) == 0o600
    assert all(c.proc.returncode == 0 for c in sup.children)
