"""A classification task's ``loss_sum`` (what data-parallel workers sum, ``trainer/step.py``) is
the sum over samples of what ``loss`` averages: for one target per sample the plain sum, for
per-token targets (a language model, ``[B, T]``) each sample's mean over its positions -- so a
worker's gradients and its reported loss are the per-token mean's, as the pipelines' and the
single-process reference's are (before, a language model's were T times larger)."""

from __future__ import annotations

import pytest
import torch

from flotilla.trainer.task import ClassificationTask, cross_entropy_sum


class _Task(ClassificationTask):
    def build_model(self):  # pragma: no cover - not used
        raise NotImplementedError

    def train_data(self):  # pragma: no cover
        raise NotImplementedError

    def eval_data(self):  # pragma: no cover
        raise NotImplementedError


@pytest.mark.parametrize("shape", [(6,), (6, 9)])
def test_loss_sum_over_samples_is_n_times_the_mean_loss(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    n = shape[0]
    logits = torch.randn(n, 11, *shape[1:], generator=g, requires_grad=True)
    target = torch.randint(0, 11, shape, generator=g)
    task = _Task()
    total = task.loss_sum(logits, target)
    assert float(total.detach()) / n == pytest.approx(float(task.loss(logits, target).detach()), rel=1e-6)
    (total / n).backward()
    grad_sum = logits.grad.clone()
    logits.grad = None
    task.loss(logits, target).backward()
    assert torch.allclose(grad_sum, logits.grad, rtol=1e-5, atol=1e-7)


def test_one_target_per_sample_keeps_the_exact_sum() -> None:
    logits, target = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    assert torch.equal(
        cross_entropy_sum(logits, target), torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    )
