"""Real processes: the coordinator is off the data path (SPEC §7, Spotnik).

The coordinator and the workers are started by hand (``flotilla coordinator`` / ``flotilla
worker``: no launcher, whose death would take the workers with it).  Once the workers train, the
coordinator is SIGKILLed; the workers notice at once (their liveness connection to it ends),
train on, and repair their ring themselves (``roles/ring_driver.py``) when workers die after it:

- two workers SIGKILLed one after the other (4 -> 3 -> 2): each time the survivors commit their
  next step in a view without the victim, and the figure (kill -> that step) is printed; their
  parameter digests agree at every committed step; the records the coordinator could no longer
  receive are in ``records-<name>.jsonl`` beside the report;
- the split-brain rule: two of four workers SIGKILLed at once -- the two survivors agree on a
  view of two, which holds no strict majority of the four, so with no coordinator to confirm it
  they stop (and say so) instead of training on.

The first case runs twice: clean, and with 10 % of each message fault (lost, duplicated, delayed,
reordered requests; lost replies: ``comm/faulty.py``) on the workers' ring-repair messages (op
``ring``), which the repair must survive by its retries (issue 37 item 4); its bound is twice
the clean one (measured 2026-12-01, 36 runs under ``taskset``: medians 1.38 s and 1.16 s, at
most 1.92 s, against 0.08-0.12 s clean).  Until session 42 about one run in ten stalled for
good: a waiting worker's probe passed for the acknowledgement of its own round's pass on its way
back to it, so the lost pass was never sent again (``cluster/ring_repair.py``, "Probes").

Every wait is for an event; the bound asserted (3 s per recovery) is far above what recovery
takes (tenths of a second) and far below the timeouts that would otherwise end the wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.comm.faulty import ENV_VAR, NetFaults
from flotilla.report.metrics import read_run_records

from ._jobs import alive, start, stop, wait_for

pytestmark = pytest.mark.timeout(300)

BOUND_S = 3.0
NAMES = ("w0", "w1", "w2", "w3")
SETS = {
    "cluster.num_workers": "4",
    "cluster.defaults.speed": "0.05",  # steps of a few tens of ms
    "job.steps": "1000000",  # never reached: the test ends the job
    "job.eval_every_steps": "0",
    "report.digest_every_steps": "1",
    "strategy.step_timeout_s": "30",
}
SET_ARGS = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]


def _all_steps(report: Path) -> list[dict]:
    """Training records: the coordinator's (while it lived) and the workers' spooled ones."""
    return read_run_records(report)


def _first_in(report: Path, names: tuple[str, ...], world: int, since_s: float) -> float | None:
    """Seconds from ``since_s`` until every one of ``names`` committed a step in a view of
    ``world`` members (None: not yet)."""
    firsts = []
    steps = _all_steps(report)
    for n in names:
        mine = [
            float(r["time_s"])
            for r in steps
            if r["name"] == n and r["committed"] and r["world_size"] == world and r["time_s"] >= since_s
        ]
        if not mine:
            return None
        firsts.append(min(mine))
    return max(firsts) - since_s


def _digests_agree(report: Path) -> int:
    digests: dict[int, set[str]] = {}
    for r in _all_steps(report):
        if r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert digests and all(len(d) == 1 for d in digests.values()), "the replicas differ"
    return len(digests)


def _start_job(
    tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[Path, float, subprocess.Popen, dict[str, subprocess.Popen]]:
    report, secret = tmp_path / "report", tmp_path / "secret"
    write_secret_file(secret, generate_secret())
    coord_log = tmp_path / "coordinator.log"
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(secret), "--report", str(report)]
    coord = start([*args, *SET_ARGS], coord_log)
    wait_for(
        lambda: "listening on" in coord_log.read_text() or coord.poll() is not None, 120, "the coordinator"
    )
    address = coord_log.read_text().split("listening on", 1)[1].split()[0]
    workers = {}
    for name in NAMES:
        wargs = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", name]
        workers[name] = start(wargs, tmp_path / f"{name}.log", env=env)
    wait_for(
        lambda: (
            all(
                any(r["name"] == n and r["committed"] and r["step"] >= 10 for r in _all_steps(report))
                for n in NAMES
            )
            or any(p.poll() is not None for p in [coord, *workers.values()])
        ),
        180,
        "every worker past step 10",
    )
    assert all(p.poll() is None for p in [coord, *workers.values()]), "a process ended early"
    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import connect

    client = connect(f"tcp://{address}", read_secret_file(secret), sender="test-coordinator-death")
    try:
        before = time.time()
        t0 = (before + time.time()) / 2 - float(client.call("status", {}, timeout_s=10.0).body["elapsed_s"])
    finally:
        client.close()
    return report, t0, coord, workers


def _kill_coordinator(tmp_path: Path, coord: subprocess.Popen, workers: dict[str, subprocess.Popen]) -> None:
    os.killpg(coord.pid, signal.SIGKILL)
    coord.wait(timeout=30)
    wait_for(
        lambda: all("coordinator's process is gone" in (tmp_path / f"{n}.log").read_text() for n in workers),
        60,
        "every worker to notice the coordinator is gone",
    )


def _pid(report: Path, name: str) -> int:
    return int(next(r["pid"] for r in _all_steps(report) if r["name"] == name))


# 10 % of each message fault on the workers' ring-repair messages (comm/faulty.py: lost,
# duplicated, delayed, reordered requests, and lost replies), below their authentication
RING_FAULTS = NetFaults(
    drop=0.1, duplicate=0.1, delay=0.1, reorder=0.1, lose_reply=0.1, delay_s=0.05, seed=7, ops=("ring",)
)


@pytest.mark.parametrize("faults", [None, RING_FAULTS], ids=["clean", "ring_faults"])
def test_training_goes_on_and_revocations_are_repaired_without_the_coordinator(
    tmp_path: Path, faults: NetFaults | None
) -> None:
    env = {ENV_VAR: faults.to_json()} if faults is not None else None
    report, t0, coord, workers = _start_job(tmp_path, env)
    figures = []
    try:
        _kill_coordinator(tmp_path, coord, workers)
        gone_s = time.time() - t0
        wait_for(lambda: _first_in(report, NAMES, 4, gone_s + 0.5) is not None, 60, "training on alone")
        survivors = list(NAMES)
        for victim in ("w3", "w1"):
            killed_s = time.time() - t0
            os.kill(_pid(report, victim), signal.SIGKILL)
            survivors.remove(victim)
            alive_now = tuple(survivors)

            def recovered(names: tuple[str, ...] = alive_now, since: float = killed_s) -> bool:
                done = _first_in(report, names, len(names), since) is not None
                return done or any(workers[n].poll() is not None for n in names)

            wait_for(recovered, 60, f"a view of {survivors}")
            figure = _first_in(report, alive_now, len(alive_now), killed_s)
            assert figure is not None, f"{victim}: the survivors stopped"
            figures.append(figure)
            what = "ring messages faulty" if faults is not None else "clean"
            print(f"\ncoordinator dead ({what}), SIGKILL {victim} -> survivors' next step: {figure:.3f} s")
        for n in survivors:
            workers[n].send_signal(signal.SIGTERM)  # (no coordinator: a leave is an exit)
        for n in survivors:
            workers[n].wait(timeout=60)
    finally:
        for p in [coord, *workers.values()]:
            stop(p)
    assert _digests_agree(report) > 20
    bound = BOUND_S if faults is None else 2 * BOUND_S  # (each lost message costs a 0.3-s send)
    assert all(f < bound for f in figures), figures
    assert not [p.pid for p in workers.values() if alive(p.pid)], "a worker was left behind"


def test_a_minority_stops_without_the_coordinator(tmp_path: Path) -> None:
    report, t0, coord, workers = _start_job(tmp_path)
    try:
        _kill_coordinator(tmp_path, coord, workers)
        killed_s = time.time() - t0
        for victim in ("w1", "w2"):
            os.kill(_pid(report, victim), signal.SIGKILL)
        survivors = [n for n in NAMES if n not in ("w1", "w2")]
        for n in survivors:  # they stop, with one line saying why, and a non-zero status
            assert workers[n].wait(timeout=120) != 0
            assert "split-brain rule" in (tmp_path / f"{n}.log").read_text()
    finally:
        for p in [coord, *workers.values()]:
            stop(p)
    late = [
        r for r in _all_steps(report) if r["committed"] and r["time_s"] > killed_s and r["world_size"] < 3
    ]
    assert not late, f"a minority trained on: {late[:3]}"
    _digests_agree(report)
