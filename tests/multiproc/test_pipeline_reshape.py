"""A pipeline checkpointed as 2 stages resumes as 3 (``trainer/pipeline_checkpoint.restore_reshaped``).

A GPT-2-style model (``examples/own_task/gpt.py``, tied head) trained with Adam by 2 stages cut at
a named block, with per-stage checkpoints, dies at step 8 (checkpoints 3 and 6); the job resumes
from step 6 on 3 stages whose split the partitioner chooses from the traced layers: every new
stage rebuilds the old split, takes its parameters' weights, Adam state and learning rate, and the
run ends with the uninterrupted single-process losses step by step (float tolerance), the data
position kept (the sampler is the global batch of each step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.config import RunConfig, load_config
from flotilla.core.errors import FlotillaError
from flotilla.elastic.checkpoint import list_checkpoints
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.trainer.reference import train_single_process

ROOT = Path(__file__).resolve().parents[2]
GPT_FILE = ROOT / "examples/own_task/gpt.py"


def _cfg(tmp_path: Path, stages: int, strategy: str) -> RunConfig:
    workers = ", ".join(f"{{name: s{i}}}" for i in range(stages))
    path = tmp_path / f"gpt{stages}.yaml"
    path.write_text(
        f"""
cluster: {{workers: [{workers}]}}
job:
  task: "{GPT_FILE}:TinyGPT"
  task_args: {{vocab: 16, seq_len: 8, dim: 16, layers: 3, heads: 2, num_samples: 600}}
  optimizer: {{kind: adam, lr: 0.01}}
  batch_size: 32
  steps: 12
  max_restarts: 0
strategy: {{kind: pipeline, schedule: 1f1b, num_stages: {stages}, num_microbatches: 4, {strategy}}}
checkpoint: {{every_steps: 3, dir: ck, keep: 2}}
"""
    )
    return load_config(path)


@pytest.mark.timeout(180)
def test_a_two_stage_checkpoint_resumes_on_three_stages_with_the_uninterrupted_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two = _cfg(tmp_path, 2, 'split_points: ["transformer.h.2"], step_timeout_s: 30')
    reference = train_single_process(two)
    monkeypatch.setenv("FLOTILLA_FAULT_CRASH", "s1@8")  # dies after step 8: checkpoints 3 and 6
    with pytest.raises(FlotillaError, match="pipeline stage s1 exited with code 17"):
        run_pipeline_job(
            two, tmp_path / "report", tmp_path / "run1", False, supervisor=Supervisor(tmp_path / "run1")
        )
    monkeypatch.delenv("FLOTILLA_FAULT_CRASH")
    ck = tmp_path / "report" / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["stage0", "stage1"]
    # (the crash may land while step 6's checkpoint is still being written in the background -- a
    # loaded machine: the resume then goes back to step 3, the newest step both stages wrote)
    done = [{p.name for p in list_checkpoints(ck / f"stage{i}")} for i in (0, 1)]
    assert all("ckpt-000000003" in names for names in done), done
    newest = 6 if all("ckpt-000000006" in names for names in done) else 3
    three = _cfg(tmp_path, 3, "step_timeout_s: 30")  # no split points: the partitioner's split
    summary = run_pipeline_job(three, tmp_path / "report", tmp_path / "run2", False, resume_dir=ck)
    assert summary["resumed_from_step"] == newest and len(summary["layer_ends"]) == 3
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    assert sorted(p.name for p in (ck / "stage2").iterdir()) == ["ckpt-000000009", "ckpt-000000012"]
