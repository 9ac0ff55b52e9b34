"""The view's state agreement averages the replicas only when EVERY member asks for it
(``trainer/state_sync.agree_state``: one flag in its probe), so the members' collectives match
whether or not a member switches in from a strategy whose replicas drifted apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flotilla.trainer.state_sync import agree_state


class _Peer:
    """A group whose other member sent ``other``'s probe (the MAX all-reduce of the two)."""

    rank, world_size = 0, 2

    def __init__(self, other: list[float]) -> None:
        self.other = torch.tensor(other, dtype=torch.float64)
        self.calls: list[str] = []

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.calls.append(op)
        if len(self.calls) == 1:  # the probe
            torch.maximum(tensor, self.other, out=tensor)
        else:  # the donor election (MIN): this member is the donor
            tensor.fill_(0)
        return tensor

    def broadcast(self, tensors: Any, src: int) -> None:
        pass


class _Engine:
    step, has_state = 7, True

    def __init__(self) -> None:
        self.averaged = 0

    def average(self, group: Any) -> None:
        self.averaged += 1

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        return {}, []


@pytest.mark.parametrize(
    ("mine", "theirs", "averaged"),
    [(True, True, 1), (True, False, 0), (False, True, 0), (False, False, 0)],
)
def test_the_replicas_are_averaged_only_when_every_member_asks(mine, theirs, averaged) -> None:
    group, engine = _Peer([1.0, 7.0, -7.0, -float(theirs)]), _Engine()
    agree_state(group, engine, epoch=3, wanted=True, average=mine)
    assert engine.averaged == averaged
    assert group.calls[0] == "max"  # (one probe, whatever the flags)
