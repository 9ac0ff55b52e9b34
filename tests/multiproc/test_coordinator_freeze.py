"""Real processes (issue 37 item 2): a frozen coordinator stops nothing, and its workers are back
with it when it wakes.

``flotilla coordinator`` and three ``flotilla worker`` processes started by hand; once they train,
the coordinator is frozen (SIGSTOP: its process lives, so its liveness connections stay open and
nothing proves it gone) for three heartbeat timeouts.  Each worker hears nothing for its lease and
margin (``cluster/lease.py``: ``cluster.heartbeat_timeout_s`` plus one heartbeat interval), says
so, and trains on in ring mode -- all three are the whole last view; their records wait in their
links.  After SIGCONT the first reply ends ring mode: every worker says it is back, its records
arrive (commits dated inside the freeze), it commits again, nobody is declared dead, and no step
has two parameter digests.  (Was: each worker gave up after a fixed 30 s and exited orphaned.)

A coordinator whose process is *gone* is the other case: the workers train on without it for good
and repair their ring themselves (``tests/multiproc/test_coordinator_death.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file

from ._jobs import records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

NAMES = ("w0", "w1", "w2")
TIMEOUT_S = 2.0  # cluster.heartbeat_timeout_s: the lease
SETS = {
    "cluster.num_workers": "3",
    "cluster.heartbeat_timeout_s": str(TIMEOUT_S),
    "cluster.defaults.speed": "0.2",
    "job.steps": "1000000",  # never reached: the test stops the job
    "job.eval_every_steps": "0",
}


def _committed(report: Path) -> list[dict]:
    try:
        return [r for r in training_steps(records(report)) if r["committed"]]
    except (OSError, ValueError):
        return []


def test_workers_of_a_frozen_coordinator_train_on_and_are_back_when_it_wakes(tmp_path: Path) -> None:
    report, secret, coord_log = tmp_path / "report", tmp_path / "secret", tmp_path / "coordinator.log"
    write_secret_file(secret, generate_secret())
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(secret), "--report", str(report)]
    coord = start([*args, *sets], coord_log)
    workers: dict[str, subprocess.Popen] = {}
    logs = {n: tmp_path / f"{n}.log" for n in NAMES}
    try:
        wait_for(lambda: "listening on" in coord_log.read_text() or coord.poll() is not None, 120,
                 "the coordinator")  # fmt: skip
        address = coord_log.read_text().split("listening on", 1)[1].split()[0]
        for name in NAMES:
            wargs = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", name]
            workers[name] = start(wargs, logs[name])
        wait_for(
            lambda: (
                {r["name"] for r in _committed(report) if r["step"] >= 5} >= set(NAMES)
                or any(p.poll() is not None for p in [coord, *workers.values()])
            ),
            180,
            "every worker past step 5",
        )
        assert all(p.poll() is None for p in [coord, *workers.values()]), "a process ended early"
        os.killpg(coord.pid, signal.SIGSTOP)
        frozen_at = time.time()
        for name in NAMES:
            wait_for(lambda n=name: "lease (2 s) has lapsed" in logs[n].read_text(), 60, f"{name}: ring mode")
        time.sleep(3 * TIMEOUT_S - (time.time() - frozen_at))  # (the scenario: three timeouts)
        os.killpg(coord.pid, signal.SIGCONT)
        woke_at = time.time()
        for name in NAMES:
            wait_for(lambda n=name: "answers again" in logs[n].read_text(), 60, f"{name} back")
        seen = len(_committed(report))
        wait_for(lambda: {r["name"] for r in _committed(report)[seen:]} == set(NAMES), 60, "commits after")
        assert all(p.poll() is None for p in workers.values()), "a worker exited"
    finally:
        if coord.poll() is None:
            os.killpg(coord.pid, signal.SIGCONT)
            coord.send_signal(signal.SIGINT)  # (the job is endless: stop it as Ctrl-C does)
            try:
                coord.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for p in [coord, *workers.values()]:
            stop(p)
    committed = _committed(report)
    by_step: dict[int, set[str]] = {}
    for r in committed:
        by_step.setdefault(r["step"], set()).add(r["digest"])
    assert not [s for s, d in by_step.items() if len(d) > 1], "a step committed with two parameter sets"
    summary_t0 = _t0(report)
    for name in NAMES:
        times = [summary_t0 + r["time_s"] for r in committed if r["name"] == name]
        during = [t for t in times if frozen_at + TIMEOUT_S + 1.0 < t < woke_at]
        assert during, f"{name} did not commit while the coordinator was frozen"
        after = [t for t in times if t > woke_at]
        print(f"{name}: {len(during)} commits in ring mode, again {after[0] - woke_at:.2f} s after SIGCONT")
        assert after[0] - woke_at <= 10.0
    assert "declared dead" not in coord_log.read_text()


def _t0(report: Path) -> float:
    return float(json.loads((report / "summary.json").read_text())["t0_unix"])
