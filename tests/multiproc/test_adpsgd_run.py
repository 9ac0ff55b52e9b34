"""AD-PSGD under ``flotilla run``: two workers SIGKILLed at random points of a run (a passive one,
then an active one: in compute or inside an exchange, whichever the moment hits), the job
completes with the survivors, and the records show no exchange applied on one side only; the
exported model is the average of the surviving replicas.  The example's accuracy: ``-m slow``.
Waits are for events (records), never for durations."""

from __future__ import annotations

import json
import os
import random
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.config import load_config
from flotilla.elastic.checkpoint import list_checkpoints
from flotilla.trainer import builders
from tests.multiproc.test_resume import _kill_everything

from ._adpsgd_oracle import replay
from ._jobs import (
    ROOT,
    held_ready,
    processes_mentioning,
    records,
    release,
    start,
    start_held,
    stop,
    training_steps,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

SETS = {
    "cluster.defaults.speed": "0.3",  # (emulated slower than the host: exchanges overlap compute)
    "job.steps": "260",
    "job.epochs": "null",
    "job.eval_every_steps": "0",
    "job.dataset.num_samples": "4000",
    "strategy.exchange_timeout_s": "1.0",
}


def _past(report: Path, step: int, ids: set[int]) -> bool:
    seen = {r["worker_id"] for r in training_steps(records(report)) if r["step"] >= step}
    return ids <= seen


def test_two_workers_killed_mid_run_the_rest_complete_and_no_exchange_is_half_applied(tmp_path: Path) -> None:
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "run.log"
    args = [
        "run",
        "examples/adpsgd.yaml",
        "--report",
        str(report),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    args += ["--set", "cluster.workers=[{name: w0}, {name: w1}, {name: w2}, {name: w3}]"]
    args += [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    proc = start(args, log)
    rng = random.Random()
    victims: list[int] = []
    try:
        for victim, at in ((1, 20), (2, 60)):  # worker ids: 1 passive, then 2 active (id order alternates)
            live, at = {0, 1, 2, 3} - set(victims), at + rng.randrange(10)  # (a random point)
            wait_for(
                lambda at=at, live=live: _past(report, at, live) or proc.poll() is not None,
                300,
                f"every worker at step {at}",
            )
            assert proc.poll() is None, f"the job ended before the kill: {log.read_text()[-3000:]}"
            pid = next(r["pid"] for r in training_steps(records(report)) if r["worker_id"] == victim)
            os.kill(pid, signal.SIGKILL)
            victims.append(victim)
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    recs = training_steps(records(report))
    names = {r["worker_id"]: r["name"] for r in recs}
    # (a victim that had trained its last step before the kill -- the others waited for, not it --
    # finished, then died: not lost, listed apart)
    first = {int(w) for w in summary["strategy_stats"].get("finished_then_died", ())}
    expected = sorted(names[v] for v in victims if v not in first)
    assert sorted(m["name"] for m in summary["members_lost"]) == expected
    survivors = {0, 3}
    # every exchange: applied on both ends or on neither.  An exchange a survivor committed as the
    # active side with a surviving passive is in that passive's records (``adpsgd_served``),
    # unless the passive served it after its own last record (its finish); and nothing is
    # committed on a passive that its active did not commit.
    active = {r["adpsgd_xid"]: r for r in recs if r.get("adpsgd_outcome") == "committed"}
    served = {x: (a, o, r) for r in recs for x, a, o, *_ in r.get("adpsgd_served", ())}
    tails = summary["strategy_stats"]["served_after_last_record"]  # (served after a last record)
    served |= {x: (a, o, {"tail": w}) for w, t in tails.items() for x, a, o, *_ in t}
    for xid, r in active.items():
        peer = r["adpsgd_peer"]
        if r["worker_id"] in survivors and peer in survivors:
            assert served.get(xid, (None, None))[1] == "committed", r
    for xid, (a, outcome, r) in served.items():
        if outcome == "committed" and a in survivors:
            assert xid in active, (xid, r)
    outcomes = [r["adpsgd_outcome"] for r in recs if "adpsgd_outcome" in r]
    assert outcomes.count("committed") >= 50, outcomes[:50]
    assert "unknown" not in [
        r["adpsgd_outcome"] for r in recs if r["worker_id"] in survivors and r.get("adpsgd_peer") in survivors
    ]
    consensus = [
        line
        for f in run_dir.glob("*.log")
        for line in f.read_text().splitlines()
        if "averages the replicas" in line
    ]
    assert len(consensus) == 1 and "workers [0, 3]" in consensus[0], consensus
    print(f"exchange outcomes: { {o: outcomes.count(o) for o in set(outcomes)} }")
    assert processes_mentioning(str(tmp_path)) == []


def test_a_joiner_takes_a_live_peers_state_and_averages_with_the_others(tmp_path: Path) -> None:
    """A worker that joins mid-run (``flotilla worker`` against the running job's coordinator)
    takes a live peer's replica and optimizer state, starts at that peer's step, takes part in
    averages, and its replica is in the exported average.  The joiner's process is started and
    imported before the run (``start_held``) and released once the others train, so what the
    test waits for is the join itself, not a process start on a loaded machine."""
    report, run_dir, log = tmp_path / "report", tmp_path / "run", tmp_path / "run.log"
    steps = 1000  # (the join took ~90 steps' time here, released at step 1: room for a machine 5x slower)
    sets = {**SETS, "job.steps": str(steps), "cluster.workers": "[{name: w0}, {name: w1}, {name: w2}]"}
    args = [
        "run",
        "examples/adpsgd.yaml",
        "--report",
        str(report),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    go, joiner_log = tmp_path / "w3.go", tmp_path / "w3.held.log"
    newcomer = start_held(go, joiner_log)
    proc = start([*args, *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))], log)
    try:
        wait_for(lambda: held_ready(go), 120, "the joiner's imports")
        wait_for(
            lambda: _past(report, 1, {0, 1, 2}) or proc.poll() is not None, 300, "every worker at step 1"
        )
        assert proc.poll() is None, f"the job ended before the join: {log.read_text()[-3000:]}"
        coord = json.loads((run_dir / "coordinator.json").read_text())
        release(
            go,
            [
                "worker",
                "--coordinator",
                coord["address"],
                "--secret-file",
                coord["secret_file"],
                "--name",
                "w3",
            ],
        )
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
        assert newcomer.wait(timeout=60) == 0, joiner_log.read_text()[-3000:]
    finally:
        stop(proc)
        stop(newcomer)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    recs = training_steps(records(report))
    joiner = next(r["worker_id"] for r in recs if r["name"] == "w3")
    text = joiner_log.read_text()
    m = re.search(r"worker (\d+) joined with peer (\d+)'s replica at step (\d+)", text)
    assert m and int(m.group(1)) == joiner and int(m.group(3)) > 0, text[-2000:]
    first = min(r["step"] for r in recs if r["worker_id"] == joiner)
    assert first == int(m.group(3)), (first, m.group(0))  # it starts at its lender's step
    print(f"joined at step {first} of {steps}")
    took_part = [r for r in recs if r["worker_id"] == joiner and r.get("adpsgd_outcome") == "committed"]
    took_part += [r for r in recs for e in r.get("adpsgd_served", ()) if joiner in (r["worker_id"], e[1])]
    assert took_part, "the joiner never averaged with anyone"
    consensus = [
        line
        for f in run_dir.glob("*.log")
        for line in f.read_text().splitlines()
        if "averages the replicas" in line
    ]
    assert len(consensus) == 1 and str(joiner) in consensus[0].split("workers")[-1], consensus


def test_a_run_killed_after_a_checkpoint_resumes_every_worker_from_it(tmp_path: Path) -> None:
    """Checkpoints hold the average of the live replicas (rank 0 writes it, as it would export
    it; exact: ``tests/inproc/test_adpsgd_exchange.py``); after a kill of the whole job,
    ``--resume`` starts every worker from that one state at its step, and the job completes."""
    ckpt, run_dir, log = tmp_path / "ckpt", tmp_path / "run", tmp_path / "run.log"
    sets = {**SETS, "job.steps": "160", "checkpoint": f"{{every_steps: 40, keep: 2, dir: {ckpt}}}"}
    sets["cluster.workers"] = "[{name: w0}, {name: w1}, {name: w2}]"
    args = ["run", "examples/adpsgd.yaml", "--no-progress", "--run-dir", str(run_dir)]
    args += [
        "--report",
        str(tmp_path / "report"),
        *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")),
    ]
    proc = start(args, log)

    def newest() -> int:
        found = list_checkpoints(ckpt)
        return int(found[-1].name.split("-")[1]) if found else -1

    try:
        wait_for(lambda: newest() >= 40 or proc.poll() is not None, 300, "a checkpoint at step >= 40")
        assert proc.poll() is None, f"the run ended before its first checkpoint: {log.read_text()[-3000:]}"
    finally:
        _kill_everything(proc, run_dir, processes_mentioning(str(run_dir)))
    at = newest()
    assert 40 <= at < 160, at
    weights = load_file(list_checkpoints(ckpt)[-1] / "model.safetensors")
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())
    report2, run2, log2 = tmp_path / "report2", tmp_path / "run2", tmp_path / "run2.log"
    args2 = [*args, "--resume", str(ckpt)]
    args2[args2.index(str(run_dir))] = str(run2)
    args2[args2.index(str(tmp_path / "report"))] = str(report2)
    proc = start(args2, log2)
    try:
        assert proc.wait(timeout=400) == 0, log2.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report2 / "summary.json").read_text())
    assert summary["completed"], summary
    recs = training_steps(records(report2))
    for name in ("w0", "w1", "w2"):
        text = (run2 / f"{name}.log").read_text()
        m = re.search(r"resumed from (\S+) at step (\d+)", text)
        assert m and int(m.group(2)) == at, f"{name} did not resume at step {at}: {text[-1500:]}"
        first = min(r["step"] for r in recs if r["name"] == name)
        assert first == at, (name, first, at)  # every worker from the one state, at its step
    assert processes_mentioning(str(tmp_path)) == []


