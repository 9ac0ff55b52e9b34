"""Real processes: SIGKILL one worker of three mid-training; the survivors commit their next step
within 2 s (issue 11: they used to wait ``2 x step_timeout_s + 5`` s in a rendezvous that still
held the dead worker).  Prints the measured recovery time.

Recovery time = the survivors' first committed step after the step the kill broke (its
``time_s``, seconds since the coordinator's t0) minus the kill instant on the same scale (t0 is
read from the coordinator's ``status``: ``now - elapsed_s``).

Atomicity (SPEC §7): each survivor either redoes the step the kill broke or, when the kill broke
the vote after another survivor had completed it, takes that step over with the new view's
most advanced state (roll-forward); either way no step is lost or applied twice, and the
survivors' parameter digests agree at every step both committed.

Independent of the machine's speed: the job is far longer than the test ever lets it run (it is
stopped with Ctrl-C once the survivors have trained on in the new view), the kill follows
observed progress, and every wait is for an event; a wait's timeout is only a safety net, far
above the asserted bound (the bound is checked on the measured figure, not by a timeout).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import read_secret_file
from flotilla.roles.coordinator_clock import coordinator_t0_unix

from ._jobs import interrupt, records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

STEP_TIMEOUT_S = 30.0  # the default: the old code took 2 x 30 + 5 s to recover
RECOVERY_BOUND_S = 2.0
NUM_STEPS = 1_000_000  # never reached: the test stops the job once it has seen what it needs
KILL_AFTER_STEP = 20
STEPS_AFTER_RECOVERY = 20  # committed by each survivor in the new view before the job is stopped
SURVIVORS = ("w0", "w1")
# Safety net for the survivors' recovery: above the old code's stall, so a regression is
# reported with its measured figure instead of as a timeout.
RECOVERY_WAIT_S = 2 * STEP_TIMEOUT_S + 30


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
    return coordinator_t0_unix(info["address"], read_secret_file(info["secret_file"]), sender="test-crash")


def _broken_and_next(steps: list[dict], survivor: str, kill_rel_s: float) -> tuple[dict, dict] | None:
    """``survivor``'s first discarded step at or after the kill and its first commit after that."""
    mine = sorted((r for r in steps if r["name"] == survivor), key=lambda r: r["time_s"])
    broken = next((r for r in mine if not r["committed"] and r["time_s"] >= kill_rel_s), None)
    if broken is None:
        return None
    nxt = next((r for r in mine if r["committed"] and r["time_s"] > broken["time_s"]), None)
    return None if nxt is None else (broken, nxt)


def _recovery(steps: list[dict], survivor: str, kill_rel_s: float) -> tuple[float, int, list[int]]:
    """From the kill to ``survivor``'s first committed step after the step the kill broke (s),
    that step, and the steps it took over from another survivor (a roll-forward, see below)."""
    found = _broken_and_next(steps, survivor, kill_rel_s)
    assert found is not None, f"{survivor}: no discarded step followed by a commit after the kill"
    broken, nxt = found
    # Redo: the discarded step is run again.  Roll-forward: the kill broke the vote after another
    # survivor had completed it (it committed the step); the new view's state agreement hands the
    # most advanced state to everyone, so this survivor goes on after the step it discarded.
    skipped = list(range(int(broken["step"]), int(nxt["step"])))
    committed_by_others = {r["step"] for r in steps if r["committed"] and r["name"] != survivor}
    assert nxt["step"] >= broken["step"] and set(skipped) <= committed_by_others, (
        f"{survivor}: discarded step {broken['step']}, next committed {nxt['step']}: "
        "neither redone nor taken over from a survivor that committed it"
    )
    return float(nxt["time_s"]) - kill_rel_s, int(nxt["step"]), skipped


def _committed_after(steps: list[dict], survivor: str, step: int) -> int:
    return sum(1 for r in steps if r["name"] == survivor and r["committed"] and r["step"] > step)


def test_sigkilled_worker_survivors_commit_within_two_seconds(tmp_path: Path) -> None:
    proc = start(_args(tmp_path), tmp_path / "launcher.log")
    report = tmp_path / "report"
    log = tmp_path / "launcher.log"
    try:
        # kill on observed progress: every worker has committed steps, the job has ~all left
        wait_for(
            lambda: (
                all(
                    any(r["name"] == n and r["committed"] and r["step"] >= KILL_AFTER_STEP for r in steps)
                    for steps in [training_steps(records(report))]
                    for n in (*SURVIVORS, "w2")
                )
                or proc.poll() is not None
            ),
            120,
            f"every worker past step {KILL_AFTER_STEP}",
        )
        assert proc.poll() is None, f"the job ended before the kill: {log.read_text()[-3000:]}"
        t0_unix = _coordinator_t0_unix(tmp_path / "run")
        victim = next(r["pid"] for r in training_steps(records(report)) if r["name"] == "w2")
        kill_rel_s = time.time() - t0_unix
        os.kill(victim, signal.SIGKILL)

        def recovered() -> bool:
            steps = training_steps(records(report))
            return all(_broken_and_next(steps, n, kill_rel_s) is not None for n in SURVIVORS)

        # records reach the coordinator with the heartbeat: the figure comes from their time_s
        wait_for(
            lambda: recovered() or proc.poll() is not None,
            RECOVERY_WAIT_S,
            "the survivors' next committed step",
        )
        steps = training_steps(records(report))
        measured = {n: _recovery(steps, n, kill_rel_s) for n in SURVIVORS}
        figures = {n: seconds for n, (seconds, _, _) in measured.items()}
        redone = {n: step for n, (_, step, _) in measured.items()}
        taken_over = {n: skipped for n, (_, _, skipped) in measured.items()}
        print(f"\nrecovery after SIGKILL (kill -> survivors' next committed step): {figures}")

        # the survivors train on in the new view; then the job is stopped like a terminal's Ctrl-C
        wait_for(
            lambda: (
                all(
                    _committed_after(training_steps(records(report)), n, redone[n]) >= STEPS_AFTER_RECOVERY
                    for n in SURVIVORS
                )
                or proc.poll() is not None
            ),
            120,
            f"{STEPS_AFTER_RECOVERY} committed steps after the redone step",
        )
        assert proc.poll() is None, f"the job ended early: {log.read_text()[-3000:]}"
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        stop(proc)
    steps = training_steps(records(report))
    for name in SURVIVORS:  # nothing lost, nothing applied twice
        committed = sorted(r["step"] for r in steps if r["name"] == name and r["committed"])
        assert len(set(committed)) == len(committed), f"{name}: a step was applied twice"
        applied = sorted(committed + taken_over[name])
        assert applied == list(range(len(applied))), f"{name}: a step was lost"
        assert len(applied) > redone[name] + STEPS_AFTER_RECOVERY
    digests: dict[int, set[str]] = {}  # replicas bitwise identical at every step both committed
    for r in steps:
        if r["name"] in SURVIVORS and r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert digests and all(len(d) == 1 for d in digests.values()), "the survivors' replicas differ"
    after = {r["world_size"] for r in steps if r["name"] in SURVIVORS and r["step"] > max(redone.values())}
    assert after == {2}, f"the survivors did not go on as two: world sizes {after}"
    assert max(figures.values()) < RECOVERY_BOUND_S, figures
