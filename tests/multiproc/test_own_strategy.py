"""A user's own strategy, as ``docs/strategies.md`` writes it (``examples/own_strategy/averaged.py``),
copied into a directory of its own and named by path in a YAML file: it trains under
``flotilla run`` with 3 workers and survives a SIGKILL of one (replicas bitwise identical after
every step); its state (a momentum) is checkpointed, and ``--resume`` equals an uninterrupted run
bit for bit.  Nothing of flotilla was edited to add it.  Waits are for events."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.elastic.checkpoint import list_checkpoints
from tests.multiproc.test_resume import _kill_everything

from ._jobs import ROOT, processes_mentioning, records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(600)

CONFIG = """
cluster: {{num_workers: {workers}, defaults: {{speed: {speed}}}}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 2000}}
  batch_size: 96
  steps: {steps}
  eval_every_steps: 0
strategy: {{kind: ./averaged.py:SPEC, lr: 0.05, momentum: 0.9}}
report: {{digest_every_steps: 1}}
{checkpoint}
"""


def _project(tmp: Path, name: str, **kw: object) -> Path:
    """A directory of the user's own: the strategy file and a config naming it by path."""
    project = tmp / name
    project.mkdir()
    shutil.copy(ROOT / "examples" / "own_strategy" / "averaged.py", project / "averaged.py")
    (project / "job.yaml").write_text(CONFIG.format(**{"workers": 2, "speed": 1.0, "checkpoint": "", **kw}))
    return project


def _run(project: Path, name: str, extra: list[str] = ()):  # type: ignore[assignment]
    run_dir, report = project / f"run-{name}", project / f"rep-{name}"
    args = [
        "run",
        str(project / "job.yaml"),
        "--no-progress",
        "--run-dir",
        str(run_dir),
        "--report",
        str(report),
    ]
    return start([*args, *extra], project / f"{name}.log"), run_dir, report


def test_a_users_strategy_survives_a_sigkill(tmp_path: Path) -> None:
    project = _project(tmp_path, "killed", workers=3, speed=0.05, steps=120)
    proc, _, report = _run(project, "k")
    log = project / "k.log"
    try:
        wait_for(
            lambda: (
                {r["name"] for r in training_steps(records(report)) if r["committed"] and r["step"] >= 20}
                >= {"w0", "w1", "w2"}
                or proc.poll() is not None
            ),
            120,
            "every worker past step 20",
        )
        assert proc.poll() is None, f"the job ended before the kill: {log.read_text()[-3000:]}"
        victim = next(r["pid"] for r in training_steps(records(report)) if r["name"] == "w2")
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    steps = training_steps(records(report))
    survivors = ("w0", "w1")
    digests: dict[int, set[str]] = {}
    for r in steps:
        if r["name"] in survivors and r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in digests.values()), "the survivors' replicas differ"
    assert max(digests) == 119, "the survivors did not train to the last step"
    after = {r["world_size"] for r in steps if r["name"] in survivors and r["step"] >= 110}
    assert after == {2}, after


@pytest.mark.slow  # (~35 s: in `make test-all`; test_diloco_run checks a strategy's state on resume)
def test_a_users_strategy_state_is_checkpointed_and_resumed_bit_for_bit(tmp_path: Path) -> None:
    ckpt = "checkpoint: {every_steps: 10, keep: 2, dir: ckpt}"
    ref = _project(tmp_path, "ref", steps=300, checkpoint=ckpt)
    proc, _, report = _run(ref, "ref")
    assert proc.wait(timeout=300) == 0, (ref / "ref.log").read_text()[-2000:]
    reference = load_file(report / "model.safetensors")

    project = _project(tmp_path, "resumed", steps=300, checkpoint=ckpt)
    proc, run_dir, _ = _run(project, "killed")
    found = lambda: list_checkpoints(run_dir.parent / "rep-killed" / "ckpt")
    try:
        wait_for(lambda: len(found()) >= 2 or proc.poll() is not None, 120, "two checkpoints", 0.005)
        assert proc.poll() is None, (project / "killed.log").read_text()[-2000:]
    finally:
        _kill_everything(proc, run_dir, processes_mentioning(str(run_dir)))
    newest = found()[-1]
    state = load_file(newest / "strategy.safetensors")
    assert sorted(state) == [f"v{i}" for i in range(len(state))] and any(
        bool(v.any()) for v in state.values()
    )
    proc, _, report = _run(project, "final", ["--resume", str(newest.parent)])
    assert proc.wait(timeout=300) == 0, (project / "final.log").read_text()[-2000:]
    print(f"\nresumed from {newest.name} of 300 steps")
    final = load_file(report / "model.safetensors")
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{key} differs from the uninterrupted run"
