"""Real processes, ``flotilla run`` (issues 18 and 37): a worker frozen past the heartbeat timeout
is neither lost silently nor lost for good.

A worker frozen (SIGSTOP) past ``cluster.heartbeat_timeout_s`` is declared dead and the job goes
on without it; woken (SIGCONT), it learns it was removed, logs why, and rejoins under its name as
a newcomer (a new worker id, the same process: ``cluster/rejoin.py``), receives the current state
and commits steps again in a view of three.  The run is then interrupted (Ctrl-C: SIGINT to the
launcher) and still writes ``summary.json``: ``completed: false``, ``interrupted``, the error, and
the evicted worker in ``members_lost`` (when, why, and under which id it came back) and
``degraded``.  The run directory that held the secret is 0700, and the secret is gone once the
run ended.

The same freeze under ``ps`` (two servers), ``partial_reduce``, ``adpsgd`` and ``diloco``: the
woken worker rejoins and commits again under a new worker id.

Every wait is for an event (a log line, a record, a process's exit); the timeouts are safety nets.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest
import yaml

from ._jobs import interrupt, records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

SETS = {
    "cluster.num_workers": "3",
    "cluster.defaults.speed": "0.05",
    "cluster.heartbeat_timeout_s": "6",  # (above any heartbeat gap of a loaded machine)
    "job.steps": "1000000",  # never reached: the test interrupts the run
    "job.eval_every_steps": "0",
    "strategy.step_timeout_s": "30",
}


def _args(tmp: Path, config: str = "examples/tiny.yaml", drop: tuple[str, ...] = ()) -> list[str]:
    sets = [a for k, v in SETS.items() if k not in drop for a in ("--set", f"{k}={v}")]
    return ["run", config, "--report", str(tmp / "report"), "--run-dir", str(tmp / "run"),
            "--no-progress", *sets]  # fmt: skip


def _committed(report: Path, name: str) -> list[dict]:
    return [r for r in training_steps(records(report)) if r["name"] == name and r["committed"]]


def _freeze_past_the_timeout_and_wake(tmp: Path, args: list[str], label: str) -> dict:
    """Start ``flotilla run args``; once every worker committed, freeze w2 past the heartbeat
    timeout, wake it, wait for its first committed step under a new worker id (the same
    process), then interrupt the run (exit 130).  Returns that step's record."""
    report, log = tmp / "report", tmp / "launcher.log"
    proc = start(args, log)
    victim = 0
    try:
        wait_for(lambda: all(_committed(report, n) for n in ("w0", "w1", "w2")) or proc.poll() is not None,
                 180, "every worker committing")  # fmt: skip
        assert proc.poll() is None, log.read_text()[-3000:]
        run_dir = tmp / "run"
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and (run_dir / "secret").is_file()
        victim = int(_committed(report, "w2")[0]["pid"])
        old_ids = {r["worker_id"] for r in _committed(report, "w2")}
        frozen_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: "(w2) declared dead" in log.read_text() or proc.poll() is not None,
                 120, "the coordinator to declare w2 dead")  # fmt: skip
        # (the coordinator counts the silence from the last heartbeat, up to one interval before
        # the freeze: it may declare the worker dead a little before heartbeat_timeout_s of
        # freeze; the freeze itself lasts longer than the timeout either way)
        timeout_s = float(SETS["cluster.heartbeat_timeout_s"])
        time.sleep(max(0.0, timeout_s + 0.1 - (time.monotonic() - frozen_at)))
        woke, pid = time.monotonic(), victim
        os.kill(victim, signal.SIGCONT)
        victim = 0

        def back() -> list[dict]:
            return [r for r in _committed(report, "w2") if r["worker_id"] not in old_ids]

        wait_for(lambda: bool(back()) or proc.poll() is not None, 120, "the woken w2 committing again")
        took = time.monotonic() - woke  # (an upper bound: the records are polled)
        print(f"\n{label}: SIGCONT -> the woken worker's first committed step as a newcomer: <= {took:.2f} s")
        assert proc.poll() is None, log.read_text()[-3000:]
        first = min(back(), key=lambda r: r["step"])
        assert first["pid"] == pid  # the same process, a new membership
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if victim:
            os.kill(victim, signal.SIGCONT)
        stop(proc)
    worker_log = (tmp / "run" / "w2.log").read_text()
    assert " evicted: " in worker_log, worker_log[-3000:]
    assert "rejoining as a newcomer" in worker_log, worker_log[-3000:]
    return first


def test_a_frozen_worker_declared_dead_logs_its_eviction_and_rejoins_as_a_newcomer(tmp_path: Path) -> None:
    report, run_dir = tmp_path / "report", tmp_path / "run"
    first = _freeze_past_the_timeout_and_wake(tmp_path, _args(tmp_path), "allreduce")
    assert first["world_size"] == 3
    worker_log = (run_dir / "w2.log").read_text()
    assert "evicted: the coordinator removed it from the job" in worker_log, worker_log[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] is True, summary
    assert summary["error"] == "interrupted (Ctrl-C)"
    lost = {m["name"]: m for m in summary["members_lost"]}
    assert set(lost) == {"w2"} and lost["w2"]["at_s"] > 0 and lost["w2"]["why"], summary["members_lost"]
    assert lost["w2"]["rejoined_as"] == first["worker_id"], summary["members_lost"]
    assert "w2 came back" in summary["degraded"]
    assert not (run_dir / "secret").exists()  # the run ended: its secret is gone, its logs stay
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and (run_dir / "w0.log").is_file()


KINDS = {  # kind -> its strategy section (the rest: examples/tiny.yaml's)
    "ps": {"kind": "ps", "num_servers": 2, "consistency": {"kind": "ssp", "staleness": 2}},
    "partial_reduce": {"kind": "partial_reduce", "group_size": 2},
    "adpsgd": {"kind": "adpsgd"},
    "diloco": {"kind": "diloco", "inner_steps": 4, "step_timeout_s": 30.0},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_frozen_worker_declared_dead_rejoins_under_every_strategy(tmp_path: Path, kind: str) -> None:
    """Under ``ps`` the servers evicted it too: its first push after waking is refused
    (``unknown_worker``), which ends its session evicted, not failed
    (``CoordinatedMembership.removed``, ``roles/worker.py``; before, it exited with that error and
    never trained again)."""
    cfg = yaml.safe_load(Path("examples/tiny.yaml").read_text())
    cfg["strategy"] = KINDS[kind]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    args = _args(tmp_path, config=str(tmp_path / "job.yaml"), drop=("strategy.step_timeout_s",))
    _freeze_past_the_timeout_and_wake(tmp_path, args, kind)
