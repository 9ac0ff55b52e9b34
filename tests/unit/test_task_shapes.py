"""The launcher's pre-flight task check: output and target shapes as the loss sees them (a loss
that broadcasts them is refused with one line naming both shapes, legit pairs pass), a loss that
is not a scalar, and a task file that imports the module next to it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flotilla.trainer.task_load import TaskData, TaskError, check_task, load_task

ROOT = Path(__file__).resolve().parents[2]
N = 6  # samples in the data; the check uses the first CHECK_SAMPLES of them

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Task:
    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss) -> None:
        self.model, self.x, self.y, self._loss = model, x, y, loss

    def build_model(self) -> nn.Module:
        return self.model

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {}


def _check(model: nn.Module, y: torch.Tensor, loss: Loss, x: torch.Tensor | None = None) -> None:
    x = torch.randn(N, 3) if x is None else x
    task = _Task(model, x, y, loss)
    check_task(task, task.build_model(), TaskData(task.train_data()), "t.py:T")  # type: ignore[arg-type]


def _regression() -> nn.Module:
    return nn.Linear(3, 1)  # outputs (N, 1)


def _refused(model: nn.Module, y: torch.Tensor, loss: Loss) -> str:
    with pytest.raises(TaskError) as info:
        _check(model, y, loss)
    message = str(info.value)
    assert "\n" not in message and "broadcasts" in message
    return message


def test_mse_of_n1_outputs_against_n_targets_is_refused_naming_both_shapes() -> None:
    message = _refused(_regression(), torch.randn(N), F.mse_loss)
    assert "outputs of shape (4, 1) and targets of shape (4,) in mse_loss" in message


@pytest.mark.parametrize(
    ("loss", "where"),
    [
        (nn.MSELoss(), "mse_loss"),
        (nn.L1Loss(), "l1_loss"),
        (F.smooth_l1_loss, "smooth_l1_loss"),
        (lambda o, t: ((o - t) ** 2).mean(), "sub"),
        (lambda o, t: (o * 2 - t).abs().mean(), "sub"),
        (lambda o, t: (t - o).pow(2).mean(), "sub"),
    ],
)
def test_losses_that_broadcast_are_refused(loss: Loss, where: str) -> None:
    message = _refused(_regression(), torch.randn(N), loss)
    assert "(4, 1)" in message and "(4,)" in message and f"in {where}" in message


def test_targets_n1_against_outputs_n_are_refused_too() -> None:
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0))  # outputs (N,)
    message = _refused(model, torch.randn(N, 1), F.mse_loss)
    assert "outputs of shape (4,) and targets of shape (4, 1)" in message


def test_a_broadcast_only_torch_warns_about_is_refused() -> None:
    def through_numpy(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(o, torch.from_numpy(t.numpy()))  # the target's lineage is lost

    message = _refused(_regression(), torch.randn(N), through_numpy)
    assert "outputs of shape (4, 1) and targets of shape (4,)" in message
    assert "target size" in message


TOKENS = torch.randint(0, 7, (N, 5))


def _lm(vocab: int = 7) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab, 5), nn.Linear(5, vocab))  # (N, T) -> (N, T, V)


def _label_smoothed(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    soft = F.one_hot(t, o.shape[-1]).float() * 0.9 + 0.1 / o.shape[-1]
    return -(soft * F.log_softmax(o, -1)).sum(-1).mean()


def _masked_lm(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    mask = (t != 0).float()
    logp = F.log_softmax(o, -1) * mask[..., None]  # (N, T, V) * (N, T, 1)
    return -(logp.gather(-1, t[..., None]).squeeze(-1)).sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize(
    ("model", "y", "loss", "x"),
    [
        (nn.Linear(3, 4), torch.randint(0, 4, (N,)), F.cross_entropy, None),
        (nn.Linear(3, 2), torch.randint(0, 2, (N,)), F.cross_entropy, None),  # C == 2
        (nn.Linear(3, 4), torch.randint(0, 4, (N,)), nn.CrossEntropyLoss(label_smoothing=0.1), None),
        (nn.Linear(3, 4), torch.randint(0, 4, (N,)), _label_smoothed, None),
        (
            nn.Sequential(nn.Linear(3, 4), nn.LogSoftmax(-1)),
            torch.randint(0, 4, (N,)),
            lambda o, t: -o.gather(1, t[:, None]).mean(),
            None,
        ),
        (_regression(), torch.randn(N, 1), F.mse_loss, None),
        (_regression(), torch.randn(N), lambda o, t: F.mse_loss(o.squeeze(-1), t), None),
        (_regression(), torch.randn(N), lambda o, t: F.mse_loss(o, t.view_as(o)), None),
        (_regression(), torch.randn(N), lambda o, t: ((o - t[:, None]) ** 2).mean(), None),
        (_regression(), torch.rand(N, 1), F.binary_cross_entropy_with_logits, None),
        (nn.Linear(3, 2), torch.randn(N, 2), F.mse_loss, None),
        (
            _lm(),
            torch.randint(0, 7, (N, 5)),
            lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
            TOKENS,
        ),
        (_lm(), torch.randint(0, 7, (N, 5)), lambda o, t: F.cross_entropy(o.transpose(1, 2), t), TOKENS),
        (_lm(), torch.randint(0, 7, (N, 5)), _masked_lm, TOKENS),
    ],
)
def test_legit_output_target_pairs_pass(
    model: nn.Module, y: torch.Tensor, loss: Loss, x: torch.Tensor | None
) -> None:
    _check(model, y, loss, x)


def test_the_bundled_task_passes() -> None:
    task = load_task("examples/own_task/task.py:Spirals", {"num_samples": 50}, base_dir=ROOT)
    check_task(task, task.build_model(), TaskData(task.train_data()), "Spirals")


def test_a_loss_that_is_not_a_scalar_is_one_line() -> None:
    with pytest.raises(TaskError) as info:
        _check(
            nn.Linear(3, 4), torch.randint(0, 4, (N,)), lambda o, t: F.cross_entropy(o, t, reduction="none")
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith("loss must return a scalar tensor (the batch mean), got a tensor of shape (4,)")


def test_a_task_file_imports_the_module_next_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)
    (tmp_path / "flotilla_test_sibling_tasks.py").write_text(
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
        "class Base:\n"
        "    def build_model(self): return nn.Linear(2, 2)\n"
        "    def train_data(self): return torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)\n"
        "    def eval_data(self): return self.train_data()\n"
        "    def loss(self, o, t): return F.cross_entropy(o, t)\n"
        "    def metrics(self, o, t): return {}\n"
    )
    (tmp_path / "train.py").write_text(
        "from flotilla_test_sibling_tasks import Base\nclass Mine(Base): pass\n"
    )
    try:
        task = load_task(f"{tmp_path / 'train.py'}:Mine")
        assert sys.path[0] == str(tmp_path)
        assert isinstance(task.build_model(), nn.Linear)
    finally:
        sys.modules.pop("flotilla_test_sibling_tasks", None)
