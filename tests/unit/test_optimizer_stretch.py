"""An emulated device's optimizer step is stretched like its forward and backward (SPEC §8:
``trainer/step.stretch_optimizer_steps``, installed by the worker role), and only the step: the
time before it (a collective's wait) is not counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.core.clock import ManualClock
from flotilla.trainer.step import stretch_optimizer_steps


class _TimedSGD(torch.optim.SGD):
    """SGD whose step takes ``took`` seconds of the manual clock (a subclass calling its base's
    step: torch runs the step hooks around both once an SGD was ever built in the process)."""

    def __init__(self, params: Any, clock: ManualClock, took: float) -> None:
        super().__init__(params, lr=0.1)
        self.clock, self.took = clock, took

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.clock.advance(self.took)
        return super().step(closure)


def test_the_update_is_stretched_and_the_wait_before_it_is_not() -> None:
    clock = ManualClock()
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        clock.advance(dt)

    model = torch.nn.Linear(3, 2)
    torch.optim.SGD(model.parameters(), lr=0.1)  # (SGD.step hooked too: the nested case, always)
    opt = _TimedSGD(model.parameters(), clock, took=0.05)
    emu = SpeedEmulator(0.25, now=clock.now, sleep=sleep)
    stretch_optimizer_steps(opt, emu, torch.device("cpu"))
    emu.start()
    clock.advance(0.1)
    emu.mark()  # (the backward: 0.1 s -> 0.4 s)
    clock.advance(2.0)  # a collective's wait: not compute
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight.detach(), before - 0.1)  # (the update itself unchanged)
    assert slept == pytest.approx([0.3, 0.15])  # 0.05 s of update lasts 0.2 s at speed 0.25
    assert emu.reset_counters() == pytest.approx((0.15, 0.45))


def test_a_device_at_full_speed_gets_no_hooks() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stretch_optimizer_steps(opt, SpeedEmulator(1.0), torch.device("cpu"))
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
