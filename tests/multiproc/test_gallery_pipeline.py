"""The model gallery (``_gallery_tasks.py``) under the pipeline strategy, one real process per
stage on 127.0.0.1: each accepted model trains, its exported ``model.safetensors`` (the stages
merged) loads with ``strict=True`` into a fresh model and reproduces the reported test metrics,
and the flushed losses equal single-process training's; each refused model is one line naming
the layer or parameter and the reason, raised before any stage starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.config import load_config
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.elastic.checkpoint import Checkpoint
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.trainer import builders
from flotilla.trainer.pipeline_checkpoint import config_fingerprint, load_stage
from flotilla.trainer.reference import train_single_process
from flotilla.trainer.task_load import evaluate_task

pytestmark = pytest.mark.timeout(240)

TASKS = Path(__file__).with_name("_gallery_tasks.py")


def _cfg(
    tmp_path: Path,
    name: str,
    speeds: tuple[float, ...] = (1.0, 1.0),
    optimizer: str = "",
    schedule: str = "1f1b",
    extra: str = "",
    points: str = "",
):
    opt = optimizer or "{kind: sgd, lr: 0.05, momentum: 0.9}"
    workers = ", ".join(f"{{name: s{i}, speed: {sp}}}" for i, sp in enumerate(speeds))
    text = f"""
cluster:
  workers: [{workers}]
job:
  task: "{TASKS}:{name}"
  optimizer: {opt}
  batch_size: 32
  steps: 8
  eval_every_steps: 0
strategy: {{kind: pipeline, schedule: {schedule}, num_stages: {len(speeds)}, num_microbatches: 4,
  step_timeout_s: 60{points}}}
