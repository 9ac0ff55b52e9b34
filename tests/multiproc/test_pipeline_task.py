"""A user task (``examples/own_task/task.py:Spirals``: residual MLP + LayerNorm, map-style Dataset)
trained by the pipeline strategy with one real process per stage on 127.0.0.1.

- the flushed schedule reproduces the single-process reference's losses (the task's own loss and
  data order), and ``model.safetensors`` -- the stages merged back into the user's model -- loads
  with ``strict=True`` into a freshly built task model and reproduces the reported test metrics;
- a run with per-stage checkpoints whose stage is killed mid-run resumes from the newest step every
  stage checkpointed and ends with the uninterrupted losses, step by step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.config import RunConfig, load_config
from flotilla.core.errors import FlotillaError
from flotilla.elastic.checkpoint import list_checkpoints
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.trainer import builders
from flotilla.trainer.reference import train_single_process
from flotilla.trainer.task_load import evaluate_task

ROOT = Path(__file__).resolve().parents[2]
CONFIG = f"""
cluster:
  workers: [{{name: fast, speed: 1.0}}, {{name: slow, speed: 0.5}}]
job:
  task: "{ROOT / "examples/own_task/task.py"}:Spirals"
  task_args: {{width: 16, depth: 2, num_samples: 1000}}
  optimizer: {{kind: sgd, lr: 0.05, momentum: 0.9}}
  batch_size: 32
  steps: 12
strategy: {{kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 4, step_timeout_s: 20}}
"""


def _cfg(tmp_path: Path, extra: str = "") -> RunConfig:
    path = tmp_path / "pipe.yaml"
    path.write_text(CONFIG + extra)
    return load_config(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train_single_process(_cfg(tmp_path_factory.mktemp("ref")))


@pytest.mark.timeout(90)
def test_a_user_task_trains_and_its_model_file_reproduces_the_metrics(
    tmp_path: Path, reference: list[float]
) -> None:
    cfg = _cfg(tmp_path)
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False)
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    assert summary["model_file"] == str(tmp_path / "report" / "model.safetensors")
    task = builders.build_task(cfg)
    model = task.build_model()  # fresh, unseeded: every weight must come from the file
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    _, eval_data = builders.build_task_data(task)
    again = evaluate_task(task, model, eval_data)
    assert again["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert again["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-9)
    assert 0.3 < summary["test_accuracy"] <= 1.0
    for stage in summary["stages"]:  # the residual MLP: measured against planned (roles/stage_memory.py)
        mem = stage["memory"]
        assert mem["activation_bytes"] == pytest.approx(mem["predicted_activation_bytes"], rel=0.2)
        assert mem["peak_bytes"] == pytest.approx(mem["predicted_bytes"], rel=0.2)


@pytest.mark.timeout(120)
def test_a_killed_run_resumes_from_its_per_stage_checkpoints(
    tmp_path: Path, reference: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path, "checkpoint: {every_steps: 3, dir: ck, keep: 2}\n")
    monkeypatch.setenv("FLOTILLA_FAULT_CRASH", "slow@8")  # dies after step 8: checkpoints 3 and 6
    with pytest.raises(FlotillaError, match="pipeline stage slow exited with code 17"):
        run_pipeline_job(
            cfg, tmp_path / "report", tmp_path / "run1", False, supervisor=Supervisor(tmp_path / "run1")
        )
    monkeypatch.delenv("FLOTILLA_FAULT_CRASH")
    ck = tmp_path / "report" / "ck"
    # (the crash at step 8 may land while step 6's checkpoint is still being written in the
    # background -- a loaded machine: then only a hidden temporary of it is left, never a
    # checkpoint without its manifest, and the resume goes back to step 3)
    both = {"ckpt-000000003", "ckpt-000000006"}
    done = [[p.name for p in list_checkpoints(ck / f"stage{i}")] for i in (0, 1)]
    assert all(names and names[0] == "ckpt-000000003" and set(names) <= both for names in done), done
    for i in (0, 1):
        for p in (ck / f"stage{i}").iterdir():
            assert p.name in done[i] or (p.name.startswith(".ckpt-") and p.name.endswith(".tmp")), p.name
    newest = 6 if all("ckpt-000000006" in names for names in done) else 3
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run2", False, resume_dir=ck)
    assert summary["resumed_from_step"] == newest
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    assert sorted(p.name for p in (ck / "stage0").iterdir()) == ["ckpt-000000009", "ckpt-000000012"]
