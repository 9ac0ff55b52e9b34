"""The chaos run shared by ``test_chaos.py`` (in ``make test``) and the soak
(``tests/soak/test_chaos_soak.py``, ``-m slow``): ``flotilla run`` with 5 allreduce workers on a
tiny paced model (``_chaos_task.py``), a seeded random killer (``cluster.revocations.random``:
SIGKILL without notice, respawn after ``respawn_after_s``) among w0..w3 and SIGSTOPs of w4
(explicit ``stop`` events), then the run's records judged by ``flotilla.report.chaos_check``.

Machine independence: the schedule is in seconds, so the job must outlast it on any machine.
Each training step lasts at least ``pace_s`` (the task's forward), and the schedule's clock starts
at the job's step 1 (``revocations.time_from_step``), so ``steps = 1 + (chaos_s + margin) /
pace_s`` steps cannot end before the last revocation and its recovery, however fast the machine;
on a slower machine the job is longer, never shorter.  No wait is a sleep: the
run is waited for (its exit), with a timeout only as a safety net.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.cluster.peer_watch import PeerWatchPolicy
from flotilla.config import RunConfig, load_config
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.report.chaos_check import ChaosLimits, ChaosVerdict, check_chaos
from flotilla.report.membership import recoveries
from flotilla.report.metrics import read_jsonl

from ._jobs import alive, processes_mentioning, start, stop

TASK = Path(__file__).with_name("_chaos_task.py")
STOPPED = "w4"  # the worker the SIGSTOPs freeze (random kills take the others)
END_MARGIN_S = 4.0  # training after the last random kill, on the fastest machine
# Beyond twice the detection timeout a gap may hold one recovery: the survivors' new group
# (rendezvous, state agreement, a newcomer's state transfer) and the redo of the broken step.
# Measured here: 0.2-0.7 s; the allowance is the larger of a fixed floor and this many steps.
RECOVERY_ALLOWANCE_S = 1.5
RECOVERY_ALLOWANCE_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class ChaosPlan:
    chaos_s: float  # random kills until this many seconds after the job's start
    mean_interval_s: float = 4.0
    seed: int = 102
    start_s: float = 1.0
    respawn_after_s: float = 3.0
    stops_at_s: tuple[float, ...] = (16.0,)
    stop_duration_s: float = 5.0
    pace_s: float = 0.05
    num_workers: int = 5
    peer_heartbeat_s: float = 0.25
    batch_size: int = 64
    num_samples: int = 1000

    @property
    def steps(self) -> int:
        return 1 + math.ceil((max(self.chaos_s, *self.stop_ends_s) + END_MARGIN_S) / self.pace_s)

    @property
    def stop_ends_s(self) -> tuple[float, ...]:
        return tuple(at + self.stop_duration_s for at in self.stops_at_s)

    def config(self) -> dict[str, Any]:
        stops = [
            {"at_s": at, "action": "stop", "worker": STOPPED, "duration_s": self.stop_duration_s}
            for at in self.stops_at_s
        ]
        killer = {
            "mean_interval_s": self.mean_interval_s,
            "seed": self.seed,
            "respawn_after_s": self.respawn_after_s,
            "start_s": self.start_s,
            "stop_s": self.chaos_s,
            "min_alive": self.num_workers - 1,  # one victim at a time (module doc)
        }
        return {
            "cluster": {
                "num_workers": self.num_workers,
                "peer_heartbeat_s": self.peer_heartbeat_s,
                # every time counts from the job's step 1: revocations begin when training does
                "revocations": {"events": stops, "random": killer, "time_from_step": 1},
            },
            "job": {
                "task": f"{TASK}:PacedMLP",
                "task_args": {"pace_s": self.pace_s, "num_samples": self.num_samples},
                "batch_size": self.batch_size,
                "steps": self.steps,
                "eval_every_steps": 0,
                "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
            },
            "strategy": {"kind": "allreduce", "step_timeout_s": 30.0, "on_abort": "redo"},
            "report": {"metrics_every_steps": 1, "digest_every_steps": 1},
        }


@dataclass(kw_only=True)
class ChaosRun:
    plan: ChaosPlan
    cfg: RunConfig
    report: Path
    run_dir: Path
    returncode: int
    output: str
    wall_s: float
    launcher_pid: int
    leftover: list[int]  # processes of the run still alive after the launcher exited
    records: list[dict[str, Any]] = field(default_factory=list)
    revocations: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def run_chaos(tmp: Path, plan: ChaosPlan, timeout_s: float) -> ChaosRun:
    """Run the job to its end (or kill it after ``timeout_s``, a safety net) and collect it."""
    path = tmp / "chaos.json"
    path.write_text(json.dumps(plan.config()))
    cfg = load_config(path, [])
    report, run_dir, log = tmp / "report", tmp / "run", tmp / "launcher.log"
    args = ["run", str(path), "--report", str(report), "--run-dir", str(run_dir), "--no-progress"]
    began = time.monotonic()
    proc = start(args, log)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        wall_s = time.monotonic() - began
        stop(proc)  # (a no-op when it exited by itself)
    run = ChaosRun(
        plan=plan,
        cfg=cfg,
        report=report,
        run_dir=run_dir,
        returncode=proc.returncode,
        output=log.read_text(errors="replace"),
        wall_s=wall_s,
        launcher_pid=proc.pid,
        leftover=[],
    )
    run.records = read_jsonl(report / "metrics.jsonl", missing_ok=True)
    run.revocations = read_jsonl(report / "revocations.jsonl", missing_ok=True)
    if (report / "summary.json").exists():
        run.summary = json.loads((report / "summary.json").read_text())
    run.leftover = leftover_processes(run)
    return run


def leftover_processes(run: ChaosRun) -> list[int]:
    """Every process the run started (the launcher, each worker process that recorded, was
    revoked or added) that is still alive, plus any process naming the run directory."""
    pids = {run.launcher_pid, *(int(r["pid"]) for r in run.records if "pid" in r)}
    pids |= {int(r["pid"]) for r in run.revocations}
    pids |= {int(w["pid"]) for w in run.summary.get("workers", []) if w.get("pid")}
    return sorted({p for p in pids if alive(p)} | set(processes_mentioning(str(run.run_dir))))


def sampler_of(run: ChaosRun) -> GlobalBatchSampler:
    """The workers' sampler, as ``trainer/builders.task_sampler`` builds it over the task's
    ``num_samples`` training samples (without loading torch here)."""
    job = run.cfg.job
    return GlobalBatchSampler(
        num_samples=run.plan.num_samples, global_batch_size=job.batch_size, seed=job.seed
    )


def detection_timeout_s(plan: ChaosPlan) -> float:
    """The neighbour watch's bound for a frozen peer: suspected within ``limit_s + period_s``
    (2 heartbeat intervals) of its last answer (``cluster/peer_watch.py``)."""
    policy = PeerWatchPolicy(interval_s=plan.peer_heartbeat_s)
    return policy.limit_s + policy.period_s


def step_interval_p50_s(records: list[dict[str, Any]]) -> float:
    """The median time between consecutive steps' first commits: the machine's observed pace."""
    firsts: dict[int, float] = {}
    for r in records:
        if r.get("committed") and r.get("kind") != "eval":
            firsts[int(r["step"])] = min(firsts.get(int(r["step"]), math.inf), float(r["time_s"]))
    ordered = [firsts[s] for s in sorted(firsts)]
    return statistics.median(b - a for a, b in zip(ordered, ordered[1:]))


def max_gap_s(run: ChaosRun) -> float:
    """No hang: twice the detection timeout, plus one recovery and a redo (module constants),
    the latter scaled by the pace observed in this run."""
    allowance = max(RECOVERY_ALLOWANCE_S, RECOVERY_ALLOWANCE_STEPS * step_interval_p50_s(run.records))
    return 2 * detection_timeout_s(run.plan) + allowance


def verdict(run: ChaosRun) -> ChaosVerdict:
    killed = frozenset(int(r["pid"]) for r in run.revocations if r["action"] == "kill")
    limits = ChaosLimits(
        total_steps=run.plan.steps,
        sampler=sampler_of(run),
        max_gap_s=max_gap_s(run),
        digest_every_steps=run.cfg.report.digest_every_steps,
        killed_pids=killed,
    )
    return check_chaos(run.records, limits)


def recovery_times(run: ChaosRun) -> tuple[list[dict[str, Any]], list[float]]:
    """Each kill/stop with its recovery (``report/membership.recoveries``: from the revocation
    to the first committed step in a newer membership epoch), and the recovery times of those
    that hit a member of the view."""
    done = recoveries(run.records, run.revocations)
    return done, [float(r["recovery_s"]) for r in done if r["member"] and r["recovery_s"] is not None]
