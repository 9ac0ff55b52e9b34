"""Every strategy on CUDA (issue 34; skipped without CUDA: see conftest.py).

The coordinated strategies train ``examples/tiny.yaml`` with every worker on ``device: cuda`` to
the target the CPU runs reach (test accuracy >= 0.9, as in tests/multiproc/test_ps_run.py), and
every worker's row in the summary says it computed on a GPU.  On one GPU the workers share it:
their groups use gloo (NCCL refuses two ranks on one device), the PS shards stay on the CPU.  The
pipeline (two stages sharing the GPU, activations staged through host memory for gloo) matches
the single-process CPU losses of the same job step by step (TF32 off: the CPU reference is fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.trainer.reference import train_single_process

from ..multiproc._jobs import run_summary
from ..multiproc._pipeline_job import pipeline_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

STRATEGIES = {
    "allreduce": [],
    "ps": ["strategy={kind: ps, consistency: ssp, staleness: 2, num_servers: 2}"],
    "partial_reduce": ["strategy={kind: partial_reduce, group_size: 2}", "cluster.num_workers=3"],
    "adpsgd": ["strategy={kind: adpsgd}"],
    "diloco": ["strategy={kind: diloco, inner_steps: 5}"],
}


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_each_strategy_trains_tiny_on_cuda(tmp_path: Path, kind: str) -> None:
    sets = ("cluster.defaults.device=cuda", "job.steps=60", *STRATEGIES[kind])
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets)
    print(kind, "test accuracy", summary["test_accuracy"], [w.get("device") for w in summary["workers"]])
    assert summary["completed"] and summary["strategy"] == kind
    assert summary["test_accuracy"] >= 0.9
    assert summary["workers"] and all(str(w.get("device", "")).startswith("cuda") for w in summary["workers"])
    expected = "gloo" if torch.cuda.device_count() < len(summary["workers"]) else "nccl"  # (shared GPU: gloo)
    assert {w.get("transport") for w in summary["workers"]} == {expected}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_two_stages_sharing_the_gpu_match_the_cpu_losses(tmp_path: Path, schedule: str) -> None:
    cpu = pipeline_cfg(tmp_path, f"strategy.schedule={schedule}")
    reference = train_single_process(cpu)
    cfg = pipeline_cfg(tmp_path, f"strategy.schedule={schedule}", "cluster.defaults.device=cuda")
    summary = run_pipeline_job(
        cfg, tmp_path / "report", tmp_path / "run", False, supervisor=Supervisor(tmp_path / "run")
    )
    print(schedule, "losses", summary["train_losses"], "reference", reference)
    assert summary["completed"] and [s["device"] for s in summary["stages"]] == ["cuda:0", "cuda:0"]
    if schedule == "pipedream":  # (asynchronous: only its first step equals the flushed reference)
        assert summary["train_losses"][0] == pytest.approx(reference[0], rel=1e-4)
        assert summary["train_losses"][-1] < summary["train_losses"][0]
    else:
        assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)


def test_bf16_and_compiled_allreduce_on_cuda_reaches_the_target(tmp_path: Path) -> None:
    """``job.precision: bf16`` with ``job.compile: true`` (inductor) on two CUDA workers."""
    sets = ("cluster.defaults.device=cuda", "job.steps=60", "job.precision=bf16", "job.compile=true")
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets, "strategy.step_timeout_s=150")  # (compiling)
    print("bf16 + compile: test accuracy", summary["test_accuracy"])
    assert summary["completed"] and summary["test_accuracy"] >= 0.9
    assert all(str(w.get("device", "")).startswith("cuda") for w in summary["workers"])


def test_fp16_allreduce_on_cuda_reaches_the_target(tmp_path: Path) -> None:
    """``job.precision: fp16`` (a dynamic loss scale agreed through the vote) on two CUDA workers."""
    sets = ("cluster.defaults.device=cuda", "job.steps=60", "job.precision=fp16")
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets)
    print("fp16: test accuracy", summary["test_accuracy"])
    assert summary["completed"] and summary["test_accuracy"] >= 0.9
    assert all(str(w.get("device", "")).startswith("cuda") for w in summary["workers"])


def test_bf16_compiled_stages_on_cuda_train_close_to_the_cpu_float32_losses(tmp_path: Path) -> None:
    cpu = pipeline_cfg(tmp_path, "strategy.schedule=1f1b")
    reference = train_single_process(cpu)
    sets = (
        "strategy.schedule=1f1b",
        "cluster.defaults.device=cuda",
        "job.precision=bf16",
        "job.compile=true",
        "strategy.step_timeout_s=150",  # (the first microbatch compiles each stage)
    )
    cfg = pipeline_cfg(tmp_path, *sets)
    summary = run_pipeline_job(
        cfg, tmp_path / "report", tmp_path / "run", False, supervisor=Supervisor(tmp_path / "run")
    )
    losses = summary["train_losses"]
    print("bf16 compiled stages", losses, "reference", reference)
    assert summary["completed"] and len(losses) == len(reference)
    assert losses == pytest.approx(reference, rel=0.03)  # (bf16's rounding: about 1e-2 relative)
    assert losses != pytest.approx(reference, rel=1e-6)  # (it really ran in bf16)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fp16_stages_on_cuda_train_close_to_the_cpu_float32_losses(tmp_path: Path, schedule: str) -> None:
    """``job.precision: fp16`` on two stages sharing the GPU: the last stage scales the loss,
    each stage unscales its own gradients, the stages agree on every skip and on the scale."""
    reference = train_single_process(pipeline_cfg(tmp_path, f"strategy.schedule={schedule}"))
    sets = (f"strategy.schedule={schedule}", "cluster.defaults.device=cuda", "job.precision=fp16")
    cfg = pipeline_cfg(tmp_path, *sets)
    summary = run_pipeline_job(
        cfg, tmp_path / "report", tmp_path / "run", False, supervisor=Supervisor(tmp_path / "run")
    )
    losses = summary["train_losses"]
    print("fp16 stages", schedule, losses, "reference", reference)
    assert summary["completed"] and [s["device"] for s in summary["stages"]] == ["cuda:0", "cuda:0"]
    assert len(losses) == len(reference)
    assert losses == pytest.approx(reference, rel=0.03)  # (as bf16's: fp16's rounding is finer)
    assert losses != pytest.approx(reference, rel=1e-6)  # (it really ran in fp16)
    records = [json.loads(line) for line in (tmp_path / "report" / "metrics.jsonl").read_text().splitlines()]
    stage_records = [r for r in records if "stage_idx" in r]
    assert stage_records and all(r["loss_scale"] > 0 and "overflow" in r for r in stage_records)
