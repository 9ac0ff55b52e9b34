"""Real processes (issue 18, honest endings): an orphaned worker says why and exits non-zero.

``flotilla coordinator`` and two ``flotilla worker`` processes started by hand; once they train,
the coordinator is frozen (SIGSTOP: its process lives, so its liveness connections stay open and
nothing proves it gone -- the workers train on and keep asking).  Once it has not answered for
``orphan_after_s`` (30 s, ``roles/link.py``) each worker gives up: it logs that the coordinator
was unreachable and that the coordinator is lost, and exits with ``EXIT_ORPHANED`` (3): from its
training loop, or (``error: coordinator lost: no answer to heartbeats``) when the other worker's
exit broke the group first and it was waiting for a new view.

(A coordinator whose process is *gone* is another case: the workers train on without it and
repair their ring themselves, ``tests/multiproc/test_coordinator_death.py``.)  Slow (the 30 s
orphan timeout): ``-m slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.trainer.loop import EXIT_ORPHANED

from ._jobs import records, start, stop, training_steps, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NAMES = ("w0", "w1")
SETS = {
    "cluster.num_workers": "2",
    "cluster.defaults.speed": "0.05",
    "job.steps": "1000000",  # never reached
    "job.eval_every_steps": "0",
}


def test_workers_of_a_frozen_coordinator_log_why_and_exit_orphaned(tmp_path: Path) -> None:
    report, secret, coord_log = tmp_path / "report", tmp_path / "secret", tmp_path / "coordinator.log"
    write_secret_file(secret, generate_secret())
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(secret), "--report", str(report)]
    coord = start([*args, *sets], coord_log)
    workers: dict[str, subprocess.Popen] = {}
    try:
        wait_for(lambda: "listening on" in coord_log.read_text() or coord.poll() is not None, 120,
                 "the coordinator")  # fmt: skip
        address = coord_log.read_text().split("listening on", 1)[1].split()[0]
        for name in NAMES:
            wargs = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", name]
            workers[name] = start(wargs, tmp_path / f"{name}.log")
        wait_for(
            lambda: (
                {r["name"] for r in training_steps(records(report)) if r["committed"] and r["step"] >= 5}
                >= set(NAMES)
                or any(p.poll() is not None for p in [coord, *workers.values()])
            ),
            180,
            "every worker past step 5",
        )
        assert all(p.poll() is None for p in [coord, *workers.values()]), "a process ended early"
        os.killpg(coord.pid, signal.SIGSTOP)
        codes = {n: p.wait(timeout=200) for n, p in workers.items()}
    finally:
        for p in [coord, *workers.values()]:
            stop(p)
    assert set(codes.values()) == {EXIT_ORPHANED}, codes
    for n in NAMES:
        text = (tmp_path / f"{n}.log").read_text()
        assert "coordinator unreachable for 30 s" in text and "coordinator lost" in text, text[-2000:]