"""
    path = tmp_path / "pipe.yaml"
    path.write_text(text + extra)
    return load_config(path)


def _train(tmp_path: Path, name: str, **kw: object) -> dict:
    cfg = _cfg(tmp_path, name, **kw)  # type: ignore[arg-type]
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False)
    if name != "BatchNormMLP":  # (BatchNorm normalises each microbatch, as under GPipe: not equal)
        assert summary["train_losses"] == pytest.approx(train_single_process(cfg), rel=1e-4, abs=1e-6)
    task = builders.build_task(cfg)
    model = task.build_model()
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    _, eval_data = builders.build_task_data(task)
    again = evaluate_task(task, model, eval_data)
    assert again["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert again["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-9)
    return summary


def _layer_ends(tmp_path: Path) -> list[int]:
    return list(json.loads((tmp_path / "run" / "pipeline_job.json").read_text())["layer_ends"])


@pytest.mark.parametrize("name", ["BatchNormMLP", "ParamFree", "TokenLM", "AuxOutputSeq"])
def test_gallery_models_train_under_the_pipeline(name: str, tmp_path: Path) -> None:
    _train(tmp_path, name)


def test_a_stage_of_frozen_layers_only_trains(tmp_path: Path) -> None:
    """A slow first device gets the fewest layers: the frozen Linear + Tanh (no trainable
    parameter, no input gradient) -- the case that crashed in backward."""
    _train(tmp_path, "FrozenExtractor", speeds=(0.1, 1.0))
    assert _layer_ends(tmp_path)[0] <= 2


def test_a_parameter_free_stage_sends_int64_ids(tmp_path: Path) -> None:
    # the cut after the integer layer is named (module "1" starts stage 1): the partitioner's
    # choice for a slow first device follows a profile, which a loaded machine can tilt
    _train(tmp_path, "IntBoundaryLM", speeds=(0.1, 1.0), points=', split_points: ["1"]')
    assert _layer_ends(tmp_path) == [1, 2]  # stage 0: the integer layer only


def test_clipping_is_on_the_norm_over_all_stages(tmp_path: Path) -> None:
    """With a clip far below the gradient's norm, the pipeline's losses equal single-process
    training with ``clip_grad_norm_`` on the whole model (clipping per stage would differ)."""
    _train(tmp_path, "ParamFree", optimizer="{kind: sgd, lr: 0.5, momentum: 0.0, clip_grad_norm: 0.01}")


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_tied_lm_keeps_its_tie_across_stages(num_stages: int, tmp_path: Path) -> None:
    """The output layer shares the embedding's weight; the split puts them in the first and the
    last stage.  The losses of every step equal single-process training of the tied model, the
    stages' copies are bitwise equal after every step (a checkpoint per step) and at the end, and
    the exported model reproduces the reported metrics (``_train``)."""
    opt = "{kind: adam, lr: 0.02, clip_grad_norm: 0.5}"
    ck = "checkpoint: {every_steps: 1, dir: ck, keep: 100}\n"
    _train(tmp_path, "TiedLM", speeds=(1.0,) * num_stages, optimizer=opt, extra=ck)
    ends = _layer_ends(tmp_path)
    assert len(ends) == num_stages  # (3 layers: the embedding on the first stage, the head on the last)
    head = f"{2 - ends[-2]}.weight"  # the output layer's weight in the last stage's module
    first = load_file(tmp_path / "run" / "stage0.safetensors")["0.weight"]
    assert torch.equal(first, load_file(tmp_path / "run" / f"stage{num_stages - 1}.safetensors")[head])
    assert not torch.equal(first, builders.build_task(_cfg(tmp_path, "TiedLM")).build_model()[0].weight)
    fingerprint = config_fingerprint(
        _cfg(tmp_path, "TiedLM", speeds=(1.0,) * num_stages, optimizer=opt, extra=ck)
    )
    for step in range(1, 9):
        copies = [_weight(load_stage(tmp_path / "report" / "ck", s, step, fingerprint), key)
                  for s, key in ((0, "0.weight"), (num_stages - 1, head))]  # fmt: skip
        assert torch.equal(copies[0], copies[1]), f"the tied copies differ after step {step}"


def _weight(ckpt: Checkpoint, key: str) -> torch.Tensor:
    return ckpt.parts["model"][key]


def test_pipedream_refuses_a_tie_across_stages_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        run_pipeline_job(
            _cfg(tmp_path, "TiedLM", schedule="pipedream"), tmp_path / "r", tmp_path / "run", False
        )
    assert str(err.value) == (
        "pipeline: parameter 0.weight is tied across stages 0, 1 (the same tensor in layers of each), "
        "which the pipedream schedule cannot keep tied (no flush at which the stages could sum its "
        "gradient); use schedule gpipe or 1f1b"
    )


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "DictInputs",  # (not an nn.Sequential: traced, then refused for its dict input)
            "pipeline strategies need one tensor as the model's input; the task's inputs are a dict",
        ),
        (
            "TupleMiddle",
            "pipeline: layer 1 (_Pair) returns a tuple; every layer but the last must return one tensor "
            "(only the last may return a tuple for the loss)",
        ),
    ],
)
def test_refused_models_are_one_line_before_anything_starts(name: str, expected: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        run_pipeline_job(_cfg(tmp_path, name), tmp_path / "report", tmp_path / "run", False)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run" / "pipeline_job.json").exists()  # nothing was started


def test_the_launcher_names_the_stage_whose_error_ended_the_run(tmp_path: Path) -> None:
    """The last stage's layer raises; stage 0 then fails on the broken connection, and may exit
    first: the launcher still names the last stage and its error -- at once: stage 0, left to
    re-form its group with a dead mate, would hold the run for the collectives' timeout (it is
    killed instead; if it got to say why it failed, it is its broken group)."""
    with pytest.raises(FlotillaError) as err:
        run_pipeline_job(_cfg(tmp_path, "FailsInTheHead"), tmp_path / "r", tmp_path / "run", False)
    # (the task raised: job.on_error's default stops the job, exit code 7, no restart)
    assert str(err.value).startswith(
        "pipeline stage s1 exited with code 7: RuntimeError: boom in the last layer (the traceback is in "
        "its log): the job stops (job.on_error: stop)"
    )
    assert json.loads((tmp_path / "run" / "stage1.failure.json").read_text())["cause"] == "task"
    assert "restarted" not in str(err.value)
    first = tmp_path / "run" / "stage0.failure.json"
    if first.exists():  # (it failed before it was killed: its group broke)
        failure = json.loads(first.read_text())
        assert failure["cause"] == "group" and "did not form" not in failure["line"], failure


def test_with_lose_worker_a_stage_whose_task_raises_restarts_the_job_while_the_budget_lasts(
    tmp_path: Path,
) -> None:
    """``job.on_error: lose_worker``: the stage's error is handled as a lost stage -- the job
    restarts (from the start: no checkpoint yet) while ``job.max_restarts`` allows, then ends
    naming it."""
    _cfg(tmp_path, "FailsInTheHead")
    cfg = load_config(tmp_path / "pipe.yaml", ["job.on_error=lose_worker", "job.max_restarts=1"])
    with pytest.raises(FlotillaError) as err:
        run_pipeline_job(cfg, tmp_path / "r", tmp_path / "run", False)
    line = str(err.value)
    assert line.startswith("pipeline stage s1 exited with code 1: RuntimeError: boom in the last layer"), line
    assert "restart" in line and "job.on_error" not in line, line
