"""The recovery figures of a run with revocations (``report/membership.py``): a kill or a stop
recovers at the first committed step, by anyone, in a membership epoch newer than every epoch
committed before it; adds are counted; a run without revocations has no figures."""

from __future__ import annotations

import json
from pathlib import Path

from flotilla.report.membership import membership_plot, recoveries, recovery_summary


def _step(name: str, t: float, epoch: int, world: int, committed: bool = True) -> dict:
    return {"name": name, "time_s": t, "membership_epoch": epoch, "world_size": world, "committed": committed}


RECORDS = [
    *(_step(n, t, 1, 3) for t in (1.0, 2.0, 3.0) for n in ("w0", "w1", "w2")),
    _step("w0", 3.5, 1, 3, committed=False),  # the step the kill broke
    _step("w0", 3.9, 2, 2),
    _step("w1", 4.0, 2, 2),
    _step("w0", 9.0, 3, 3),
    _step("w1", 9.1, 3, 3),
]
REVOCATIONS = [
    {"time_s": 3.2, "action": "kill", "worker": "w2", "pid": 7},
    {"time_s": 6.0, "action": "add", "worker": "w2", "pid": 8},
    {"time_s": 9.5, "action": "stop", "worker": "w1", "pid": 9, "duration_s": 2.0},
]


def test_recoveries_are_measured_to_the_first_step_in_a_newer_epoch() -> None:
    out = recoveries(RECORDS, REVOCATIONS)
    assert [(r["action"], r["member"], r["recovery_s"]) for r in out] == [
        ("kill", True, 0.7),
        ("stop", True, None),
    ]
    late = recoveries(RECORDS, [{"time_s": 3.95, "action": "kill", "worker": "w2"}])  # w2 is out by then
    assert late[0]["member"] is False and late[0]["recovery_s"] is None


def test_recovery_summary_and_plot(tmp_path: Path) -> None:
    assert recovery_summary(tmp_path) is None and membership_plot(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "revocations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REVOCATIONS))
    assert recovery_summary(tmp_path) == {
        "kill": 1,
        "stop": 1,
        "add": 1,
        "outside_a_view": 0,
        "recovered": 1,
        "not_recovered": 1,
        "recovery_p50_s": 0.7,
        "recovery_max_s": 0.7,
    }
    path = membership_plot(tmp_path)
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
