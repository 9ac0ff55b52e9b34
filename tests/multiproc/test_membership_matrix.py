"""The membership matrix (issue 37 item 3): PyTorch's in-place process-group reconfiguration tests
(``test/distributed/test_c10d_fault_tolerance.py``) translated to ``flotilla run`` with SIGKILLs
rather than polite leaves.  Each scenario is one run of the chaos test's paced job
(``_chaos.py``: every step lasts at least ``pace_s``, and the schedule's clock starts at step 1, so
the job outlasts its schedule on any machine) under an explicit revocation schedule, judged by
``flotilla.report.chaos_check`` -- committed steps strictly increase, every step is committed in
exactly one membership epoch, live replicas agree on every committed step's digest, every sample of
a data epoch is used once, no hang -- and by who trained the last step.

Scenarios: kill the last rank; kill a middle rank; a late join; scale down then up (two kills, two
restarts under the same names); one worker to all (three joins); a worker SIGSTOPped inside an
all-reduce (a fault plan's ``stop`` at the ``sync`` phase), left behind, woken and training
again.  Merge after a split is the partition heal of item 2 (not built yet); a dead worker id
presented again is ``test_eviction.py`` (a worker woken after it was declared dead is answered
``removed`` and rejoins under a new id) and ``tests/inproc/test_coordinator.py`` (stale epochs).

About 15 s per scenario on the 2-core development VM: ``make test-all`` (``-m slow``).
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flotilla.core.faults import Fault, FaultPlan

from ._chaos import END_MARGIN_S, TASK, ChaosRun, run_chaos, verdict
from ._jobs import interrupt, records, start, stop, training_steps, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@dataclass(frozen=True, kw_only=True)
class MatrixPlan:
    """A paced job under explicit revocation events (the fields ``_chaos.verdict`` reads)."""

    num_workers: int
    events: tuple[dict[str, Any], ...]
    pace_s: float = 0.05
    peer_heartbeat_s: float = 0.25
    batch_size: int = 64
    num_samples: int = 1000

    @property
    def steps(self) -> int:
        last = max(float(e["at_s"]) for e in self.events)
        return 1 + math.ceil((last + END_MARGIN_S) / self.pace_s)

    def config(self) -> dict[str, Any]:
        return {
            "cluster": {
                "num_workers": self.num_workers,
                "peer_heartbeat_s": self.peer_heartbeat_s,
                "revocations": {"events": list(self.events), "time_from_step": 1},
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


def _kill(at_s: float, worker: str) -> dict[str, Any]:
    return {"at_s": at_s, "action": "kill", "worker": worker}  # SIGKILL, no notice


def _add(at_s: float, worker: str) -> dict[str, Any]:
    return {"at_s": at_s, "action": "add", "worker": worker}


SCENARIOS: dict[str, tuple[MatrixPlan, set[str]]] = {  # the plan, who trains the last step
    "kill the last rank": (MatrixPlan(num_workers=4, events=(_kill(2.0, "w3"),)), {"w0", "w1", "w2"}),
    "kill a middle rank": (MatrixPlan(num_workers=4, events=(_kill(2.0, "w1"),)), {"w0", "w2", "w3"}),
    "a late join": (MatrixPlan(num_workers=3, events=(_add(2.0, "w3"),)), {"w0", "w1", "w2", "w3"}),
    "scale down then up": (
        MatrixPlan(
            num_workers=4,
            events=(_kill(1.5, "w2"), _kill(2.5, "w3"), _add(4.0, "w2"), _add(5.0, "w3")),
        ),
        {"w0", "w1", "w2", "w3"},
    ),
    "one worker to all": (
        MatrixPlan(num_workers=1, events=(_add(1.0, "w1"), _add(2.0, "w2"), _add(3.0, "w3"))),
        {"w0", "w1", "w2", "w3"},
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_membership_change(tmp_path: Path, scenario: str) -> None:
    plan, last_trainers = SCENARIOS[scenario]
    run: ChaosRun = run_chaos(tmp_path, plan, timeout_s=300.0)  # type: ignore[arg-type]
    print(f"\n{scenario}: {run.wall_s:.1f} s wall, exit {run.returncode}, {plan.steps} steps")
    assert run.returncode == 0, run.output[-3000:]
    assert run.summary.get("completed") and run.summary["steps"] == plan.steps, run.summary
    judged = verdict(run)  # type: ignore[arg-type]
    print(judged.report())
    assert judged.ok, judged.report()
    last = {r["name"] for r in training_steps(run.records) if r["committed"] and r["step"] == plan.steps - 1}
    assert last == last_trainers, (last, scenario)
    assert not run.leftover, run.leftover


def test_a_worker_sigstopped_inside_an_all_reduce_is_left_behind_and_trains_again(tmp_path: Path) -> None:
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "launcher.log"
    sets = {
        "cluster.num_workers": "3",
        "cluster.defaults.speed": "0.05",
        "job.steps": "1000000",  # never reached: the test interrupts the run
        "job.eval_every_steps": "0",
        "report.digest_every_steps": "1",
    }
    args = ["run", "examples/tiny.yaml", "--report", str(report), "--run-dir", str(run_dir), "--no-progress"]
    faults = FaultPlan((Fault(worker="w2", step=30, phase="sync", action="stop"),))
    env = {"FLOTILLA_FAULTS": faults.to_json()}
    proc = start([*args, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))], log, env=env)
    victim = 0
    try:

        def committed(name: str, world: int, after: int = 0) -> list[dict]:
            return [
                r
                for r in training_steps(records(report))
                if r["name"] == name and r["committed"] and r["world_size"] == world and r["step"] > after
            ]

        wait_for(
            lambda: bool(committed("w0", 2)) or proc.poll() is not None, 120, "survivors in a view of two"
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        victim = int(next(r["pid"] for r in training_steps(records(report)) if r["name"] == "w2"))
        with open(f"/proc/{victim}/stat") as fh:
            assert fh.read().rsplit(")", 1)[1].split()[0] == "T"  # stopped, inside step 30's all-reduce
        resumed_after = max(r["step"] for r in committed("w0", 2))
        os.kill(victim, signal.SIGCONT)
        victim = 0
        wait_for(
            lambda: bool(committed("w2", 3, resumed_after)) or proc.poll() is not None,
            120,
            "the woken worker in a view of three",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if victim:
            os.kill(victim, signal.SIGCONT)
        stop(proc)
    digests: dict[int, set[str]] = {}
    steps = sorted(
        {r["step"] for r in training_steps(records(report)) if r["committed"] and r["name"] == "w0"}
    )
    for r in training_steps(records(report)):
        if r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in digests.values()), "replicas differ"
    assert steps == list(range(steps[-1] + 1)), "a survivor skipped or repeated a committed step"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["interrupted"] is True
