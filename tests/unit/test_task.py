"""The task interface: loading by name, one-line errors, data access, evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from flotilla.trainer.task_load import (
    TaskData,
    TaskError,
    check_task,
    evaluate_task,
    load_task,
    task_name_of,
)
from flotilla.trainer.zoo_tasks import ZooTask

ROOT = Path(__file__).resolve().parents[2]
SPIRALS = "examples/own_task/task.py:Spirals"


def test_file_task_loads_with_args() -> None:
    task = load_task(SPIRALS, {"num_samples": 100, "width": 8}, base_dir=ROOT)
    model = task.build_model()
    assert isinstance(model, nn.Sequential)
    assert any(isinstance(m, nn.LayerNorm) for m in model.modules())
    data = TaskData(task.train_data(), "train")
    assert data.num_samples == 80
    x, y = data.batch([0, 5, 7])
    assert x.shape == (3, 2) and y.shape == (3,)


def test_module_task_loads_and_rebuilds_by_name() -> None:
    task = load_task(
        "flotilla.trainer.zoo_tasks:ZooTask",
        {"model": "tiny_mlp", "dataset": "synthetic", "num_samples": 200},
    )
    assert isinstance(task, ZooTask)
    assert task_name_of(task) == "flotilla.trainer.zoo_tasks:ZooTask"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_colon_here", "expected 'package.module:Class'"),
        ("flotilla_no_such_pkg.mod:Task", "cannot import module 'flotilla_no_such_pkg.mod'"),
        ("./missing_file.py:Task", "does not exist"),
        ("examples/own_task/task.py:Nope", "has no attribute 'Nope'"),
        ("examples/own_task/task.py:SpiralDataset", "constructing it"),
        ("examples/own_task/task.py:Residual", "lacks the method(s) build_model, train_data"),
    ],
)
def test_bad_task_names_give_one_line(name: str, message: str) -> None:
    args = {"width": 4} if name.endswith(":Residual") else {}
    with pytest.raises(TaskError) as info:
        load_task(name, args, base_dir=ROOT)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_model_that_does_not_fit_the_loss_is_refused() -> None:
    task = load_task(SPIRALS, {"num_samples": 50}, base_dir=ROOT)
    wrong = nn.Sequential(nn.Linear(2, 5), nn.Flatten(0))  # 1-D output: cross_entropy rejects it
    with pytest.raises(TaskError, match="loss\\(model\\(inputs\\), targets\\) failed"):
        check_task(task, wrong, TaskData(task.train_data()), SPIRALS)


class _DetachedLoss:
    """Spirals whose loss is computed on the detached output: it trains nothing."""

    def __init__(self, task: object) -> None:
        self.task = task

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.detach(), target)


def test_a_loss_that_no_gradient_flows_back_from_is_refused() -> None:
    """Before: validate passed it, then every worker died at its first backward with autograd's
    traceback (a pipeline's validate died in its profile)."""
    task = load_task(SPIRALS, {"num_samples": 50}, base_dir=ROOT)
    data = TaskData(task.train_data())
    with pytest.raises(TaskError, match="the loss does not depend on the model's trainable parameters"):
        check_task(_DetachedLoss(task), task.build_model(), data, SPIRALS)  # type: ignore[arg-type]
    check_task(task, task.build_model(), data, SPIRALS)  # (the task's own loss: accepted)


def test_a_model_with_nothing_to_train_is_refused() -> None:
    """Before: validate passed it, then every worker died at its start (``model has no trainable
    parameters``) and the job ended with none left."""
    task = load_task(SPIRALS, {"num_samples": 50}, base_dir=ROOT)
    data = TaskData(task.train_data())
    for model in (task.build_model().requires_grad_(False), nn.Sequential(nn.Identity())):
        with pytest.raises(TaskError, match="the model has no trainable parameters"):
            check_task(task, model, data, SPIRALS)
    partly = task.build_model()
    partly[0].requires_grad_(False)  # (frozen layers beside trainable ones: accepted)
    check_task(task, partly, data, SPIRALS)


class _Metrics:
    def __init__(self, task: object, metrics: object) -> None:
        self.task, self.value = task, metrics

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.task.loss(output, target)  # type: ignore[attr-defined]

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> object:
        return self.value


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"accuracy": "high"}, "task _Metrics: metrics() gave 'accuracy' = 'high', not a number"),
        ([0.5], "task _Metrics: metrics() must return a dict of name -> number, got list"),
        ({"f1": torch.ones(3)}, "task _Metrics: metrics() gave 'f1' = tensor([1., 1., 1.]), not a number"),
    ],
)
def test_metrics_that_are_not_numbers_are_one_line(metrics: object, message: str) -> None:
    """Before: ``flotilla validate`` (and every evaluation) died with a traceback."""
    task = load_task(SPIRALS, {"num_samples": 50}, base_dir=ROOT)
    data = TaskData(task.train_data())
    with pytest.raises(TaskError) as info:
        evaluate_task(_Metrics(task, metrics), task.build_model(), data)  # type: ignore[arg-type]
    assert str(info.value) == message
    ok = evaluate_task(_Metrics(task, {"accuracy": torch.tensor(0.5)}), task.build_model(), data)  # type: ignore[arg-type]
    assert ok["accuracy"] == 0.5


def test_tensor_data_checks_lengths() -> None:
    with pytest.raises(TaskError, match="inputs have 3 samples but targets 2"):
        TaskData((torch.zeros(3, 2), torch.zeros(2)))


def test_evaluation_weighs_batches_by_size() -> None:
    class Half:
        def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return out.sum() * 0

        def metrics(self, out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
            return {"pos": float((y > 0).float().mean())}

    y = torch.tensor([1, 1, 1, 0, 0])  # 3 of 5 positive; batches of 2 give means 1, 0.5, 0
    result = evaluate_task(Half(), nn.Identity(), TaskData((torch.zeros(5, 1), y)), batch=2)  # type: ignore[arg-type]
    assert result["pos"] == pytest.approx(0.6)
    assert result["loss"] == 0.0


def test_failures_inside_the_task_are_one_line_task_errors(tmp_path: Path) -> None:
    from flotilla.trainer import builders

    class Broken:
        def build_model(self) -> nn.Module:
            raise RuntimeError("first line\nsecond line")

        def train_data(self) -> None:
            raise FileNotFoundError("no such file data.csv")

        def eval_data(self) -> None:
            return None

        def loss(self, o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return o.sum()

        def metrics(self, o: torch.Tensor, t: torch.Tensor) -> dict[str, float]:
            return {}

    cfg = builders.RunConfig.model_validate(
        {"cluster": {"num_workers": 1}, "job": {"task": "x.py:Broken", "steps": 1}}
    )
    with pytest.raises(TaskError) as info:
        builders.build_task_model(cfg, Broken())  # type: ignore[arg-type]
    assert str(info.value) == "task Broken: build_model() failed: RuntimeError: first line"
    with pytest.raises(TaskError, match="train_data\\(\\) failed: FileNotFoundError: no such file data.csv"):
        builders.build_task_data(Broken())  # type: ignore[arg-type]
