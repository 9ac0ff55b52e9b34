"""``flotilla run`` with ``strategy.kind: pipeline``: one real process per stage on 127.0.0.1.

Each schedule trains a small character-level transformer for a few steps on a heterogeneous pair of
devices (speeds 1.0 and 0.5); the flushed schedules reproduce the single-process losses step by step,
PipeDream's first step equals them (version 0 everywhere) and its loss falls.  The flushed
schedules evaluate through the pipeline every ``job.eval_every_steps`` (``evals.jsonl``, the
summary's ``evals``), PipeDream only at the end.  A non-finite loss stops every stage at its step
with one line and the last finite weights in ``model.safetensors``.  A stage that crashes fails
the run, and no stage process is left behind in any case.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.core.errors import FlotillaError
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.report.metrics import read_jsonl
from flotilla.trainer.builders import build_task, build_task_model
from flotilla.trainer.reference import train_single_process

from ._pipeline_job import pipeline_cfg

_cfg = pipeline_cfg  # the shared job: tests/multiproc/_pipeline_job.py


def _no_process_left(sup: Supervisor) -> None:
    """Every stage process the supervisor started was reaped and is gone."""
    assert len(sup.children) == 2
    for child in sup.children:
        assert child.proc.returncode is not None, "a stage process was not reaped"
        with pytest.raises(ProcessLookupError):
            os.kill(child.proc.pid, 0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train_single_process(_cfg(tmp_path_factory.mktemp("ref")))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_pipeline_run_trains_each_schedule(tmp_path: Path, schedule: str, reference: list[float]) -> None:
    cfg = _cfg(tmp_path, f"strategy.schedule={schedule}")
    sup = Supervisor(tmp_path / "run")
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    _no_process_left(sup)
    assert summary["completed"] and summary["steps"] == 8 and summary["num_workers"] == 2
    assert [(s["device"], s["transport"]) for s in summary["stages"]] == [("cpu", "gloo")] * 2
    assert summary["layer_ends"][0] >= 3  # the fast device holds more than half of the 6 layers
    losses = summary["train_losses"]
    assert len(losses) == 8
    if schedule == "pipedream":
        assert losses[0] == pytest.approx(reference[0], rel=1e-5)
        assert losses[-1] < losses[0] - 0.3
    else:
        assert losses == pytest.approx(reference, rel=1e-4)
    stages = summary["stages"]
    # the full-speed device's emulator never sleeps; how much the half-speed one's sleeps is the
    # machine's (the core waits under contention count as the device's slowness, cluster/emulation.py:
    # under `taskset -c 0` stage 1 slept 0.027 s for 0.130 s of compute, and may not at all), so it is
    # unit-tested (tests/unit/test_membership_emulation.py: stretches, waits not paid), not asserted here
    assert stages[0]["slept_s"] == 0 and stages[1]["slept_s"] >= 0
    expected_in_flight = {"gpipe": [4, 4], "1f1b": [2, 1], "pipedream": [2, 1]}[schedule]
    assert [s["peak_in_flight"] for s in stages] == expected_in_flight
    assert [s["peak_weight_copies"] for s in stages] == ([2, 1] if schedule == "pipedream" else [1, 1])
    for s in stages:  # measured with saved-tensor hooks (roles/stage_memory.py), planned from the profile
        mem = s["memory"]
        assert mem["activation_bytes"] == pytest.approx(mem["predicted_activation_bytes"], rel=0.2)
        assert mem["peak_bytes"] == pytest.approx(mem["predicted_bytes"], rel=0.2)
        assert mem["peak_bytes"] < mem["budget_bytes"]
    assert 0 < summary["test_accuracy"] < 1 and summary["test_loss"] < 4.6
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]), rel=1e-9)
    assert summary["model_file"] == str(report / "model.safetensors")
    assert set(load_file(summary["model_file"])) == set(build_task_model(cfg, build_task(cfg)).state_dict())
    on_disk = json.loads((report / "summary.json").read_text())
    assert on_disk["gantt"] == str(report / "gantt.png")
    for name in ("gantt.png", "gantt_modelled.png", "loss_vs_time.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["name"], r["step"]) for r in records) == sorted(
        (w, k) for w in ("fast", "slow") for k in range(1, 9)
    )
    assert [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if r["name"] == "slow"] == losses
    # every step's compute and the emulator's delay (speed 0.5: at most as long as the compute,
    # less by the core waits -- none at all in a step whose waits took half of it, as under
    # `taskset -c 0`; speed 1.0: none), as a worker records them
    for r in records:
        assert r["step_s"] > 0 and r["compute_s"] > 0, r
        slept = r["emulated_s"]
        assert (0 <= slept <= r["compute_s"] + 1e-6) if r["name"] == "slow" else slept == 0.0, r
    evals = read_jsonl(report / "evals.jsonl")
    assert [e["step"] for e in evals] == ([8] if schedule == "pipedream" else [4, 8])
    assert [e["step"] for e in summary["evals"]] == [e["step"] for e in evals]
    assert evals[-1]["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-9)
    assert all(e["headline"] == "accuracy" and 0 < e["test_accuracy"] < 1 for e in evals)


@pytest.mark.timeout(90)
def test_a_non_finite_value_stops_every_stage_with_one_line(tmp_path: Path, reference: list[float]) -> None:
    cfg = _cfg(tmp_path, "job.optimizer.lr=1e6")  # step 1: loss 9e6, its gradients are not finite
    sup = Supervisor(tmp_path / "run")
    report = tmp_path / "report"
    with pytest.raises(FlotillaError) as info:
        run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    _no_process_left(sup)
    # Which stage's gradients overflow first is the CPU's arithmetic (CI named "fast", this machine
    # "slow"); the stages agree on one verdict, and the line names it.
    assert re.fullmatch(
        r"non-finite (gradient on stage (fast|slow)|loss on stage slow) at step 1: the job stops "
        r"\(job\.nonfinite: stop\); the model keeps the last finite weights; "
        + re.escape(str(report / "model.safetensors"))
        + " holds them",
        str(info.value),
    ), str(info.value)
    assert all(child.proc.returncode == 4 for child in sup.children)
    weights = load_file(str(report / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in weights.values())
    records = read_jsonl(report / "metrics.jsonl")
    stopped = sorted((r["name"], r["step"]) for r in records if r.get("nonfinite"))
    assert stopped == [("fast", 2), ("slow", 2)]  # records count steps done: step 1 is the second


@pytest.mark.timeout(90)
def test_a_crashing_stage_fails_the_run_and_kills_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOTILLA_FAULT_CRASH", "slow@2")
    sup = Supervisor(tmp_path / "run")
    cfg = _cfg(tmp_path, "job.steps=200", "job.max_restarts=0")  # (restarts: test_pipeline_restart.py)
    with pytest.raises(FlotillaError, match="pipeline stage slow exited with code 17"):
        run_pipeline_job(cfg, None, tmp_path / "run", False, supervisor=sup)
    _no_process_left(sup)
