"""The pipeline strategy on a user task: the model check, batches from a Dataset, the task loss in
the profiler, per-stage checkpoint rules and the resume point, the typed stage job and the stage's
fault plan (no processes are started here)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from flotilla.config import RunConfig, load_config
from flotilla.core.errors import ConfigError
from flotilla.core.faults import Fault, FaultPlan
from flotilla.elastic.checkpoint import CheckpointError, write_checkpoint
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor
from flotilla.roles.stage_parts import stage_faults
from flotilla.trainer.pipeline_checkpoint import (
    checkpoint_root,
    config_fingerprint,
    keep_needed,
    resume_point,
)
from flotilla.trainer.pipeline_job import ResumePoint, StageCheckpointPlan, StageJob
from flotilla.trainer.pipeline_setup import (
    BatchData,
    make_sampler,
    pipeline_parts,
    profile_for_config,
    sequential_model,
)

ROOT = Path(__file__).resolve().parents[2]
TASK_FILE = """
import torch
from torch import nn

class Plain:
    def build_model(self):
        return nn.Linear(2, 3)  # not an nn.Sequential

    def train_data(self):
        return torch.randn(40, 2), torch.randint(0, 3, (40,))

    eval_data = train_data

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    def metrics(self, out, y):
        return {}

class Listed(Plain):
    def build_model(self):
        return [nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3)]
"""

CONFIG = """
cluster:
  workers: [{{name: a, speed: 1.0}}, {{name: b, speed: 0.5}}]
job:
  task: "{task}"
  task_args: {args}
  optimizer: {{kind: sgd, lr: 0.05, momentum: 0.9}}
  batch_size: 16
  steps: {steps}
