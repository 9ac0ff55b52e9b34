"""The BatchNorm and tied-weight variants of ``examples/own_task/task.py`` (docs/tasks.md) pass the
pre-start check, and the tied model really shares one tensor between its embedding and its
output layer, which a pipeline split keeps tied (``pipeline/model_check.split_ties``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flotilla.cli.pipeline_cmds import plan_command, profile_command
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch.validation import validate
from flotilla.pipeline.model_check import check_layers, split_ties
from flotilla.trainer.task_load import TaskData, check_task, load_task

TASK = Path(__file__).resolve().parents[2] / "examples" / "own_task" / "task.py"


def test_the_batchnorm_example_passes_the_checks() -> None:
    task = load_task(f"{TASK}:BNSpirals", {"width": 8, "num_samples": 100})
    model = task.build_model()
    check_task(task, model, TaskData(task.train_data()), "BNSpirals")
    x, _ = TaskData(task.train_data()).batch(range(8))
    check_layers(model, x)
    assert sum(1 for _ in model.buffers()) == 6  # two BatchNorms: mean, var, count


def test_the_tied_example_shares_one_tensor_and_a_split_keeps_the_tie() -> None:
    task = load_task(f"{TASK}:TiedLM", {"num_samples": 100})
    model = task.build_model()
    assert model[4].weight is model[0].weight
    data = TaskData(task.train_data())
    check_task(task, model, data, "TiedLM")
    check_layers(model, data.batch(range(8))[0])
    ties = split_ties(model, [2, 5])
    assert [(t.name, t.stages) for t in ties] == [("0.weight", (0, 1))] and ties[0].param is model[0].weight
    assert split_ties(model, [5]) == []


def test_flotilla_plan_names_the_tie_and_refuses_it_under_pipedream() -> None:
    app = typer.Typer(add_completion=False)
    app.command("plan")(plan_command)
    app.command("profile")(profile_command)  # (two commands: typer then wants the name)
    example = TASK.with_name("pipeline_tied.yaml")
    res = CliRunner().invoke(app, ["plan", str(example)])
    assert res.exit_code == 0, res.output
    assert "tied across stages 0, 1: 0.weight (its gradient is summed at every flush)" in res.output
    pd = ["--set", "strategy.schedule=pipedream", "--set", "job.optimizer.clip_grad_norm=null"]
    res = CliRunner().invoke(app, ["plan", str(example), *pd])
    assert res.exit_code == 2
    assert "error: pipeline: parameter 0.weight is tied across stages 0, 1" in res.output


def test_a_batchnorm_pipeline_with_one_sample_microbatches_is_refused_by_validate() -> None:
    """Before: validate accepted it; every stage 0 then failed its first forward (``Expected more
    than 1 value per channel when training``) and the run gave up after a restart."""
    path = TASK.parent / "pipeline.yaml"
    bn = ["job.task=./task.py:BNSpirals", "job.batch_size=8", "job.task_args.num_samples=200"]
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, [*bn, "strategy.num_microbatches=8"]))
    assert str(info.value).startswith("strategy.num_microbatches: a microbatch holds 1 sample(s)")
    assert "use at most 4 microbatches" in str(info.value)
    validate(load_config(path, [*bn, "strategy.num_microbatches=4"]))  # (2 samples each: accepted)
    plain = ["job.batch_size=8", "job.task_args.num_samples=200", "strategy.num_microbatches=8"]
    validate(load_config(path, plain))  # (no BatchNorm: one sample per microbatch is fine)
