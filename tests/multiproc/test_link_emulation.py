"""``cluster.links.emulate`` under ``flotilla run``: the job's traffic takes at least what its
links model (``comm/shaping.py``), and the numbers do not change.

The bounds are the model's lower bounds (a message cannot arrive before its link delivered it),
true on any machine:

- ``allreduce`` (examples/tiny.yaml, 2 workers, links of 40 ms latency): every committed step
  after the first ends at least one ring all-reduce (``2 (n - 1)`` latencies) after the previous,
  and the losses equal those of the same job without emulation;
- a pipeline (GPipe, 2 stages, a 30 ms link between them): stage 0's update of step k comes at
  least two latencies after its update of step k - 1 (its first activation of step k goes out,
  the last gradient comes back), and the losses equal the single-process run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.comm import shaping
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.report.metrics import read_jsonl
from flotilla.trainer.reference import train_single_process

from ._jobs import processes_mentioning, records, start, stop, training_steps
from ._pipeline_job import pipeline_cfg

pytestmark = pytest.mark.timeout(150)


def _run_tiny(tmp_path: Path, *sets: str) -> list[dict]:
    tmp_path.mkdir()
    args = ["run", "examples/tiny.yaml", "--report", str(tmp_path / "report")]
    args += ["--run-dir", str(tmp_path / "run")]
    args += ["--no-progress", "--set", "job.steps=12", "--set", "job.eval_every_steps=0"]
    for s in sets:
        args += ["--set", s]
    proc = start(args, tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=120) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    assert processes_mentioning(str(tmp_path)) == []
    return [r for r in training_steps(records(tmp_path / "report")) if r["committed"]]


def _losses(steps: list[dict], rank: int) -> list[float]:
    """The losses of the worker of ``rank`` (which worker joins first, and so gets which part of
    every batch, depends on the order they arrive in)."""
    return [r["loss"] for r in sorted(steps, key=lambda r: r["step"]) if r["rank"] == rank]


def test_an_allreduce_job_waits_for_its_links_and_trains_the_same(tmp_path: Path) -> None:
    latency = 0.04
    shaped = _run_tiny(
        tmp_path / "shaped", "cluster.links.emulate=true", f"cluster.links.latency_s={latency}"
    )
    plain = _run_tiny(tmp_path / "plain")
    names = sorted({r["name"] for r in shaped})
    assert len(names) == 2
    for rank in (0, 1):
        assert _losses(shaped, rank) == pytest.approx(_losses(plain, rank), rel=1e-6)
    for name in names:
        mine = sorted((r for r in shaped if r["name"] == name), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(12))
        for r in mine[1:]:  # one all-reduce at least per step: 2 (n - 1) latencies
            assert r["interval_s"] >= 2 * latency - 1e-3, r
    summary = json.loads((tmp_path / "shaped" / "report" / "summary.json").read_text())
    assert summary["completed"]


def test_a_pipeline_waits_for_its_link_and_trains_the_same(tmp_path: Path) -> None:
    latency = 0.03
    cfg = pipeline_cfg(
        tmp_path,
        "strategy.schedule=gpipe",
        "job.eval_every_steps=0",
        "cluster.links.emulate=true",
        "cluster.links.pairs=[{a: fast, b: slow, bandwidth_gbps: 0.05, latency_s: " + str(latency) + "}]",
    )
    (tmp_path / "ref").mkdir()
    reference = train_single_process(pipeline_cfg(tmp_path / "ref", "strategy.schedule=gpipe"))
    sup = Supervisor(tmp_path / "run")
    report = tmp_path / "report"
    summary = run_pipeline_job(cfg, report, tmp_path / "run", False, supervisor=sup)
    assert shaping.installed() is None  # (the launcher's links were its own: not left behind)
    assert summary["completed"] and summary["steps"] == 8
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    stage0 = sorted(
        (r for r in read_jsonl(report / "metrics.jsonl") if r["name"] == "fast"), key=lambda r: r["step"]
    )
    assert [r["step"] for r in stage0] == list(range(1, 9))
    for r in stage0[1:]:
        assert r["step_s"] >= 2 * latency - 1e-3, r
