"""fp16's loss scale (sync/loss_scale.py, sync/scaler.py): the pure rule, unscaling, the state it
carries, the boundary's overflow rule, and a worker-local strategy's overflow (trainer/step.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.loss_scale import ScaleRule, ScaleState, Verdict, next_scale
from flotilla.sync.scaler import OVERFLOW_CODE, LossScaler, ScaleSlot, agrees_loss_scale, verdict_of_code
from flotilla.trainer.boundary import Action, BoundaryPolicy, LoopState, UnitReport, decide
from flotilla.trainer.precision import autocast_of, loss_scaler_of, refuse_fp16_stage
from flotilla.trainer.replica import ReplicaEngine
from flotilla.trainer.step import Minibatch, run_unit


def test_the_rule_grows_after_the_interval_backs_off_at_an_overflow_and_ignores_other_discards() -> None:
    rule = ScaleRule(init_scale=8.0, growth_interval=2)
    s = rule.initial()
    s = next_scale(rule, s, Verdict.GOOD)
    assert s == ScaleState(scale=8.0, good_units=1)
    s = next_scale(rule, s, Verdict.GOOD)
    assert s == ScaleState(scale=16.0, good_units=0)
    assert next_scale(rule, s, Verdict.OTHER) == s
    s = next_scale(rule, next_scale(rule, s, Verdict.GOOD), Verdict.OVERFLOW)
    assert s == ScaleState(scale=8.0, good_units=0)
    tiny = ScaleState(scale=rule.min_scale)
    assert next_scale(rule, tiny, Verdict.OVERFLOW).scale == rule.min_scale
    assert ScaleRule().initial().scale == 2.0**16


def test_rule_and_state_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="backoff_factor"):
        ScaleRule(backoff_factor=1.0)
    with pytest.raises(ValueError, match="scale"):
        ScaleState(scale=math.inf)


def test_codes_map_to_verdicts() -> None:
    assert verdict_of_code(0.0) is Verdict.GOOD
    assert verdict_of_code(OVERFLOW_CODE) is Verdict.OVERFLOW
    assert verdict_of_code(1.0) is verdict_of_code(2.0) is Verdict.OTHER


def test_unscale_divides_exactly_and_reports_an_overflow() -> None:
    sc = LossScaler(ScaleRule(init_scale=4.0))
    g = [torch.tensor([4.0, 8.0]), torch.tensor([12.0])]
    assert sc.unscale_(g) and g[0].tolist() == [1.0, 2.0] and g[1].tolist() == [3.0]
    assert not sc.unscale_([torch.tensor([1.0, math.inf])])
    assert sc.scale_loss(torch.tensor(2.0, dtype=torch.float16)).dtype == torch.float32


def test_the_scale_travels_in_a_strategy_state_even_before_the_scaler_is_attached() -> None:
    a, b = ScaleSlot(), ScaleSlot()
    a.attach(LossScaler(ScaleRule(init_scale=8.0)))
    a.settle_code(OVERFLOW_CODE)
    assert a.load({"x": torch.zeros(1)}) == {"x": torch.zeros(1)}  # (nothing of the scale: kept)
    rest = b.load({**a.state_dict(), "y": torch.ones(1)})
    assert list(rest) == ["y"]
    target = LossScaler()
    b.attach(target)  # (a resumed checkpoint's scale, applied when the scaler comes)
    assert target.state == ScaleState(scale=4.0, good_units=0)


def test_the_replica_engine_exports_and_imports_the_scale() -> None:
    def engine() -> ReplicaEngine:
        model = nn.Linear(2, 2)
        return ReplicaEngine(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=None,
            sampler=None, loss_fn=None, emulator=None, device=torch.device("cpu"),  # type: ignore[arg-type]
            scaler=loss_scaler_of("fp16"),
        )  # fmt: skip

    src, dst = engine(), engine()
    assert src.scaler is not None and dst.scaler is not None
    src.scaler.settle(Verdict.OVERFLOW)
    src.scaler.settle(Verdict.GOOD)
    dst.import_state(*src.export_state())
    assert dst.scaler.state == ScaleState(scale=2.0**15, good_units=1)


def test_an_overflow_is_skipped_without_counting_as_nonfinite() -> None:
    policy = BoundaryPolicy(total_steps=10, on_nonfinite="stop", max_nonfinite=0)
    r = UnitReport(first_step=3, last_step=3, rank=0, epoch=1, committed=False, overflow=True)
    b = decide(policy, LoopState(step=3), r)
    assert b.action is Action.SKIP and b.stop is None
    assert b.state.step == 4 and b.state.nonfinite_skipped == 0 and b.state.overflow_skipped == 1
    nonfinite = decide(
        policy, LoopState(step=3), UnitReport(**{**_fields(r), "overflow": False, "local_ok": False})
    )
    assert nonfinite.stop is not None  # (a non-finite unit still stops the job)


def _fields(r: UnitReport) -> dict:
    return {k: getattr(r, k) for k in r.__slots__}  # type: ignore[attr-defined]


class _Own(SyncStrategy):
    """A worker-local strategy (as ps, partial_reduce, adpsgd): steps its optimizer when local_ok."""

    kind = "own"
    traits = Traits(regime=Regime.ALONE)

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def begin_step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)

    def synchronize(self, proposal: Proposal) -> Outcome:
        if proposal.local_ok:
            self.opt.step()
        return Outcome.agreed_alone(proposal, committed=proposal.local_ok)


def test_a_worker_local_strategy_skips_its_own_overflow_and_backs_off_its_own_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    sync = _Own(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = LossScaler(ScaleRule(init_scale=2.0**40))  # (float16 backward overflows at this scale)
    assert not agrees_loss_scale(sync)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    kw = {"global_batch": 8, "autocast": autocast_of("fp16", torch.device("cpu")), "scaler": scaler}
    res = run_unit(model, sync, (Minibatch(0, x, y),), check_gradients=True, **kw)  # type: ignore[arg-type]
    d = res.decision
    assert res.overflow and not d.committed and d.local_ok and "overflow" in d.reason and not res.nonfinite
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.scale == 2.0**39
    scaler.state = ScaleState(scale=2.0**8)
    res = run_unit(model, sync, (Minibatch(1, x, y),), check_gradients=True, **kw)  # type: ignore[arg-type]
    assert res.decision.committed and not res.overflow and res.loss_scale == 2.0**8
    assert scaler.state == ScaleState(scale=2.0**8, good_units=1)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_pipeline_stage_refuses_fp16_in_one_line_naming_the_field() -> None:
    refuse_fp16_stage("bf16", "pipeline", "pipedream")
    refuse_fp16_stage("fp16", "pipeline", "1f1b")  # (a flush per step: the stages agree)
    with pytest.raises(
        ConfigError, match=r"^job.precision: fp16 is not built for strategy pipeline .*allreduce"
    ):
        refuse_fp16_stage("fp16", "pipeline", "pipedream")
