"""Real processes: SIGKILL one worker of three mid-training; the survivors commit their next step
within 2 s (issue 11: they used to wait ``2 x step_timeout_s + 5`` s in a rendezvous that still
held the dead worker).  Prints the measured recovery time.

Recovery time = the survivors' first committed step after the step the kill broke (its
``time_s``, seconds since the coordinator's t0) minus the kill instant on the same scale (t0 is
read from the coordinator's ``status``: ``now - elapsed_s``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import read_secret_file
from flotilla.comm.msgplane import connect

from ._jobs import records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(120)

STEP_TIMEOUT_S = 30.0  # the default: the old code took 2 x 30 + 5 s to recover
RECOVERY_BOUND_S = 2.0
NUM_STEPS = 80
KILL_AFTER_STEP = 20


def _args(tmp: Path) -> list[str]:
    sets = {
        "cluster.num_workers": "3",
        "cluster.defaults.speed": "0.05",  # steps of a few tens of ms: the kill lands mid-training
        "job.steps": str(NUM_STEPS),
        "job.eval_every_steps": "0",
        "strategy.step_timeout_s": str(STEP_TIMEOUT_S),
    }
    extra = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    report, run = str(tmp / "report"), str(tmp / "run")
    return ["run", "examples/tiny.yaml", "--report", report, "--run-dir", run, "--no-progress", *extra]


def _coordinator_t0_unix(run_dir: Path) -> float:
    """The coordinator's t0 (records' ``time_s`` are seconds since it) on this machine's clock."""
    info = json.loads((run_dir / "coordinator.json").read_text())
    client = connect(info["address"], read_secret_file(info["secret_file"]), sender="test-crash")
    try:
        before = time.time()
        snap = client.call("status", {}, timeout_s=5.0).body
        after = time.time()
    finally:
        client.close()
    return (before + after) / 2 - float(snap["elapsed_s"])


def _recovery_s(steps: list[dict], survivor: str, kill_rel_s: float) -> float:
    """From the kill to ``survivor``'s first committed step after the step the kill broke."""
    mine = sorted((r for r in steps if r["name"] == survivor), key=lambda r: r["time_s"])
    broken = next(r for r in mine if not r["committed"] and r["time_s"] >= kill_rel_s)
    nxt = next(r for r in mine if r["committed"] and r["time_s"] > broken["time_s"])
    assert nxt["step"] == broken["step"], f"{survivor}: the discarded step was not redone next"
    return float(nxt["time_s"]) - kill_rel_s


def test_sigkilled_worker_survivors_commit_within_two_seconds(tmp_path: Path) -> None:
    proc = start(_args(tmp_path), tmp_path / "launcher.log")
    report = tmp_path / "report"
    try:
        wait_for(
            lambda: any(r["step"] >= KILL_AFTER_STEP for r in training_steps(records(report))),
            60,
            f"step {KILL_AFTER_STEP}",
        )
        t0_unix = _coordinator_t0_unix(tmp_path / "run")
        victim = next(r["pid"] for r in training_steps(records(report)) if r["name"] == "w2")
        kill_rel_s = time.time() - t0_unix
        os.kill(victim, signal.SIGKILL)

        def recovered() -> bool:
            steps = training_steps(records(report))
            return all(
                any(r["committed"] and r["time_s"] > kill_rel_s + 0.5 for r in steps if r["name"] == n)
                and any(not r["committed"] and r["time_s"] >= kill_rel_s for r in steps if r["name"] == n)
                for n in ("w0", "w1")
            )

        # records reach the coordinator with the heartbeat: allow a few beats past the bound
        wait_for(recovered, RECOVERY_BOUND_S + 8, "the survivors' next committed step")
        steps = training_steps(records(report))
        figures = {n: _recovery_s(steps, n, kill_rel_s) for n in ("w0", "w1")}
        print(f"\nrecovery after SIGKILL (kill -> survivors' next committed step): {figures}")
        assert max(figures.values()) < RECOVERY_BOUND_S, figures
        assert proc.wait(timeout=60) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    steps = training_steps(records(report))
    for name in ("w0", "w1"):  # nothing lost, nothing applied twice
        committed = sorted(r["step"] for r in steps if r["name"] == name and r["committed"])
        assert committed == list(range(NUM_STEPS)), f"{name}: a step was lost or applied twice"
