"""Structured batches (``data/tree.py``): tensors or tuples/lists/dicts of tensors are moved and
counted as one batch, indexed in a ``(inputs, targets)`` pair source, and anything else is refused
by the pre-start check in one line naming where it is."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from flotilla.data.tree import BatchError, batch_len, check_batch, to_device
from flotilla.trainer.builders import min_samples
from flotilla.trainer.task_load import TaskData, TaskError, check_task

Pair = namedtuple("Pair", "a b")


def test_to_device_keeps_the_structure() -> None:
    batch = {"ids": torch.zeros(3, 2, dtype=torch.long), "extra": (torch.ones(3), [torch.ones(3, 1)])}
    moved = to_device(batch, torch.device("cpu"))
    assert set(moved) == {"ids", "extra"} and isinstance(moved["extra"], tuple)
    assert moved["ids"].dtype == torch.long and batch_len(moved) == 3
    nt = to_device(Pair(torch.ones(2), torch.zeros(2)), torch.device("cpu"))
    assert isinstance(nt, Pair) and batch_len(nt) == 2


@pytest.mark.parametrize(
    "value, expected",
    [
        ({"a": torch.ones(3), "b": torch.ones(4)}, "x['b'] holds 4 samples but x['a'] holds 3"),
        (
            (torch.ones(3), "text"),
            "x[1] is a str; a batch holds tensors, or tuples, lists and dicts of tensors",
        ),
        ({"a": torch.tensor(1.0)}, "x['a'] is a 0-d tensor; every tensor of a batch needs a batch dimension"),
        ({}, "x holds no tensor"),
    ],
)
def test_bad_batches_are_named(value: object, expected: str) -> None:
    with pytest.raises(BatchError) as err:
        check_batch(value, "x")
    assert str(err.value) == expected


def test_a_pair_source_may_hold_dicts_of_tensors() -> None:
    x = {"a": torch.arange(10.0).reshape(10, 1), "b": torch.arange(10.0).reshape(10, 1) * 2}
    data = TaskData((x, torch.arange(10)))
    bx, by = data.batch([3, 7])
    assert torch.equal(bx["b"], torch.tensor([[6.0], [14.0]])) and torch.equal(by, torch.tensor([3, 7]))
    with pytest.raises(TaskError, match=r"inputs have 10 samples but targets 9"):
        TaskData((x, torch.arange(9)))


@pytest.mark.parametrize("source", ["dataset", "pair"])
def test_no_indices_give_a_batch_of_no_rows_with_the_samples_shapes(source: str) -> None:
    # (an epoch's short last batch split over more workers than it has samples: some get none)
    items = [({"ids": torch.full((5,), i), "mask": torch.ones(5, 2)}, torch.tensor(i % 3)) for i in range(4)]
    if source == "dataset":
        data = TaskData(items)
    else:
        ids = torch.stack([x["ids"] for x, _ in items])
        data = TaskData(({"ids": ids, "mask": torch.ones(4, 5, 2)}, torch.tensor([0, 1, 2, 0])))
    x, y = data.batch(np.array([], dtype=np.int64))
    assert batch_len(x) == batch_len(y) == 0
    assert x["ids"].shape == (0, 5) and x["ids"].dtype == torch.long and x["mask"].shape == (0, 5, 2)
    assert y.shape == (0,) and y.dtype == torch.long


class _Task:
    def __init__(self, items: list) -> None:
        self.items = items

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 2)

    def train_data(self) -> list:
        return self.items

    def eval_data(self) -> list:
        return self.items

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {}


def test_the_pre_start_check_refuses_a_batch_with_a_string_in_one_line() -> None:
    task = _Task([((torch.ones(2), "note"), torch.tensor(0))] * 4)
    with pytest.raises(TaskError) as err:
        check_task(task, task.build_model(), TaskData(task.train_data()), "t.py:T")  # type: ignore[arg-type]
    assert str(err.value) == (
        "task 't.py:T': the inputs[1][0] is a str; a batch holds tensors, "
        "or tuples, lists and dicts of tensors"
    )


def test_a_model_with_batchnorm_trains_on_two_samples_at_least() -> None:
    assert min_samples(nn.Sequential(nn.Linear(2, 4), nn.ReLU())) == 1
    assert min_samples(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))) == 2
    assert min_samples(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.LazyBatchNorm2d()))) == 2
    assert min_samples(nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4))) == 1
