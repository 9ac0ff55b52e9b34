"""On CUDA: gradients in bfloat16 on the wire (``allreduce``'s ``grad_dtype: bf16``) and the
replicas' checkpoints written in the background (``trainer/checkpointer.py``) -- skipped without
CUDA (conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.elastic.checkpoint import list_checkpoints

from ..multiproc._jobs import processes_mentioning, run_summary, start, stop

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_bf16_gradients_on_the_wire_between_cuda_workers_reach_the_target(tmp_path: Path) -> None:
    sets = ("cluster.defaults.device=cuda", "job.steps=60", "strategy.grad_dtype=bf16")
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets)
    print("grad_dtype bf16: test accuracy", summary["test_accuracy"])
    assert summary["completed"] and summary["test_accuracy"] >= 0.9


def test_background_checkpoints_of_cuda_workers_are_cpu_tensors_and_resume(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    sets = ("cluster.defaults.device=cuda", f"checkpoint={{dir: {ckpt}, every_steps: 10, keep: 3}}")
    first = run_summary("examples/tiny.yaml", tmp_path / "a", *sets, "job.steps=40")
    assert first["completed"]
    found = list_checkpoints(ckpt)
    assert [p.name for p in found] == ["ckpt-000000020", "ckpt-000000030", "ckpt-000000040"]
    model = load_file(str(found[-1] / "model.safetensors"))  # (loads on a machine without a GPU)
    assert model and all(t.device.type == "cpu" for t in model.values())
    report = tmp_path / "b" / "report"
    args = ["run", "examples/tiny.yaml", "--report", str(report), "--run-dir", str(tmp_path / "b" / "run")]
    args += ["--no-progress", "--resume", str(ckpt)]
    log = tmp_path / "resume.log"
    proc = start([*args, *(x for kv in (*sets, "job.steps=60") for x in ("--set", kv))], log)
    try:
        assert proc.wait(timeout=280) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    assert processes_mentioning(str(tmp_path / "b")) == []
    assert "at step 40" in "".join(p.read_text() for p in (tmp_path / "b" / "run").glob("w*.log"))
    assert list_checkpoints(ckpt)[-1].name == "ckpt-000000060"
