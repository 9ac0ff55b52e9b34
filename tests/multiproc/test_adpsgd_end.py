"""AD-PSGD's end under ``flotilla run`` (``sync/adpsgd_end.py``): the worker that averaged the
final replicas dies before it reported the job's result -- the job still completes, another
finished worker takes the average over (of the replicas that live) and reports it.

Deterministic, without a timing window: every worker SIGSTOPs itself when it is about to report
the job's result (a ``finish`` fault, ``core/faults.py``); the test SIGKILLs the first one it finds
stopped (the collector, its average logged) and lets the next one go on (SIGCONT)."""

from __future__ import annotations

import json
import os
import signal
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


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] == "T"
    except FileNotFoundError:
        return False


def _consensus_lines(run_dir: Path) -> list[str]:
    return [
        line
        for f in sorted(run_dir.glob("w*.log"))
        for line in f.read_text().splitlines()
        if "averages the replicas" in line or "takes over" in line
    ]


def test_the_collector_killed_before_it_reports_another_finished_worker_takes_over(tmp_path: Path) -> None:
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "run.log"
    args = ["run", "examples/adpsgd.yaml", "--report", str(report), "--run-dir", str(run_dir)]
    args.append("--no-progress")
    args += [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    plan = FaultPlan(tuple(Fault(worker=n, step=0, phase="finish", action="stop") for n in NAMES))
    proc = start(args, log, env={"FLOTILLA_FAULTS": plan.to_json()})
    pids: dict[str, int] = {}
    handled: list[str] = []

    def next_stopped() -> bool:
        for r in training_steps(records(report)):
            pids.setdefault(r["name"], r["pid"])
        return proc.poll() is not None or any(_stopped(pid) for n, pid in pids.items() if n not in handled)

    try:
        for action in (signal.SIGKILL, signal.SIGCONT):  # the collector, then the one taking over
            wait_for(next_stopped, 400, "a worker stopped before it reports the job's result", poll_s=0.02)
            assert proc.poll() is None, log.read_text()[-3000:]
            name = next(n for n, pid in pids.items() if n not in handled and _stopped(pid))
            os.kill(pids[name], action)
            handled.append(name)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
        for pid in pids.values():  # (none is left stopped behind the test)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    victim, taker = handled
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    ids = {r["name"]: r["worker_id"] for r in training_steps(records(report))}
    stats = summary["strategy_stats"]
    # the survivors' final replicas, all of them, and not the victim's (it died with it)
    assert stats["consensus_of"] == sorted(i for n, i in ids.items() if n != victim), stats
    assert ids[victim] in stats["finished_then_died"], stats
    assert [m["name"] for m in summary["members_lost"]] == [victim]
    lines = _consensus_lines(run_dir)
    assert any(f"worker {ids[taker]} takes over" in line for line in lines), lines
    assert (report / "model.safetensors").exists() or summary.get("model_file"), summary
    assert processes_mentioning(str(tmp_path)) == []
