"""``Supervisor.wait_exit`` returns when a child exits (the kernel wakes it through a pidfd; where
there are none it polls), and after its timeout otherwise; a reaped child no longer wakes it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flotilla.launch.supervisor import Supervisor


def test_wait_exit_wakes_on_an_exit_and_times_out_otherwise(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        sleeper = sup.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], role="worker")
        quick = sup.spawn("quick", [sys.executable, "-c", "pass"], role="worker")
        t0 = time.monotonic()
        sup.wait_exit(60.0)
        assert time.monotonic() - t0 < 30.0  # woken by the exit, not by the timeout
        deadline = time.monotonic() + 30.0
        while quick.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c.name for c in sup.reap()] == ["quick"]
        t0 = time.monotonic()
        sup.wait_exit(0.3)  # only the sleeper is left: nothing wakes it early
        assert time.monotonic() - t0 >= 0.29
        assert sleeper.proc.poll() is None
    assert sleeper.proc.poll() is not None  # leaving the block killed it
