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

# two instances' worth of the job's devices: a fast and a half-speed one each (``strategy.replicas=2``)
FOUR = (
    "cluster.workers=["
    + ", ".join(
        f"{{name: {n}, speed: {s}, memory_bytes: 64MiB}}"
        for n, s in [("a0", 1.0), ("a1", 0.5), ("b0", 1.0), ("b1", 0.5)]
    )
    + "]"
)

# HetPipe's smallest mixed cluster: node n0 one device that holds the model alone, node n1 two of
# 5 MiB that hold it only together -- ``placement: np`` makes a VW of one stage and one of two
HETPIPE_NODES = """
cluster:
  host: HOST
  workers:
    - {name: a0, node: n0, speed: 1.0, memory_bytes: 64MiB}
    - {name: b0, node: n1, speed: 1.0, memory_bytes: 5MiB}
    - {name: b1, node: n1, speed: 1.0, memory_bytes: 5MiB}
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 600, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 16
  steps: STEPS
  eval_every_steps: 0
strategy: {kind: hetpipe, placement: np, s_local: 1, clock_distance: 0, step_timeout_s: 20}
"""


def hetpipe_nodes(steps: int, host: str = "127.0.0.1") -> str:
    """:data:`HETPIPE_NODES` for ``steps`` steps, its hosted parts bound on ``host``."""
    return HETPIPE_NODES.replace("STEPS", str(steps)).replace("HOST", host)


def pipeline_cfg(tmp_path: Path, *overrides: str):  # -> flotilla.config.Config
    """The shared pipeline job with ``overrides`` (``key=value``, as ``--set`` takes them)."""
    path = tmp_path / "pipe.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))


def kill_stage_at(
    sup: Any,
    run_dir: Path,
    stage: str | tuple[str, ...],
    at_step: int,
    killed: dict,
    sig: int = signal.SIGKILL,
    ready: Any = None,
) -> None:
    """SIGKILL (or ``sig``) the stage process named ``stage`` (a ``Supervisor`` child; a tuple of
    names: each, at once) once the job reported ``at_step`` steps done (``stage1.status.json``);
    ``killed`` gets when, the step and the pid (the first's; ``pids``: every one); ``ready``: a
    further event to wait for (e.g. a checkpoint on every stage's disk)."""
    names = (stage,) if isinstance(stage, str) else stage
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        try:
            step = json.loads((run_dir / "stage1.status.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            step = 0
        # (this attempt's process of that name: an earlier attempt's, if the job restarted, is gone)
        children = [next((c for c in reversed(sup.children) if c.name == n), None) for n in names]
        if all(c is not None for c in children) and step >= at_step and (ready is None or ready()):
            pids = [c.proc.pid for c in children if c is not None]
            for pid in pids:
                os.kill(pid, sig)
            killed.update(at=time.time(), step=step, pid=pids[0], pids=pids)
            return
        time.sleep(0.005)


def run_killing(
    cfg: Any,
    tmp_path: Path,
    stage: str | tuple[str, ...],
    at_step: int,
    sig: int = signal.SIGKILL,
    ready: Any = None,
) -> tuple[dict, dict]:
    """``run_pipeline_job`` of ``cfg`` (run and report directories under ``tmp_path``) while a
    thread sends ``sig`` to the stage process ``stage`` once the job reported ``at_step`` steps
    (:func:`kill_stage_at`); (the summary, what the thread did)."""
    import threading

    from flotilla.launch.pipeline import run_pipeline_job
    from flotilla.launch.supervisor import Supervisor

    sup = Supervisor(tmp_path / "run")
    killed: dict = {}
    killer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", stage, at_step, killed, sig, ready), daemon=True
    )
    killer.start()
    try:
        summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    finally:
        sup.close()  # (its zygote too: not left until the object is collected)
    killer.join()
    assert killed, f"stage {stage} was never signalled"
    return summary, killed
