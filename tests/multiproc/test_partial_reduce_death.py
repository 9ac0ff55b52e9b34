"""Partial Reduce: a member that dies inside its group (the crash fault: exit at once, no notice,
as SIGKILL) blocks nobody, and no survivor applies the half-finished group: the controller aborts
it (its survivors' all-reduce failed, or the coordinator declared the member dead) and every
survivor keeps its own model for that group, then trains on to the end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ._jobs import FLOTILLA, ROOT

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow  # (~190 s while it fails: kept out of the default suite until the gap is fixed)
@pytest.mark.xfail(
    strict=True,
    reason=(
        "known gap (docs/partial_reduce.md): the membership machine breaks the view when w2 dies and "
        "declares w1 dead too after step_timeout_s, because partial_reduce workers never report "
        "into the broken view; the group abort itself works (pr_aborted >= 1, w0 trains on)"
    ),
)
def test_member_killed_mid_group_blocks_nobody_and_nothing_half_applied(tmp_path: Path) -> None:
    args = ["run", "examples/partial_reduce.yaml", "--report", str(tmp_path), "--no-progress"]
    args += ["--set", "cluster.workers=[{name: w0}, {name: w1}, {name: w2}]"]
    args += ["--set", "strategy.group_size=2", "--set", "job.steps=60", "--set", "job.epochs=null"]
    args += ["--set", "job.eval_every_steps=0"]
    args += ["--set", "job.dataset.num_samples=4000", "--set", "strategy.step_timeout_s=10"]
    env = {**os.environ, "FLOTILLA_FAULT_CRASH": "w2@10"}
    out = subprocess.run(FLOTILLA + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"], summary
    assert [m["name"] for m in summary["members_lost"]] == ["w2"]
    assert summary["pr_aborted"] >= 1 and summary["pr_groups"] > 0
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    mine = [r for r in recs if r.get("pr_group_id") is not None]
    failed = {r["pr_group_id"] for r in mine if r.get("pr_error")}
    by_group: dict[int, list[dict]] = {}
    for r in mine:
        by_group.setdefault(r["pr_group_id"], []).append(r)
    # the group the dead member was in: no survivor applied it (nor any other failed group)
    assert failed, "no survivor saw its group fail"
    for gid in failed:
        assert all(not r["pr_committed"] for r in by_group[gid]), by_group[gid]
    # a committed group was committed by every member that recorded it
    for rs in by_group.values():
        assert len({r["pr_committed"] for r in rs}) == 1, rs
    # the survivors trained to the end
    last = {r["name"]: r["step"] for r in recs if "step" in r and "name" in r}
    assert max(last.values()) >= 59, last
