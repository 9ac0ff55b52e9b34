"""The per-step fast paths give the same answers as the plain ones:

- ``gradients_finite`` (the fused AMP kernel for many small gradients, the sums for large ones)
  finds a NaN or an infinity anywhere, is not fooled by finite values whose sum overflows, and
  leaves finite gradients bitwise as they were;
- a task whose loss is a batch mean is not rescaled when one worker holds the whole batch, and is
  scaled by ``n / global_batch`` otherwise: the gradients equal the summed loss's divided by
  ``global_batch``;
- a one-member group runs no backend: its collectives are the identity, point-to-point is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flotilla.comm.collective import Group
from flotilla.core.errors import CollectiveError
from flotilla.sync import state
from flotilla.sync.state import all_finite, gradients_finite
from flotilla.trainer.step import Minibatch, TaskLoss, _forward_backward


class _NoSync:
    def begin_step(self, step: int) -> None:
        pass


@pytest.mark.parametrize("numel", [7, 3 * state._FUSED_MEAN_NUMEL])  # fused kernel, then the sums
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_gradients_finite_finds_every_non_finite_value(numel: int, bad: float) -> None:
    grads = [torch.randn(numel) for _ in range(4)]
    assert gradients_finite(grads)
    grads[2][numel // 2] = bad
    assert not gradients_finite(grads)
    assert not all_finite(grads)


def test_gradients_finite_is_exact_and_leaves_finite_values_bitwise_unchanged() -> None:
    grads = [torch.full((5,), 3e38), torch.full((3,), 3e38), torch.tensor([-0.0, 1e-45, 2.5])]
    before = [g.clone() for g in grads]
    assert gradients_finite(grads)  # the sum overflows; every element is finite
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.view(torch.int32), b.view(torch.int32))
    assert gradients_finite([]) and gradients_finite([torch.empty(0)])
    assert gradients_finite([torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)])


def _grads(
    loss: TaskLoss, x: torch.Tensor, y: torch.Tensor, global_batch: int
) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    loss_sum = _forward_backward(model, _NoSync(), Minibatch(0, x, y), global_batch, None, loss)
    return float(loss_sum), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("n, global_batch", [(8, 8), (5, 8), (8, 24)])
def test_a_mean_loss_and_a_summed_loss_give_the_same_step(n: int, global_batch: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)
    mean_total, mean_grads = _grads(TaskLoss(F.cross_entropy, sums=False), x, y, global_batch)
    summed = TaskLoss(lambda o, t: F.cross_entropy(o, t, reduction="sum"), sums=True)
    sum_total, sum_grads = _grads(summed, x, y, global_batch)
    assert mean_total == pytest.approx(sum_total, rel=1e-6)
    for a, b in zip(mean_grads, sum_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_one_member_group_runs_no_backend() -> None:
    store = torch.distributed.HashStore()
    group = Group(store, namespace="solo", rank=0, world_size=1)
    t = torch.tensor([1.5, -2.0])
    assert torch.equal(group.allreduce(t.clone(), op="max"), t)
    assert torch.equal(group.allreduce(t.clone()), t)
    group.broadcast([t], src=0)
    group.barrier()
    group.abort("gone")
    with pytest.raises(CollectiveError, match="gone"):
        group.allreduce(t)
    group.close()
    other = Group(store, namespace="solo2", rank=0, world_size=1)
    with pytest.raises(CollectiveError, match="no peer"):
        other.send(t, dst=0)
    assert other.aborted  # (a failed launch fails the group, as with any backend)
