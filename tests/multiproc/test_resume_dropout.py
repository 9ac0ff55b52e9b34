"""Resume is bitwise with dropout and a batch that does not divide among the workers (issue 16,
item 5): 3 workers, a global batch of 64 (22/21/21 samples), a task with Dropout, AdamW on a
warm-up + cosine schedule (its state travels in the checkpoint).  A run stopped
at step 12 (its checkpoint) and resumed to step 24 ends with the weights of an uninterrupted
24-step run, bit for bit.  (Every unit seeds its randomness from ``(job.seed, step, rank)``:
``trainer/replica.unit_seed``.)  Independent of the machine's speed: the job lengths are steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.multiproc._jobs import start

pytestmark = pytest.mark.timeout(300)

TASK = """
import torch
from torch import nn

import flotilla


class Noisy(flotilla.Task):
    def build_model(self):
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def train_data(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(600, 8, generator=g)
        return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    def eval_data(self):
        return self.train_data()

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)

    def metrics(self, output, target):
        return {"accuracy": (output.argmax(1) == target).float().mean().item()}
"""

CONFIG = """
cluster: {{num_workers: 3}}
job:
  task: {task}:Noisy
  optimizer: {{kind: adamw, lr: 0.01, weight_decay: 0.01}}
  schedule: {{kind: cosine, warmup_steps: 4, decay_steps: 24, min_lr: 0.001}}
  batch_size: 64
  steps: {steps}
  eval_every_steps: 0
  seed: 7
strategy: {{kind: allreduce, on_abort: redo}}
checkpoint: {{every_steps: 12, keep: 2, dir: {ckpt}}}
"""


def _run(tmp: Path, name: str, steps: int, ckpt: Path, resume: bool = False) -> dict[str, torch.Tensor]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(task=tmp / "noisy.py", steps=steps, ckpt=ckpt))
    args = ["run", str(cfg), "--no-progress", "--run-dir", str(tmp / f"run-{name}")]
    args += ["--report", str(tmp / f"rep-{name}")] + (["--resume", str(ckpt)] if resume else [])
    proc = start(args, tmp / f"{name}.log")
    assert proc.wait(timeout=240) == 0, (tmp / f"{name}.log").read_text()[-3000:]
    return load_file(tmp / f"rep-{name}" / "model.safetensors")


def test_dropout_uneven_split_resume_is_bitwise(tmp_path: Path) -> None:
    (tmp_path / "noisy.py").write_text(TASK)
    reference = _run(tmp_path, "ref", 24, tmp_path / "ref-ckpt")
    _run(tmp_path, "first", 12, tmp_path / "ckpt")
    resumed = _run(tmp_path, "second", 24, tmp_path / "ckpt", resume=True)
    assert resumed.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), f"{key} differs from the uninterrupted run"
