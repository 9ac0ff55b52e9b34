"""An allreduce job checkpointed by 6 workers resumes on 3 (issue 36, item 4).

The job's state is the replicated model and optimizer (rank 0's checkpoint) and the data position
is the global step (the global-batch sampler draws step k's batch whatever the number of workers),
so a resume onto another number of workers continues the same optimisation: 6 workers train 12
steps with a checkpoint every 6, then 3 workers resume from step 12 and train to 24; the final
weights equal an uninterrupted 3-worker run of 24 steps within float tolerance (the all-reduce
sums 6 or 3 shard gradients: another rounding order), the resumed run started at step 12 (not 0),
and its records hold steps 12..23 (0-based) exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.config import load_config
from flotilla.trainer.reference import train_reference
from tests.multiproc._jobs import start

pytestmark = pytest.mark.timeout(300)

CONFIG = """
cluster: {{num_workers: {workers}}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 2000}}
  optimizer: {{kind: adam, lr: 0.003}}
  batch_size: 60
  steps: {steps}
  eval_every_steps: 0
strategy: {{kind: allreduce}}
checkpoint: {{every_steps: 6, keep: 2, dir: {ckpt}}}
"""


def _run(tmp: Path, name: str, workers: int, steps: int, ckpt: Path, extra: list[str]) -> Path:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(workers=workers, steps=steps, ckpt=ckpt))
    report = tmp / f"rep-{name}"
    args = ["run", str(cfg), "--no-progress", "--run-dir", str(tmp / f"run-{name}"), "--report", str(report)]
    proc = start(args + extra, tmp / f"{name}.log")
    assert proc.wait(timeout=240) == 0, (tmp / f"{name}.log").read_text()[-3000:]
    return report


def test_six_workers_checkpoint_three_resume_and_end_where_an_uninterrupted_run_does(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "six", 6, 12, ckpt, [])
    resumed = _run(tmp_path, "three", 3, 24, ckpt, ["--resume", str(ckpt)])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["completed"] and summary["num_workers"] == 3
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    steps = sorted(r["step"] for r in records if r["rank"] == 0 and r["committed"])
    assert steps == list(range(12, 24)), steps  # (0-based step indices: 12 steps after the 12th)
    final = load_file(resumed / "model.safetensors")
    _, model = train_reference(load_config(tmp_path / "three.yaml"))  # one process, 24 steps
    expected = model.state_dict()
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-5, msg=key)
    fresh = load_file(tmp_path / "rep-six" / "model.safetensors")
    assert any(not torch.allclose(fresh[k], expected[k]) for k in expected)  # (it did train on)