strategy: {{kind: pipeline, schedule: {schedule}, num_stages: 2, num_microbatches: 4}}
"""


def _cfg(
    tmp_path: Path, task: str, args: str = "{}", schedule: str = "1f1b", extra: str = "", steps: int = 4
) -> RunConfig:
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(task=task, args=args, schedule=schedule, steps=steps) + extra)
    return load_config(path)


def test_a_model_too_small_to_cut_is_one_line_and_nothing_starts(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "./my_task.py:Plain")  # one nn.Linear: traced, it is one layer
    sup = Supervisor(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    message = str(info.value)
    assert message == "strategy.num_stages (2) must be <= the model's 1 layers"
    assert "\n" not in message and sup.children == []
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists()


def test_a_list_of_layers_is_wrapped_and_profiled_with_the_task_loss(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "./my_task.py:Listed")
    parts = pipeline_parts(cfg)
    assert isinstance(parts.model, nn.Sequential) and len(parts.model) == 3
    profile = profile_for_config(cfg, num_warmup=0, num_repeats=1, parts=parts)
    assert [layer.name for layer in profile.layers] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert profile.batch_size == 16 and profile.layers[0].param_bytes == (2 * 8 + 8) * 4
    assert all(p.grad is None for p in parts.model.parameters())  # profiling leaves no gradients


def test_sequential_model_passes_a_sequential_through(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "./my_task.py:Plain")
    seq = nn.Sequential(nn.Linear(2, 2))
    assert sequential_model(cfg, seq) is seq
    with pytest.raises(ConfigError, match=r"build_model\(\) returned list; pipeline"):
        sequential_model(cfg, [1, 2])


def test_batch_data_collates_a_map_style_dataset(tmp_path: Path) -> None:
    spirals = str(ROOT / "examples/own_task/task.py") + ":Spirals"
    cfg = _cfg(tmp_path, spirals, "{num_samples: 200, width: 8, depth: 1}")
    parts = pipeline_parts(cfg)
    sampler = make_sampler(cfg, parts.train.num_samples)
    data = BatchData(parts.train, sampler, 4, first_step=2)
    idx = data.indices(5)  # microbatch 1 of (global) step 3
    assert list(idx) == list(sampler.global_batch(3)[4:8])
    x, y = data.input(5), data.target(5)
    full = parts.task.train_data()
    assert torch.equal(x, torch.stack([full[int(i)][0] for i in idx]))
    assert torch.equal(y, torch.stack([full[int(i)][1] for i in idx]))
    assert data.loss_scale(5) == 4 / 16


def test_checkpoints_need_every_steps_and_pipedream_keeps_enough_for_its_lag(tmp_path: Path) -> None:
    ck = "checkpoint: {every_steps: 2, dir: ck}\n"
    cfg = _cfg(tmp_path, "./my_task.py:Listed", extra=ck)
    assert checkpoint_root(cfg, tmp_path) == tmp_path / "ck" and keep_needed(cfg, 2) == 2
    # (PipeDream: stages update up to num_stages - 1 steps apart; keep 2 + (2 - 1) // 2 = 2 here)
    pd = _cfg(tmp_path, "./my_task.py:Listed", schedule="pipedream", extra=ck)
    assert checkpoint_root(pd, tmp_path) == tmp_path / "ck" and keep_needed(pd, 2) == 2
    assert keep_needed(pd, 1) == 3  # (one step apart at every_steps 1: the third newest is common)
    tight = _cfg(tmp_path, "./my_task.py:Listed", schedule="pipedream", extra=ck.replace("2,", "1, keep: 2,"))
    with pytest.raises(ConfigError, match="checkpoint.keep must be >= 3 for this pipeline"):
        checkpoint_root(tight, tmp_path)
    timed = _cfg(tmp_path, "./my_task.py:Listed", extra="checkpoint: {every_s: 5}\n")
    with pytest.raises(ConfigError, match="checkpoint.every_steps must be set"):
        checkpoint_root(timed, tmp_path)


def _stage_ckpt(root: Path, stage: int, step: int, ends: list[int], fp: str) -> None:
    write_checkpoint(
        root / f"stage{stage}",
        step=step,
        parts={"model": {"0.weight": torch.zeros(1)}},  # (the one checkpointer's layout)
        meta={"stage_idx": stage, "layer_ends": ends},
        fingerprint=fp,
    )


def test_resume_point_is_the_newest_step_every_stage_of_its_split_has(tmp_path: Path) -> None:
    fp = config_fingerprint(_cfg(tmp_path, "./my_task.py:Listed"))
    ck = tmp_path / "ck"
    with pytest.raises(
        CheckpointError, match=r"no step checkpointed by all stages of its split \(stage0: none\)"
    ):
        resume_point(ck, fp)
    for step in (2, 4):
        _stage_ckpt(ck, 0, step, [2, 3], fp)
    _stage_ckpt(ck, 1, 2, [2, 3], fp)
    assert resume_point(ck, fp) == (2, [2, 3], None)
    with pytest.raises(CheckpointError, match="another configuration"):
        resume_point(ck, "other")
    _stage_ckpt(ck, 0, 6, [1, 2, 3], fp)  # a resumed 3-stage run's first checkpoint, not complete
    _stage_ckpt(ck, 1, 6, [1, 2, 3], fp)
    assert resume_point(ck, fp) == (2, [2, 3], None)
    _stage_ckpt(ck, 2, 6, [1, 2, 3], fp)
    assert resume_point(ck, fp) == (6, [1, 2, 3], None)
    _stage_ckpt(ck, 1, 8, [1, 3], fp)  # an older split's stage 1 beside a newer stage 0: passed over
    _stage_ckpt(ck, 0, 8, [2, 3], fp)
    assert resume_point(ck, fp) == (6, [1, 2, 3], None)
    other = tmp_path / "other"
    _stage_ckpt(other, 0, 8, [2, 3], fp)
    _stage_ckpt(other, 1, 8, [1, 3], fp)
    with pytest.raises(CheckpointError, match=r"step 8: the stages record different splits \(stage1\)"):
        resume_point(other, fp)


def test_the_fingerprint_ignores_the_job_length_and_the_pipelines_shape(tmp_path: Path) -> None:
    base = config_fingerprint(_cfg(tmp_path, "./my_task.py:Listed"))
    longer = _cfg(tmp_path, "./my_task.py:Listed", steps=40)
    assert config_fingerprint(longer) == base
    other = _cfg(tmp_path, "./my_task.py:Listed", schedule="gpipe")  # (a shape field)
    assert config_fingerprint(other) == base
    assert config_fingerprint(_cfg(tmp_path, "./my_task.py:Plain")) != base  # another task


def _job(tmp_path: Path, **changes: object) -> StageJob:
    base = StageJob(
        config={"job": {"batch_size": 16}},
        store_host="127.0.0.1",
        store_port=29500,
        layer_ends=(2, 3),
        stage_names=("a", "b"),
        speeds=(1.0, 0.5),
        total_steps=8,
        run_dir=tmp_path / "run",
        report_dir=tmp_path / "report",
        resume=ResumePoint(dir=tmp_path / "ck", step=4, layer_ends=(2, 3), fingerprint="f"),
        checkpoint=StageCheckpointPlan(root=tmp_path / "ck", every_steps=2, keep=2, fingerprint="f"),
    )
    return replace(base, **changes)


def test_the_stage_job_is_typed_and_round_trips_through_json(tmp_path: Path) -> None:
    job = _job(tmp_path)
    assert StageJob.from_json(job.to_json()) == job
    bare = _job(tmp_path, report_dir=None, resume=None, checkpoint=None)
    assert StageJob.from_json(bare.to_json()) == bare
    assert job.first_step == 4 and bare.first_step == 0 and job.num_stages == 2
    with pytest.raises(
        ConfigError, match=r"per stage process: 2 processes \(1 instance\(s\)\), 1 names, 2 speeds"
    ):
        _job(tmp_path, stage_names=("a",))
    two = _job(tmp_path, replicas=2, stage_names=("a", "b", "c", "d"), speeds=(1.0, 0.5, 1.0, 0.5))
    assert StageJob.from_json(two.to_json()) == two and two.num_processes == 4 and two.num_stages == 2
    with pytest.raises(ConfigError, match=r"4 processes \(2 instance\(s\)\), 2 names, 2 speeds"):
        _job(tmp_path, replicas=2)
    # instances placed with their own cuts (HetPipe): 2 + 3 stage processes, instance by instance
    placed = _job(
        tmp_path,
        replicas=2,
        instance_ends=((2, 3), (1, 2, 3)),
        stage_names=("a", "b", "x", "y", "z"),
        speeds=(1.0, 0.5, 1.0, 1.0, 0.25),
    )
    assert StageJob.from_json(placed.to_json()) == placed and placed.num_processes == 5
    assert placed.ends_of(1) == (1, 2, 3) and placed.names_of(1) == ("x", "y", "z")
    assert placed.place_of(3).replica == 1 and placed.place_of(3).stage == 1
    with pytest.raises(ConfigError, match="different stage counts"):
        _ = placed.num_stages
    for bad, message in [
        (((2, 3), (1, 2, 4)), "must end at layer 3"),
        (((2, 3), (2, 1, 3)), "increasing layer ends"),
        (((1, 3), (1, 2, 3)), "the first equal to layer_ends"),
    ]:
        with pytest.raises(ConfigError, match=message):
            replace(placed, instance_ends=bad)
    with pytest.raises(ConfigError, match="distinct names"):
        replace(placed, stage_names=("a", "b", "x", "y", "y"))
    other = ResumePoint(dir=tmp_path, step=1, layer_ends=(1, 2, 3), fingerprint="f", split_points=("a.1",))
    reshaped = _job(tmp_path, resume=other)  # a checkpoint of another split: re-partitioned
    assert StageJob.from_json(reshaped.to_json()) == reshaped
    with pytest.raises(ConfigError, match="^not a pipeline stage job: KeyError"):
        StageJob.from_json('{"config": {}}')


def test_a_stage_crash_fault_fires_at_the_boundary_after_its_steps() -> None:
    legacy = FaultPlan.from_env({"FLOTILLA_FAULT_CRASH": "slow@2"})
    plan = stage_faults(legacy, "slow")
    assert plan.faults == (Fault(worker="slow", step=2, phase="boundary"),)
    assert stage_faults(legacy, "fast") == legacy  # another stage's faults are left alone
    with pytest.raises(ConfigError, match="action 'fail' needs a sync phase"):
        stage_faults(FaultPlan((Fault(worker="slow", step=1, action="fail"),)), "slow")


def test_a_stage_checkpoint_of_the_old_layout_is_refused_naming_it(tmp_path: Path) -> None:
    from flotilla.trainer.pipeline_checkpoint import load_stage

    write_checkpoint(tmp_path / "stage0", step=2, parts={"state": {"t0": torch.zeros(1)}},
                     meta={"stage_idx": 0, "layer_ends": [3, 6]}, fingerprint="f")  # fmt: skip
    with pytest.raises(CheckpointError, match="written in the stage layout before the one checkpointer"):
        load_stage(tmp_path, 0, 2, "f")
