"""The chaos soak (issue 17, item 6; ``-m slow``, not in ``make test``): the chaos test's run
(``tests/multiproc/_chaos.py``) for ``FLOTILLA_SOAK_S`` seconds of revocations (default 600): a
seeded random killer SIGKILLs a worker without notice about every 10 s (``FLOTILLA_SOAK_INTERVAL_S``)
and restarts it 3 s later, and w4 is SIGSTOPped for 5 s every minute.  The same verdict as the
chaos test (``flotilla.report.chaos_check``), and the recovery p50 / p95 / max it measured,
printed for ``docs/benchmarks.md``::

    .venv/bin/pytest -m slow -s tests/soak/test_chaos_soak.py
    FLOTILLA_SOAK_S=180 .venv/bin/pytest -m slow -s tests/soak/test_chaos_soak.py   # 3 minutes

The job lasts its paced steps (about 1.4 x the soak on the 2-core VM); the wait is for its exit,
with a timeout sized from the soak's length only as a safety net.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flotilla.report.chaos_check import percentile
from tests.multiproc._chaos import ChaosPlan, recovery_times, run_chaos, verdict

SOAK_S = float(os.environ.get("FLOTILLA_SOAK_S", "600"))
INTERVAL_S = float(os.environ.get("FLOTILLA_SOAK_INTERVAL_S", "10"))
SEED = int(os.environ.get("FLOTILLA_SOAK_SEED", "17"))
STOP_EVERY_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_S * 6 + 600))]


def _figures(times: list[float]) -> str:
    if not times:
        return "none"
    p50, p95 = percentile(times, 0.5), percentile(times, 0.95)
    return f"n={len(times)} p50 {p50:.3f} s, p95 {p95:.3f} s, max {max(times):.3f} s"


def test_chaos_soak(tmp_path: Path) -> None:
    stops = tuple(at for at in (STOP_EVERY_S * (k + 0.5) for k in range(int(SOAK_S // STOP_EVERY_S))))
    plan = ChaosPlan(chaos_s=SOAK_S, mean_interval_s=INTERVAL_S, seed=SEED, stops_at_s=stops or (SOAK_S / 2,))
    run = run_chaos(tmp_path, plan, timeout_s=SOAK_S * 6 + 300)
    print(f"\nchaos soak: {SOAK_S:.0f} s of revocations, {plan.steps} steps, {run.wall_s:.1f} s wall")
    assert run.returncode == 0, run.output[-3000:]
    assert run.summary.get("completed") is True, run.output[-3000:]
    judged = verdict(run)
    print(judged.report())
    done, times = recovery_times(run)
    kills = [float(r["recovery_s"]) for r in done if r["action"] == "kill" and r["recovery_s"] is not None]
    stopped = [float(r["recovery_s"]) for r in done if r["action"] == "stop" and r["recovery_s"] is not None]
    print(f"revocations executed: {run.summary['revocations']}")
    print(f"recovery, SIGKILL without notice: {_figures(kills)}")
    print(f"recovery, SIGSTOP 5 s:            {_figures(stopped)}")
    print(f"recovery, all:                    {_figures(times)}")
    assert judged.ok, judged.report()
    assert run.summary["revocations"]["not_recovered"] == 0, run.summary["revocations"]
    assert not run.leftover, f"still running after the launcher exited: {run.leftover}"
