"""Kill the whole job (launcher, coordinator, every worker) at random points several times in a row
and resume each time from the newest checkpoint: every resume succeeds, and with strategy
allreduce and ``on_abort: redo`` the final weights equal an uninterrupted run's bitwise (issue 12,
item 4).  Ten kills in a row (issue 12's number) run under ``-m slow`` (117 s on two cores, 150 s
on CI); the default suite kills three times (every step of the loop is the same: kill a resumed
run, resume it again).

Independent of the machine's speed: each run is killed on observed progress (two new checkpoints,
polled every few ms), after a random delay measured in that run's own step time (0 to
``CKPT_EVERY`` steps), so a run advances by a bounded number of *steps* however fast the machine
is, and ``STEPS_PER_RUN`` steps per run leave room for every kill with a wide margin.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.elastic.checkpoint import list_checkpoints
from tests.multiproc._jobs import processes_mentioning, start, wait_for

pytestmark = pytest.mark.timeout(600)

CONFIG = """
cluster: {{num_workers: 2}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 2000}}
  optimizer: {{kind: sgd, lr: 0.05, momentum: 0.9}}
  batch_size: 64
  steps: {steps}
  eval_every_steps: 0
strategy: {{kind: allreduce, on_abort: redo}}
report: {{digest_every_steps: 0}}
checkpoint: {{every_steps: {every}, keep: 2, dir: {ckpt}}}
"""
CKPT_EVERY = 5
STEPS_PER_RUN = 45  # a killed run advances ~3 x CKPT_EVERY steps (plus the kill's latency): < 25 each
POLL_S = 0.005  # checkpoint polling: a few steps even on a fast machine


def _newest_step(ckpt: Path) -> int:
    found = list_checkpoints(ckpt)
    return int(found[-1].name.split("-")[1]) if found else -1


def _kill_everything(proc, run_dir: Path, known: list[int]) -> None:
    """SIGKILL the ``known`` processes of the run and the launcher's process group at once, then
    every other process of this run (workers run in sessions of their own), then check that
    nothing is left."""
    for pid in known:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in processes_mentioning(str(run_dir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    wait_for(lambda: not processes_mentioning(str(run_dir)), 15, "every process of the run to be gone")


def _next_checkpoint(ckpt: Path, after: int, proc, log: Path) -> tuple[int, float]:
    """Wait for a checkpoint newer than step ``after``: its step and when it was seen."""
    wait_for(lambda: _newest_step(ckpt) > after or proc.poll() is not None, 120, "a new checkpoint", POLL_S)
    seen = time.monotonic()
    assert proc.poll() is None, f"the run ended early: {log.read_text()[-2000:]}"
    return _newest_step(ckpt), seen


def _run(tmp: Path, name: str, cfg: Path, extra: list[str]):
    run_dir = tmp / f"run-{name}"
    args = ["run", str(cfg), "--no-progress", "--run-dir", str(run_dir), "--report", str(tmp / f"rep-{name}")]
    return start(args + extra, tmp / f"{name}.log"), run_dir


@pytest.mark.parametrize("num_kills", [3, pytest.param(10, marks=pytest.mark.slow)])
def test_kills_and_resumes_give_the_uninterrupted_weights(tmp_path: Path, num_kills: int) -> None:
    steps = STEPS_PER_RUN * (num_kills + 1) + 5  # 500 for ten kills, 185 for three
    ckpt = tmp_path / "ckpt"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.format(steps=steps, ckpt=ckpt, every=CKPT_EVERY))
    ref_cfg = tmp_path / "ref.yaml"
    ref_cfg.write_text(CONFIG.format(steps=steps, ckpt=tmp_path / "ref-ckpt", every=CKPT_EVERY))
    proc, _ = _run(tmp_path, "ref", ref_cfg, [])
    assert proc.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-2000:]
    reference = load_file(tmp_path / "rep-ref" / "model.safetensors")

    rng = random.Random(12)
    resumed_from: list[int] = []
    for attempt in range(num_kills + 1):
        before = _newest_step(ckpt)
        extra = ["--resume", str(ckpt)] if attempt else []
        proc, run_dir = _run(tmp_path, f"k{attempt}", cfg, extra)
        log = tmp_path / f"k{attempt}.log"
        known: list[int] = []
        try:  # let it make progress (two newer checkpoints), then kill it at a random point
            first, t_first = _next_checkpoint(ckpt, before, proc, log)
            known = processes_mentioning(str(run_dir))  # killed first, without a /proc scan
            second, t_second = _next_checkpoint(ckpt, first, proc, log)
            step_s = (t_second - t_first) / (second - first)  # this run's step time, observed
            time.sleep(rng.uniform(0.0, CKPT_EVERY) * step_s)
            assert proc.poll() is None, f"run {attempt} ended early: {log.read_text()[-2000:]}"
        finally:
            _kill_everything(proc, run_dir, known)
        if attempt:
            resumed_from.append(before)
        assert _newest_step(ckpt) > before
        assert _newest_step(ckpt) < steps, "the job finished before it was killed: make it longer"
    print(f"\n{num_kills} resumes, from steps {resumed_from}; last checkpoint {_newest_step(ckpt)}")

    proc, _ = _run(tmp_path, "final", cfg, ["--resume", str(ckpt)])
    assert proc.wait(timeout=300) == 0, (tmp_path / "final.log").read_text()[-2000:]
    final = load_file(tmp_path / "rep-final" / "model.safetensors")
    assert final.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{key} differs from the uninterrupted run"
