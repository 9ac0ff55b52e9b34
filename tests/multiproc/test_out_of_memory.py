"""A device out of memory stops the job (issue 34's bad input): not a transient fault, so no
survivor trains on without the worker, no pipeline restart or replacement retries it.  ``flotilla
run`` fails with the one line naming the worker or stage and the device, and the summary says
``completed: false`` with that line.  (CUDA is not needed: the user's model raises torch's own
``OutOfMemoryError`` in its forward pass once training reached a step, as a GPU would.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from ._jobs import processes_mentioning, start, stop

TASK = """
import torch
from torch import nn

class Heavy(nn.Module):
    calls = 0

    def forward(self, x):
        if self.training:
            Heavy.calls += 1
            if Heavy.calls > 6:  # (a few steps, then the activations no longer fit)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return x

class Task:
    def build_model(self):
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), Heavy(), nn.Linear(16, 3))

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(256, 4, generator=g), torch.randint(0, 3, (256,), generator=g)

    eval_data = train_data

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    def metrics(self, out, y):
        return {"accuracy": float((out.argmax(1) == y).float().mean())}
"""

CONFIG = """
cluster: {{defaults: {{speed: 1.0, memory_bytes: 1GiB}}, num_workers: 2}}
job: {{task: "{task}:Task", optimizer: {{kind: sgd, lr: 0.1}}, batch_size: 32, steps: 40}}
strategy: {strategy}
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "who"),
    [
        ("{kind: allreduce, step_timeout_s: 20}", r"worker 'w[01]'"),
        ("{kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2, step_timeout_s: 20}", "stage"),
    ],
)
def test_a_device_out_of_memory_stops_the_job_with_one_line(tmp_path: Path, strategy: str, who: str) -> None:
    (tmp_path / "task.py").write_text(TASK)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.format(task=tmp_path / "task.py", strategy=strategy))
    args = [
        "run",
        str(cfg),
        "--report",
        str(tmp_path / "report"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    proc = start(args, tmp_path / "launcher.log")
    try:
        code = proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("the job did not stop")
    finally:
        stop(proc)
    out = (tmp_path / "launcher.log").read_text()
    assert code == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "ran out of memory on cpu: CUDA out of memory." in errors[0], out[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is False and "ran out of memory" in summary["error"]
    assert re.search(who, summary["error"]), summary["error"]
    if "pipeline" in strategy:
        assert summary["restarts"] == []  # (no restart would fit it)
    assert processes_mentioning(str(tmp_path)) == []
