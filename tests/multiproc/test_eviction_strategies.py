"""Real processes, ``flotilla run`` (issue 37 item 1, beyond all-reduce): under every strategy
that trains with the coordinator, a worker frozen (SIGSTOP) past ``cluster.heartbeat_timeout_s``
is declared dead, the job goes on, and once woken (SIGCONT) the same process rejoins as a
newcomer and commits steps again under a new worker id.  Under ``ps`` the servers evicted it
too: its first push after waking is refused (``unknown_worker``), which ends its session evicted,
not failed (``CoordinatedMembership.removed``, ``roles/worker.py``).

``allreduce`` (the summary, the interrupt, the run directory) is ``test_eviction.py``.  Every
wait is for an event (a log line, a record); the timeouts are safety nets.
"""

from __future__ import annotations

import os
import signal
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
}
KINDS = {  # kind -> its strategy section (the rest: examples/tiny.yaml's)
    "ps": {"kind": "ps", "num_servers": 2, "consistency": {"kind": "ssp", "staleness": 2}},
    "partial_reduce": {"kind": "partial_reduce", "group_size": 2},
    "adpsgd": {"kind": "adpsgd"},
    "diloco": {"kind": "diloco", "inner_steps": 4, "step_timeout_s": 30.0},
}


def _args(tmp: Path, kind: str) -> list[str]:
    cfg = yaml.safe_load(Path("examples/tiny.yaml").read_text())
    cfg["strategy"] = KINDS[kind]
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    flat = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    return ["run", str(tmp / "job.yaml"), "--report", str(tmp / "report"), "--run-dir", str(tmp / "run"),
            "--no-progress", *flat]  # fmt: skip


def _committed(report: Path, name: str) -> list[dict]:
    return [r for r in training_steps(records(report)) if r["name"] == name and r["committed"]]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_frozen_worker_declared_dead_rejoins_under_every_strategy(tmp_path: Path, kind: str) -> None:
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "launcher.log"
    proc = start(_args(tmp_path, kind), log)
    victim = 0
    try:
        wait_for(lambda: all(_committed(report, n) for n in ("w0", "w1", "w2")) or proc.poll() is not None,
                 180, "every worker committing")  # fmt: skip
        assert proc.poll() is None, log.read_text()[-3000:]
        victim = int(_committed(report, "w2")[0]["pid"])
        old_ids = {r["worker_id"] for r in _committed(report, "w2")}
        frozen_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: "(w2) declared dead" in log.read_text() or proc.poll() is not None,
                 120, "the coordinator to declare w2 dead")  # fmt: skip
        timeout_s = float(SETS["cluster.heartbeat_timeout_s"])  # (frozen past it: test_eviction.py)
        time.sleep(max(0.0, timeout_s + 0.1 - (time.monotonic() - frozen_at)))
        woke, pid = time.monotonic(), victim
        os.kill(victim, signal.SIGCONT)
        victim = 0

        def back() -> list[dict]:
            return [r for r in _committed(report, "w2") if r["worker_id"] not in old_ids]

        wait_for(lambda: bool(back()) or proc.poll() is not None, 120, "the woken w2 committing again")
        print(f"\n{kind}: SIGCONT -> the woken worker's first committed step as a newcomer: "
              f"<= {time.monotonic() - woke:.2f} s")  # fmt: skip
        assert proc.poll() is None, log.read_text()[-3000:]
        assert min(back(), key=lambda r: r["step"])["pid"] == pid  # the same process, a new membership
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if victim:
            os.kill(victim, signal.SIGCONT)
        stop(proc)
    worker_log = (run_dir / "w2.log").read_text()
    assert " evicted: " in worker_log, worker_log[-3000:]
    assert "rejoining as a newcomer" in worker_log, worker_log[-3000:]
