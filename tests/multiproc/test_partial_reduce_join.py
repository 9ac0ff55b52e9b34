"""Partial Reduce takes a newcomer: a worker that joins the running job (started by hand once the
job passed step 40, its imports done beforehand: a newcomer's start-up does not scale like the
job's emulated steps, so a schedule's ``add`` could come too late on a loaded machine) holds no
model; its first group gives it weight 0, so it takes its holders' average, and
it starts at the step they reached (``sync/pr_plan.py``, "Newcomers").  Checked from the records:
its first losses are the trained model's, not a fresh model's, and it then averages as an ordinary
member (its groups commit)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ._jobs import held_ready, records, release, start, start_held, stop, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

STEPS, ADD_AT = 500, 40  # (a join retried after 5 s must still find ~400 steps to go)


def test_a_newcomer_is_filled_by_its_first_group_and_trains_on_from_the_holders_step(tmp_path: Path) -> None:
    report, run_dir = tmp_path / "report", tmp_path / "run"
    args = ["run", "examples/partial_reduce.yaml", "--report", str(report), "--run-dir", str(run_dir)]
    args += ["--no-progress", "--set", "cluster.workers=[{name: w0}, {name: w1}, {name: w2}]"]
    sets = {
        "strategy.group_size": "2",
        "job.steps": str(STEPS),
        "job.epochs": "null",
        "job.eval_every_steps": "0",
        "job.dataset.num_samples": "4000",
        "cluster.defaults.speed": "0.3",  # (slower than the host)
    }
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    go = tmp_path / "w3.go"
    newcomer = start_held(go, tmp_path / "w3.held.log")
    proc = start(args, tmp_path / "launcher.log")
    try:
        wait_for(lambda: any(r["step"] >= ADD_AT for r in training_steps(records(report))), 120, "step 40")
        wait_for(lambda: held_ready(go), 90, "the newcomer's imports")
        coord = json.loads((run_dir / "coordinator.json").read_text())
        worker = ["worker", "--coordinator", coord["address"], "--secret-file", coord["secret_file"]]
        release(go, [*worker, "--name", "w3"])
        assert proc.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
        assert newcomer.wait(timeout=60) == 0, (tmp_path / "w3.held.log").read_text()[-3000:]
    finally:
        stop(proc)
        stop(newcomer)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    log = (tmp_path / "w3.held.log").read_text()
    assert "joined: filled by group" in log, log[-2000:]
    recs = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in recs if "step" in r and "loss" in r]
    mine = sorted((r for r in steps if r["name"] == "w3"), key=lambda r: r["step"])
    assert mine, "the newcomer recorded no step"
    first = mine[0]
    assert first["step"] >= ADD_AT, first  # it started where its holders were, not at 0
    # its first loss is the trained model's: far below a fresh model's first losses
    fresh = statistics.median(r["loss"] for r in steps if r["name"] != "w3" and r["step"] < 3)
    near = [r["loss"] for r in steps if r["name"] != "w3" and abs(r["step"] - first["step"]) <= 5]
    trained = statistics.median(near)
    assert fresh - trained > 0.2, (fresh, trained)  # (the model did learn by then)
    # (the median of its first three: one minibatch's loss alone strayed past the midpoint once)
    assert len(mine) >= 3, mine
    early = statistics.median(r["loss"] for r in mine[:3])
    assert early < (fresh + trained) / 2, ([r["loss"] for r in mine[:3]], fresh, trained)
    # it averages as an ordinary member from then on
    assert any(r.get("pr_committed") for r in mine), mine[-3:]
    assert summary["pr_aborted"] == 0 or summary["pr_groups"] > summary["pr_aborted"], summary
