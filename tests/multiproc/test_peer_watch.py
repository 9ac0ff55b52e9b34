"""Real processes: ring neighbours notice a revoked peer themselves (``roles/peer_link.py``), with
no notice from a launcher and well before any timeout:

- a FROZEN worker (SIGSTOP: its sockets stay open, no collective fails, its survivors just wait
  in the all-reduce) is left behind within a few heartbeat intervals, and when it wakes up
  (SIGCONT) it comes back as a newcomer and trains on with the others;
- a worker SIGKILLed under a coordinator started by hand (no launcher: nobody sends a death
  notice, the coordinator's own silence rule needs ``heartbeat_timeout_s`` = 10 s) is left
  behind just as fast.

Each test prints the measured figure: the signal -> the survivors' first committed step in a view
without the victim.  The bound asserted (3 s) is far below what recovery cost before
(``heartbeat_timeout_s`` = 10 s, or ``step_timeout_s`` = 30 s for a frozen worker) and far above
the two heartbeat intervals (0.5 s) detection takes, so a slow machine passes and a regression
fails.  Every wait is for an event; survivors' replicas must agree at every step they committed.
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

from ._jobs import interrupt, records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

BOUND_S = 3.0
WARM_STEP = 20
SETS = {
    "cluster.num_workers": "3",
    "cluster.defaults.speed": "0.05",  # steps of a few tens of ms
    "job.steps": "1000000",  # never reached: the test stops the job
    "job.eval_every_steps": "0",
    "strategy.step_timeout_s": "30",
}
SET_ARGS = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]


def _warm(report: Path, names: tuple[str, ...], procs: list[subprocess.Popen]) -> None:
    wait_for(
        lambda: (
            all(
                any(r["name"] == n and r["committed"] and r["step"] >= WARM_STEP for r in steps)
                for steps in [training_steps(records(report))]
                for n in names
            )
            or any(p.poll() is not None for p in procs)
        ),
        180,
        f"every worker past step {WARM_STEP}",
    )
    assert all(p.poll() is None for p in procs), "a process ended before the revocation"


def _t0_unix(address: str, secret_file: Path) -> float:
    """The coordinator's t0 on this machine's clock (records' ``time_s`` are seconds since it)."""
    from flotilla.comm.auth import read_secret_file
    from flotilla.roles.coordinator_clock import coordinator_t0_unix

    return coordinator_t0_unix(address, read_secret_file(secret_file), sender="test-peers")


def _left_behind(report: Path, survivors: tuple[str, ...], since_s: float) -> float | None:
    """Seconds from ``since_s`` (coordinator time) to the last survivor's first committed step in
    a view of just the survivors (None: not yet)."""
    steps = training_steps(records(report))
    firsts = []
    for n in survivors:
        mine = [
            float(r["time_s"])
            for r in steps
            if r["name"] == n
            and r["committed"]
            and r["world_size"] == len(survivors)
            and r["time_s"] >= since_s
        ]
        if not mine:
            return None
        firsts.append(min(mine))
    return max(firsts) - since_s


def _digests_agree(report: Path, names: tuple[str, ...]) -> None:
    digests: dict[int, set[str]] = {}
    for r in training_steps(records(report)):
        if r["name"] in names and r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert digests and all(len(d) == 1 for d in digests.values()), "the replicas differ"


def _pid(report: Path, name: str) -> int:
    return int(next(r["pid"] for r in training_steps(records(report)) if r["name"] == name))


def test_a_frozen_worker_is_left_behind_and_comes_back(tmp_path: Path) -> None:
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "launcher.log"
    args = ["run", "examples/tiny.yaml", "--report", str(report), "--run-dir", str(run_dir), "--no-progress"]
    proc = start([*args, *SET_ARGS], log)
    victim_pid = 0
    try:
        _warm(report, ("w0", "w1", "w2"), [proc])
        info = json.loads((run_dir / "coordinator.json").read_text())
        t0 = _t0_unix(info["address"], Path(info["secret_file"]))
        victim_pid = _pid(report, "w2")
        stopped_s = time.time() - t0
        os.kill(victim_pid, signal.SIGSTOP)
        wait_for(lambda: _left_behind(report, ("w0", "w1"), stopped_s) is not None, 120, "a view without w2")
        figure = _left_behind(report, ("w0", "w1"), stopped_s)
        print(f"\nSIGSTOP -> the survivors' first committed step without the frozen worker: {figure:.3f} s")
        woke_s = time.time() - t0
        os.kill(victim_pid, signal.SIGCONT)
        victim_pid = 0

        def back() -> bool:
            steps = training_steps(records(report))
            return any(
                r["name"] == "w2" and r["committed"] and r["world_size"] == 3 and r["time_s"] > woke_s
                for r in steps
            )

        wait_for(lambda: back() or proc.poll() is not None, 120, "the frozen worker back in a view of three")
        assert proc.poll() is None, log.read_text()[-3000:]
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if victim_pid:
            os.kill(victim_pid, signal.SIGCONT)
        stop(proc)
    _digests_agree(report, ("w0", "w1", "w2"))
    assert figure is not None and figure < BOUND_S, figure


def test_a_worker_killed_without_notice_is_left_behind(tmp_path: Path) -> None:
    report, secret = tmp_path / "report", tmp_path / "secret"
    write_secret_file(secret, generate_secret())
    coord_log = tmp_path / "coordinator.log"
    coord = start(
        [
            "coordinator",
            "examples/tiny.yaml",
            "--secret-file",
            str(secret),
            "--report",
            str(report),
            *SET_ARGS,
        ],
        coord_log,
    )
    procs = [coord]
    try:
        wait_for(
            lambda: "listening on" in coord_log.read_text() or coord.poll() is not None,
            120,
            "the coordinator",
        )
        address = coord_log.read_text().split("listening on", 1)[1].split()[0]
        for name in ("w0", "w1", "w2"):
            args = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", name]
            procs.append(start(args, tmp_path / f"{name}.log"))
        _warm(report, ("w0", "w1", "w2"), procs)
        t0 = _t0_unix(f"tcp://{address}", secret)
        killed_s = time.time() - t0
        os.kill(_pid(report, "w2"), signal.SIGKILL)  # no launcher: nobody tells the coordinator
        wait_for(lambda: _left_behind(report, ("w0", "w1"), killed_s) is not None, 120, "a view without w2")
        figure = _left_behind(report, ("w0", "w1"), killed_s)
        print(
            f"\nSIGKILL, no notice -> the survivors' first committed step without the victim: {figure:.3f} s"
        )
    finally:
        for p in procs:
            stop(p)
    _digests_agree(report, ("w0", "w1"))
    assert figure is not None and figure < BOUND_S, figure
