"""``flotilla run`` with two pipeline instances (``strategy.replicas: 2``, PP x DP): four stage
processes on 127.0.0.1, each instance on half of every batch, trains what one pipeline trains on
the whole batch (the single-process reference's losses), the instances end bitwise identical, and
instance 0 alone evaluates and writes the weights.

A stage SIGKILLed mid-run (by the test, at a step it picks: in compute or inside a collective,
whatever the stage was doing) loses its instance only: the other instance trains on alone on the
whole batch, without a restart, and still reproduces the reference's losses (the survivors'
longest step gap after the kill is printed); with replacements allowed (``job.max_restarts``) the
lost instance comes back as new stage processes that receive the state from the running one, and
the job ends with both instances identical and the reference's losses (kill -> back is printed)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.report.metrics import read_jsonl
from flotilla.trainer.reference import train_single_process

from ._pipeline_job import FOUR, kill_stage_at, pipeline_cfg


@pytest.mark.timeout(120)
def test_two_pipeline_instances_train_what_one_pipeline_trains(tmp_path: Path) -> None:
    cfg = pipeline_cfg(tmp_path, FOUR, "strategy.replicas=2", "strategy.num_microbatches=2")
    reference = train_single_process(cfg)
    sup = Supervisor(tmp_path / "run")
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    assert len(sup.children) == 4
    for child in sup.children:
        assert child.proc.returncode == 0
        with pytest.raises(ProcessLookupError):
            os.kill(child.proc.pid, 0)
    assert summary["completed"] and summary["num_workers"] == 4 and summary["replicas"] == 2
    assert summary["replicas_identical"] is True
    assert [(s["name"], s["stage_idx"], s["replica"]) for s in summary["stages"]] == [
        ("a0", 0, 0), ("a1", 1, 0), ("b0", 0, 1), ("b1", 1, 1)
    ]  # fmt: skip
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    run = tmp_path / "run"
    digests = [json.loads((run / f"stage{g}.json").read_text())["digest"] for g in range(4)]
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    assert sorted(p.name for p in run.glob("stage*.safetensors")) == [
        "stage0.safetensors",
        "stage1.safetensors",
    ]
    records = read_jsonl(report / "metrics.jsonl")
    assert sorted((r["name"], r["step"]) for r in records) == sorted(
        (w, k) for w in ("a0", "a1", "b0", "b1") for k in range(1, 9)
    )
    assert {r["replica"] for r in records if r["name"].startswith("b")} == {1}
    b1 = [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if r["name"] == "b1"]
    assert b1 == summary["train_losses"]  # (both last stages record the sum over the instances)
    evals = read_jsonl(report / "evals.jsonl")
    assert [(e["step"], e.get("name")) for e in evals] == [(4, "a1"), (8, None)]  # (None: the final one)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", ["b1", "a0"])  # (a0: the lead instance's first stage)
def test_a_killed_stage_loses_its_instance_and_the_other_trains_on_without_a_restart(
    tmp_path: Path, victim: str
) -> None:
    cfg = pipeline_cfg(
        tmp_path,
        FOUR,
        "strategy.replicas=2",
        "strategy.num_microbatches=2",
        "job.steps=24",
        "job.max_restarts=0",
    )  # (no replacement: the instance stays lost)
    reference = train_single_process(cfg)
    sup = Supervisor(tmp_path / "run")
    killed: dict = {}
    killer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", victim, 9, killed), daemon=True
    )
    killer.start()
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    killer.join()
    assert killed, "the stage was never killed"
    assert summary["completed"] and summary["restarts"] == [] and len(sup.children) == 4
    lost = summary["instances_lost"]
    instance = 1 if victim == "b1" else 0
    assert [(e["instance"], e["stage"], e["exit_code"], e["survivors"]) for e in lost] == [
        (instance, victim, -signal.SIGKILL, [1 - instance])
    ]
    assert f"lost pipeline instance {instance} ({victim}, exit code -9)" in summary["degraded"]
    assert [s["replica"] for s in summary["stages"]] == [1 - instance] * 2  # (the survivors' stages)
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)  # nothing lost, nothing twice
    assert all(c.proc.returncode is not None for c in sup.children)
    records = read_jsonl(report / "metrics.jsonl")
    last = "a1" if instance == 1 else "b1"
    mine = sorted((r["time_s"], r["step"]) for r in records if r["name"] == last)
    assert [k for _, k in mine] == list(range(1, 25))  # every step once on the survivors' last stage
    # the survivors' stall: their longest gap between two steps after the kill, against their median
    gaps = sorted(b - a for (a, _), (b, _) in zip(mine, mine[1:]))
    stall = max(b - a for (a, _), (b, _) in zip(mine, mine[1:]) if b > killed["at"])
    print(
        f"\nkill {victim} at step {killed['step']}: the survivors' longest step gap after it "
        f"{stall:.2f} s (median gap {gaps[len(gaps) // 2]:.3f} s)"
    )


@pytest.mark.timeout(240)
def test_a_lost_instance_comes_back_and_receives_the_state(tmp_path: Path) -> None:
    slow = FOUR.replace("speed: 0.5", "speed: 0.25")  # (slower steps: the run outlasts a newcomer's start)
    cfg = pipeline_cfg(tmp_path, slow, "strategy.replicas=2", "strategy.num_microbatches=2", "job.steps=240")
    reference = train_single_process(cfg)
    sup = Supervisor(tmp_path / "run")
    killed: dict = {}
    killer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", "b1", 8, killed), daemon=True
    )
    killer.start()
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    killer.join()
    assert killed, "the stage was never killed"
    assert summary["completed"] and summary["restarts"] == []
    assert [(e["instance"], e["stage"]) for e in summary["instances_lost"]] == [(1, "b1")]
    back = summary["instances_back"]
    assert [(e["instance"], e["instances"]) for e in back] == [(1, [0, 1])]
    assert len(sup.children) == 6  # (the 4 of the start, b0 and b1 again)
    assert [(s["name"], s["replica"]) for s in summary["stages"]] == [
        ("a0", 0),
        ("a1", 0),
        ("b0", 1),
        ("b1", 1),
    ]
    assert summary["replicas_identical"] is True  # the newcomers got the state and stayed in step
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    mine = sorted((r["time_s"], r["step"]) for r in read_jsonl(report / "metrics.jsonl") if r["name"] == "a1")
    assert [k for _, k in mine] == list(range(1, 241))  # every step once on the lead's last stage
    # the running instance's stall when the newcomers joined (the move and the state transfer)
    stall = max(b - a for (a, _), (b, _) in zip(mine, mine[1:]) if b > back[0]["at"])
    print(f"\nkill b1 at step {killed['step']} -> instance 1 back at step {back[0]['reached_step']}, "
          f"{back[0]['at'] - killed['at']:.2f} s later; the running instance's longest step gap "
          f"after it {stall:.2f} s")  # fmt: skip
