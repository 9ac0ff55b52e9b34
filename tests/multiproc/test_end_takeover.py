"""The worker that was to report the job's result dies at the very end, before it reported: the
job still completes, another finished worker reports it (``SyncStrategy.take_over``) -- under
AD-PSGD, by its own rule: the next finished worker takes the average of the final replicas over
(of those that live; ``sync/adpsgd_end.py``); under all-reduce and DiLoCo, where every member
trained the same last step, the one the coordinator names (``rendezvous.reporter``).

Deterministic, without a timing window: every worker SIGSTOPs itself when it is about to report
the job's result (a ``finish`` fault, ``core/faults.py``); the test SIGKILLs the first one it finds
stopped (the reporter) and lets the next one go on (SIGCONT)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from flotilla.core.faults import Fault, FaultPlan

from ._jobs import processes_mentioning, records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(600)

NAMES = ("w0", "w1", "w2", "w3")
SETS = {
    "cluster.workers": "[{name: w0}, {name: w1}, {name: w2}, {name: w3, speed: 0.1}]",
    "cluster.defaults.speed": "0.3",  # (emulated slower than the host)
    "job.steps": "200",
    "job.epochs": "null",
    "job.eval_every_steps": "0",
    "job.dataset.num_samples": "4000",
    "strategy.exchange_timeout_s": "1.0",
}


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped, ``Z``: exited, not reaped); ``X``: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0]
    except FileNotFoundError:
        return "X"


def _stopped(pid: int) -> bool:
    return _state(pid) == "T"


def _running_besides(pids: dict[str, int], name: str) -> int:
    """How many worker processes other than ``name``'s have not exited."""
    return sum(1 for n, pid in pids.items() if n != name and _state(pid) not in "ZX")


def _consensus_lines(run_dir: Path) -> list[str]:
    return [
        line
        for f in sorted(run_dir.glob("w*.log"))
        for line in f.read_text().splitlines()
        if "averages the replicas" in line or "takes over" in line
    ]


def _kill_the_reporter(
    tmp_path: Path, *sets: str, standby_only: bool = False
) -> tuple[dict, str, str, dict[str, int]]:
    """Run with ``sets``; SIGKILL the first worker about to report the result, let the next go on:
    (the summary, the victim's name, the taker's, worker ids by name).  ``standby_only``: the
    finished workers leave at once but one (``rendezvous.standby``) -- the kill waits for that."""
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "run.log"
    args = ["run", "examples/adpsgd.yaml", "--report", str(report), "--run-dir", str(run_dir)]
    args.append("--no-progress")
    args += [a for kv in (*(f"{k}={v}" for k, v in SETS.items()), *sets) for a in ("--set", kv)]
    plan = FaultPlan(tuple(Fault(worker=n, step=0, phase="finish", action="stop") for n in NAMES))
    proc = start(args, log, env={"FLOTILLA_FAULTS": plan.to_json()})
    pids: dict[str, int] = {}
    handled: list[str] = []

    def next_stopped() -> bool:
        for r in training_steps(records(report)):
            pids.setdefault(r["name"], r["pid"])
        return proc.poll() is not None or any(_stopped(pid) for n, pid in pids.items() if n not in handled)

    at: list[float] = []
    try:
        for action in (signal.SIGKILL, signal.SIGCONT):  # the reporter, then the one taking over
            wait_for(next_stopped, 400, "a worker stopped before it reports the job's result", poll_s=0.02)
            assert proc.poll() is None, log.read_text()[-3000:]
            name = next(n for n, pid in pids.items() if n not in handled and _stopped(pid))
            if standby_only and action == signal.SIGKILL:  # (every other worker but one is gone)
                left = lambda v=name: _running_besides(pids, v) == 1
                wait_for(left, 60, "every finished worker but the standby left")
            at.append(time.monotonic())
            os.kill(pids[name], action)
            handled.append(name)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
        # (the latency: the reporter's death -> the next one about to report, found by 20-ms polls)
        print(f"takeover: {handled[1]} ready to report {at[1] - at[0]:.2f} s after {handled[0]} was killed")
    finally:
        stop(proc)
        for pid in pids.values():  # (none is left stopped behind the test)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    assert [m["name"] for m in summary["members_lost"]] == [handled[0]]
    assert processes_mentioning(str(tmp_path)) == []
    ids = {r["name"]: r["worker_id"] for r in training_steps(records(report))}
    return summary, handled[0], handled[1], ids


def test_the_collector_killed_before_it_reports_another_finished_worker_takes_over(tmp_path: Path) -> None:
    summary, victim, taker, ids = _kill_the_reporter(tmp_path)
    stats = summary["strategy_stats"]
    # the survivors' final replicas, all of them, and not the victim's (it died with it)
    assert stats["consensus_of"] == sorted(i for n, i in ids.items() if n != victim), stats
    assert ids[victim] in stats["finished_then_died"], stats
    lines = _consensus_lines(tmp_path / "run")
    assert any(f"worker {ids[taker]} takes over" in line for line in lines), lines
    assert summary.get("model_file"), summary


@pytest.mark.parametrize(
    "strategy",
    [
        "{kind: allreduce}",
        "{kind: diloco, inner_steps: 10}",
        "{kind: partial_reduce, group_size: 2}",
        "{kind: ps}",
    ],
    ids=["allreduce", "diloco", "partial_reduce", "ps"],
)
def test_the_reporter_killed_at_the_end_the_next_member_reports_it(tmp_path: Path, strategy: str) -> None:
    summary, victim, taker, ids = _kill_the_reporter(
        tmp_path, f"strategy={strategy}", standby_only=strategy.startswith("{kind: ps")
    )
    assert summary["steps"] == 200 and summary.get("model_file"), summary
    taker_log = (tmp_path / "run" / f"{taker}.log").read_text()
    took_over = f"worker {ids[taker]} reports the job's result" in taker_log
    # (under partial reduce a straggler may still train when the reporter dies: it ends as its new
    # view's rank 0 and reports as such -- that it reached the report is what its fault showed)
    assert took_over or "partial_reduce" in strategy, taker_log[-2000:]
