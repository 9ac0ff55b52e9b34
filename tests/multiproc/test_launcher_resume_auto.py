"""A dead launcher (it hosts the coordinator): SIGKILL it mid-run -- its workers die with it --
then ``flotilla run CONFIG --report R --resume auto`` finds the job's newest checkpoint under
``R`` by itself, says where, and completes the job; ``--resume auto`` with nothing to resume from
is one line naming where it looked (tests/unit/test_resume_auto.py).  The fault is handed in by
the test (it kills the launcher).

The strategies with state of their own -- DiLoCo (outer momentum, each rank's inner optimizer)
and AD-PSGD (replicas that differ) -- are checkpointed by default as allreduce is (time-based,
rank 0; ``LaunchNeeds.auto_checkpoint``) and resumed from time-based checkpoints too.  Found from
outside: ``flotilla run`` wrote no checkpoint for either, so a launcher's death lost the whole
run, though docs/checkpoints.md promised the defaults."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.elastic.checkpoint import list_checkpoints
from flotilla.launch.local import with_default_checkpoints

from ._jobs import processes_mentioning, start, stop, wait_for

pytestmark = pytest.mark.timeout(240)

COMMON = [
    "--set", "job.eval_every_steps=0",
    "--set", "cluster.defaults.speed=0.05",  # steps of tens of ms: the kill lands mid-run
]  # fmt: skip

# kind -> (its settings, the job's steps); AD-PSGD's steps wait for no collective: more of them
CASES = {
    "allreduce": (["--set", "checkpoint.every_steps=5"], 60),
    "diloco": (
        ["--set", "strategy={kind: diloco, inner_steps: 4}", "--set", "checkpoint={every_s: 0.3, keep: 2}"],
        400,  # (two time-based checkpoints, 0.3 s apart, long before the end on a fast machine)
    ),
    "adpsgd": (["--set", "strategy={kind: adpsgd}", "--set", "checkpoint={every_s: 0.3, keep: 2}"], 600),
}


@pytest.mark.parametrize("kind", ["diloco", "adpsgd"])
def test_strategies_with_their_own_state_are_checkpointed_by_default(kind: str) -> None:
    cfg = load_config("examples/tiny.yaml", [f"strategy={{kind: {kind}}}"])
    assert cfg.checkpoint is None
    with_defaults, added = with_default_checkpoints(cfg)
    assert added and with_defaults.checkpoint is not None and with_defaults.checkpoint.every_s == 10


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_killed_launcher_is_resumed_by_resume_auto(tmp_path: Path, kind: str) -> None:
    sets, steps = CASES[kind]
    ck = tmp_path / "report" / "checkpoints"

    def run(name: str, *extra: str):
        args = ["run", "examples/tiny.yaml", "--report", str(tmp_path / "report"), "--no-progress"]
        args += [*COMMON, *sets, "--set", f"job.steps={steps}"]
        return start([*args, "--run-dir", str(tmp_path / name), *extra], tmp_path / f"{name}.log")

    first = run("run1")
    try:
        wait_for(lambda: len(list_checkpoints(ck)) >= 2, 180, "two checkpoints")
        os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its workers die with it
        first.wait(timeout=30)
    finally:
        stop(first)
    wait_for(lambda: processes_mentioning(str(tmp_path / "run1")) == [], 30, "the workers' exit")
    killed_at = int(list_checkpoints(ck)[-1].name.split("-")[1])
    assert 0 < killed_at < steps
    second = run("run2", "--resume", "auto")
    try:
        assert second.wait(timeout=180) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    finally:
        stop(second)
    assert f"resuming from the checkpoints in {ck.resolve()}" in (tmp_path / "run2.log").read_text()
    logs = "".join(p.read_text() for p in (tmp_path / "run2").glob("w*.log"))
    assert f"at step {killed_at}" in logs  # resumed from the newest checkpoint the first run wrote
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == steps
    assert processes_mentioning(str(tmp_path)) == []
