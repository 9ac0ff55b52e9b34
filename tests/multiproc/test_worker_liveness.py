"""Real processes, no launcher (issue 19: eviction without a launcher's death notice).

The PS shards, the coordinator and the workers are started by hand (``flotilla server`` /
``flotilla coordinator`` / ``flotilla worker``), so no launcher tells the coordinator that a
worker's process died.  Each worker gives the coordinator its liveness listener's port when it
joins and the coordinator holds a connection to it (``comm/liveness.py``): a SIGKILLed worker's
kernel closes it, and the coordinator declares the worker dead at once instead of after
``cluster.heartbeat_timeout_s``.  Both that timeout and the PS pull timeout are set to 600 s here,
so the survivors -- blocked by BSP on the dead worker's clock -- can only go on because of the
liveness path.  Printed: kill -> the coordinator's death notice, kill -> the survivors' next clock.

Every wait is for an event (a log line, a record); the timeouts are safety nets far below 600 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file

from ._jobs import records, start, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

SETS = {
    "cluster.workers": "null",
    "cluster.num_workers": "3",
    "cluster.defaults.speed": "0.25",
    "cluster.heartbeat_timeout_s": "600",  # not the heartbeats: the liveness connection
    "strategy.pull_timeout_s": "600",
    "strategy.consistency": "bsp",
    "job.epochs": "null",
    "job.steps": "1000000",  # never reached: the test ends the job
    "report.metrics_every_steps": "1",
}
SET_ARGS = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
NAMES = ("w0", "w1", "w2")


def _clocks(report: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in training_steps(records(report)):
        out[r["name"]] = max(out.get(r["name"], -1), int(r["clock"]))
    return out


def test_a_worker_killed_without_a_launcher_is_declared_dead_at_once(tmp_path: Path) -> None:
    secret, report = tmp_path / "secret", tmp_path / "report"
    write_secret_file(secret, generate_secret())
    procs: list[subprocess.Popen] = []
    try:
        addresses = []
        for s in range(2):
            afile = tmp_path / f"ps{s}.address"
            args = ["server", "examples/ps_ssp.yaml", "--shard-index", str(s), "--secret-file", str(secret)]
            procs.append(start([*args, "--address-file", str(afile), *SET_ARGS], tmp_path / f"ps{s}.log"))
            wait_for(lambda f=afile: f.exists() or procs[-1].poll() is not None, 120, f"shard {s}")
            addresses.append(afile.read_text().strip().removeprefix("tcp://"))
        coord_log = tmp_path / "coordinator.log"
        args = ["coordinator", "examples/ps_ssp.yaml", "--secret-file", str(secret), "--report", str(report)]
        servers = [a for addr in addresses for a in ("--ps-server", addr)]
        procs.append(coord := start([*args, *servers, *SET_ARGS], coord_log))
        wait_for(
            lambda: "listening on" in coord_log.read_text() or coord.poll() is not None, 120, "coordinator"
        )
        address = coord_log.read_text().split("listening on", 1)[1].split()[0]
        workers = {}
        for name in NAMES:
            wargs = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", name]
            procs.append(workers.setdefault(name, start(wargs, tmp_path / f"{name}.log")))
        wait_for(
            lambda: (
                all(_clocks(report).get(n, -1) >= 5 for n in NAMES)
                or any(p.poll() is not None for p in procs)
            ),
            180,
            "every worker past clock 5",
        )
        assert all(p.poll() is None for p in procs), "a process ended early"
        killed_at = time.monotonic()
        os.killpg(workers["w1"].pid, signal.SIGKILL)
        workers["w1"].wait(timeout=30)
        victim = _clocks(report)["w1"]
        wait_for(lambda: "its liveness connection closed" in coord_log.read_text(), 60, "the death notice")
        noticed_s = time.monotonic() - killed_at
        wait_for(
            lambda: all(_clocks(report).get(n, -1) >= victim + 3 for n in ("w0", "w2")),
            120,
            "the survivors training on without w1",
        )
        on_s = time.monotonic() - killed_at
        print(
            f"\nkill -> coordinator's death notice: {noticed_s:.2f} s; -> survivors 3 clocks on: {on_s:.2f} s"
        )
        text = coord_log.read_text()
        assert (
            "declared dead" in text
            and "heartbeat" not in text.split("its liveness connection closed")[0][-400:]
        )
        assert noticed_s < 30  # (far below the 600 s heartbeat timeout that would otherwise decide)
    finally:
        for p in procs:
            stop(p)
