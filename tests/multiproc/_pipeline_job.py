"""The small two-stage pipeline job the multi-process pipeline tests share: a char transformer on
the shipped Python-source data set, one fast and one half-speed device, 1F1B.  ``pipeline_cfg``
loads it with the test's overrides (``steps`` and ``eval_every_steps`` are the usual ones)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from flotilla.config import load_config

CONFIG = """
cluster:
  workers: [{name: fast, speed: 1.0, memory_bytes: 64MiB}, {name: slow, speed: 0.5, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 600, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 16
  steps: 8
  eval_every_steps: 4
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 4, step_timeout_s: 20}
"""


def pipeline_cfg(tmp_path: Path, *overrides: str):  # -> flotilla.config.Config
    """The shared pipeline job with ``overrides`` (``key=value``, as ``--set`` takes them)."""
    path = tmp_path / "pipe.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))


def kill_stage_at(
    sup: Any, run_dir: Path, stage: str, at_step: int, killed: dict, sig: int = signal.SIGKILL
) -> None:
    """SIGKILL (or ``sig``) the stage process named ``stage`` (a ``Supervisor`` child) once the job
    reported ``at_step`` steps done (``stage1.status.json``); ``killed`` gets when, the step and
    the pid."""
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        try:
            step = json.loads((run_dir / "stage1.status.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            step = 0
        child = next((c for c in sup.children if c.name == stage), None)
        if child is not None and step >= at_step:
            os.kill(child.proc.pid, sig)
            killed.update(at=time.time(), step=step, pid=child.proc.pid)
            return
        time.sleep(0.005)
