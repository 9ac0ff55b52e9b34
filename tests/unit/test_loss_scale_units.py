"""fp16 in units of several minibatches (a WSP wave, each worker its own scale) and the boundary's
overflow count: a non-finite loss is never an overflow, a wave's last minibatch that overflows is
dropped like an earlier one, and overflows without end count as non-finite (trainer/step.py,
trainer/boundary.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.loss_scale import ScaleRule, ScaleState
from flotilla.sync.scaler import LossScaler
from flotilla.trainer.boundary import (
    MAX_OVERFLOWS_IN_A_ROW,
    Action,
    BoundaryPolicy,
    LoopState,
    StopReason,
    UnitReport,
    decide,
)
from flotilla.trainer.precision import autocast_of
from flotilla.trainer.step import Minibatch, run_unit


class _Wave(SyncStrategy):
    """A worker-local strategy with local steps inside a unit (as ps's delta under WSP): each
    minibatch but the last is applied locally, the unit is pushed when ``local_ok``."""

    kind = "wave"
    traits = Traits(regime=Regime.ALONE)

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.pushed = opt, 0

    def begin_step(self, step: int) -> None:
        pass

    def local_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def synchronize(self, proposal: Proposal) -> Outcome:
        if proposal.local_ok:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.pushed += 1
        return Outcome.agreed_alone(proposal, committed=proposal.local_ok)


def _setup(scale: float) -> tuple[nn.Module, _Wave, LossScaler, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    sync = _Wave(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = LossScaler(ScaleRule(init_scale=scale))
    kw = {"global_batch": 8, "autocast": autocast_of("fp16", torch.device("cpu")), "scaler": scaler}
    return model, sync, scaler, kw


def _batches(nan_in: int | None = None) -> tuple[Minibatch, ...]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(3):
        x = torch.randn(8, 4, generator=g)
        if i == nan_in:
            x[0, 0] = math.nan
        out.append(Minibatch(i, x, torch.randint(0, 3, (8,), generator=g)))
    return tuple(out)


def test_a_non_finite_loss_early_in_a_wave_is_a_non_finite_unit_not_an_overflow() -> None:
    model, sync, scaler, kw = _setup(2.0**8)
    res = run_unit(model, sync, _batches(nan_in=0), check_gradients=True, **kw)  # type: ignore[arg-type]
    assert res.nonfinite == "loss" and not res.overflow
    assert not res.decision.committed and not res.decision.local_ok and sync.pushed == 0
    assert scaler.state == ScaleState(scale=2.0**8)  # (nothing learnt about the scale)


def test_an_overflow_of_a_waves_last_minibatch_drops_that_one_and_sends_the_rest() -> None:
    model, sync, scaler, kw = _setup(2.0**8)
    calls = [0]

    def poison_the_third(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return grad * math.inf if calls[0] == 3 else grad

    model[0].weight.register_hook(poison_the_third)
    before = [p.detach().clone() for p in model.parameters()]
    res = run_unit(model, sync, _batches(), check_gradients=True, **kw)  # type: ignore[arg-type]
    assert calls[0] == 3 and res.overflow and not res.nonfinite
    assert res.decision.committed and sync.pushed == 1  # (the first two minibatches' steps go out)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.scale == 2.0**7


def test_overflows_without_end_count_as_non_finite_and_a_good_unit_resets_the_count() -> None:
    policy = BoundaryPolicy(total_steps=1000, on_nonfinite="stop", max_nonfinite=0)
    state = LoopState(step=0)
    for s in range(MAX_OVERFLOWS_IN_A_ROW):
        b = decide(
            policy,
            state,
            UnitReport(first_step=s, last_step=s, rank=0, epoch=1, committed=False, overflow=True),
        )
        assert b.action is Action.SKIP and b.stop is None
        state = b.state
    assert state.overflows_in_a_row == MAX_OVERFLOWS_IN_A_ROW
    s = state.step
    again = UnitReport(first_step=s, last_step=s, rank=0, epoch=1, committed=False, overflow=True)
    assert decide(policy, state, again).stop is StopReason.NONFINITE
    good = decide(policy, state, UnitReport(first_step=s, last_step=s, rank=0, epoch=1, committed=True))
    assert good.state.overflows_in_a_row == 0
    both = UnitReport(
        first_step=s, last_step=s, rank=0, epoch=1, committed=False, overflow=True, local_ok=False
    )
    assert decide(policy, LoopState(step=s), both).stop is StopReason.NONFINITE  # (a non-finite loss wins)


def test_a_gradient_the_fused_kernel_refuses_is_unscaled_once_on_the_host_path() -> None:
    dense, sparse = torch.full((3,), 4.0), torch.full((3,), 4.0).to_sparse()
    scaler = LossScaler(ScaleRule(init_scale=4.0))
    assert scaler.unscale_flag_([dense, sparse]) is None  # (asked first: nothing was touched)
    assert torch.equal(dense, torch.full((3,), 4.0))
    assert scaler.unscale_([dense, sparse])
    assert torch.equal(dense, torch.ones(3)) and torch.equal(sparse.to_dense(), torch.ones(3))  # (once)