ORACLE_SETS = {**SETS, "job.steps": "150", "cluster.defaults.speed": "0.5"}


def test_the_oracle_replays_every_gradient_and_average_to_the_exported_model(tmp_path: Path) -> None:
    """A run of 4 workers (one 3x slower) replayed in one process from its records: the replay
    recomputes every gradient on the recorded (stale) version and every average, in an order the
    versions allow, and its final replicas' average is the exported model up to float rounding."""
    report, log = tmp_path / "report", tmp_path / "run.log"
    sets = [a for k, v in ORACLE_SETS.items() for a in ("--set", f"{k}={v}")]
    args = ["run", "examples/adpsgd.yaml", "--report", str(report), "--run-dir", str(tmp_path / "run")]
    proc = start([*args, "--no-progress", *sets], log)
    try:
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] and not summary["members_lost"], summary
    recs = training_steps(records(report))
    stale = [r["adpsgd_v"] for r in recs if r.get("adpsgd_v") and r["adpsgd_v"][0] < r["adpsgd_v"][1]]
    assert stale, "no gradient was applied to a version newer than the one it was computed on"
    cfg = load_config(ROOT / "examples/adpsgd.yaml", [f"{k}={v}" for k, v in ORACLE_SETS.items()])
    finals = replay(cfg, recs, summary["strategy_stats"]["served_after_last_record"])
    assert sorted(finals) == [0, 1, 2, 3]
    expected = (
        sum((f.double() for f in finals.values()), torch.zeros_like(finals[0], dtype=torch.float64)) / 4
    ).float()
    task = builders.build_task(cfg)
    model = builders.build_task_model(cfg, task)
    model.load_state_dict(load_file(str(report / "model.safetensors")))
    state = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    exported = torch.cat([t.detach().reshape(-1).float() for t in state])
    err = (exported - expected).abs().max().item()
    scale = expected.abs().max().item()
    print(f"oracle: {len(recs)} records, {len(stale)} stale gradients; max |exported - replay| = {err:.2e}")
    assert err <= 1e-4 * max(1.0, scale), err


@pytest.mark.slow
def test_the_example_reaches_the_target_accuracy(tmp_path: Path) -> None:
    report, log = tmp_path / "report", tmp_path / "run.log"
    proc = start(
        [
            "run",
            "examples/adpsgd.yaml",
            "--report",
            str(report),
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        log,
    )
    try:
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report / "summary.json").read_text())
    final = summary["evals"][-1]["test_accuracy"]
    print(f"adpsgd example: final test accuracy {final:.4f} (the average of the replicas)")
    assert final >= 0.92, summary["evals"]
