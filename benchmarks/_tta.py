"""Time to a target test accuracy of one ``flotilla run``, shared by the benchmarks that compare
strategies by it (``ps_consistency.py``, ``heterogeneity_tta.py``).

The clock starts at the run's first training record (``metrics.jsonl``; process start-up is
excluded) and stops at the first evaluation (``evals.jsonl``) at or above the target.  The run is
stopped (SIGINT: the launcher stops and reaps every process) as soon as the target is reached, or
once its evaluations pass ``max_run_s`` of training time -- or its wall time does, by more than
``GRACE_S``, when evaluations stall -- and then counts as "not reached" (``None``).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from _common import cpu_busy, cpu_jiffies
from flotilla.report.metrics import read_jsonl

GRACE_S = 15.0
POLL_S = 0.2


def start_run(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """Start ``cmd`` (a ``flotilla run``) with SIGINT back to its default in the child: a shell that
    starts the benchmark in the background ignores SIGINT for it, and the run would inherit that
    and not stop when told."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def stop_run(proc: subprocess.Popen) -> str:
    """Stop a run still going (SIGINT: the launcher stops and reaps every process); its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return str(err)


def _first_record(report: Path) -> float | None:
    return min((r["time_s"] for r in read_jsonl(report / "metrics.jsonl", missing_ok=True)), default=None)


def run_to_target(cmd: list[str], cwd: Path, report: Path, target: float, max_run_s: float) -> dict[str, Any]:
    """Run ``cmd`` (a ``flotilla run ... --report report``) until it reaches ``target``; returns
    ``time_to_target_s`` (None: not reached), ``best_accuracy``, ``num_evals``, ``cpu_busy`` (the
    machine's, over the run) and ``command_wall_s``.  A run that fails before the target is a
    ``SystemExit`` with its error output."""
    jiffies, t0 = cpu_jiffies(), time.monotonic()
    proc = start_run(cmd, cwd)
    hit, best, evals, first, first_seen = None, 0.0, [], None, 0.0
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            evals = read_jsonl(report / "evals.jsonl", missing_ok=True)
            best = max([best] + [e["test_accuracy"] for e in evals])
            if first is None and (first := _first_record(report)) is not None:
                first_seen = time.monotonic()
            reached = [e["time_s"] for e in evals if e["test_accuracy"] >= target]
            if reached and first is not None:
                first = _first_record(report)  # once more: a late spooled record may start earlier
                hit = min(reached) - (first if first is not None else 0.0)
                break
            if first is not None and (
                (evals and evals[-1]["time_s"] - first > max_run_s)
                or time.monotonic() - first_seen > max_run_s + GRACE_S
            ):
                break
    finally:
        busy = cpu_busy(jiffies)
        err = stop_run(proc)
    if hit is None and proc.returncode not in (0, 130, -signal.SIGINT):
        raise SystemExit(f"{' '.join(cmd[3:5])} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return {
        "time_to_target_s": hit,
        "best_accuracy": best,
        "num_evals": len(evals),
        "cpu_busy": busy,
        "command_wall_s": time.monotonic() - t0,
    }
