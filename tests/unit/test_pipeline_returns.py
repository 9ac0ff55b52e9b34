"""``launch/pipeline_returns.Returns``: what a lost pipeline instance's return takes -- one of the
budget after a stage's own failure, nothing after a loss nobody caused (up to ``FREE_RETURNS`` in a
job), nothing when the strategy forms it again on other devices (no cap: each re-form leaves a
device out) -- and what a return given up not by its newcomers' fault gets back."""

from __future__ import annotations

from flotilla.launch.pipeline_instance_log import InstanceLog
from flotilla.launch.pipeline_returns import FREE_RETURNS, Returns


def test_a_return_after_a_stage_s_own_failure_takes_the_budget_and_none_left_means_no_return() -> None:
    r = Returns(1, InstanceLog())
    culprits = {0: "a1", 1: "b0"}
    assert r.able(0, culprits) and not r.reforms(0, culprits)
    assert r.pay(0, reformed=False) is False and r.budget == 0
    assert not r.able(1, culprits) and not r.any_able([1], culprits)
    assert not r.any_able([], culprits, just_lost=False)  # (one more lost by its own stage: no budget)
    r.refund(0, free=False, reformed=False)  # (given up: another instance was lost meanwhile)
    assert r.budget == 1 and r.able(1, culprits)


def test_a_return_after_a_loss_nobody_caused_is_free_up_to_free_returns_in_a_job() -> None:
    history = InstanceLog()
    r = Returns(0, history)
    r.lost(3, nobody_failed=True)
    assert r.any_able([], {}, just_lost=True) and r.able(3, {3: None})
    assert r.pay(3, reformed=False) is True and history.free_returns == 1 and r.budget == 0
    r.refund(3, free=True, reformed=False)
    assert history.free_returns == 0 and 3 in r.free
    history.free_returns = FREE_RETURNS  # (the job's free returns spent: they take the budget)
    assert not r.able(3, {3: None}) and not r.any_able([3], {3: None}, just_lost=True)


def test_a_return_formed_again_on_other_devices_is_free_without_a_cap_and_so_is_its_retry() -> None:
    history = InstanceLog()
    history.free_returns = FREE_RETURNS
    r = Returns(0, history, reforming=True)
    culprits: dict[int, str | None] = {1: "b1"}
    assert r.reforms(1, culprits) and r.able(1, culprits) and r.any_able([], {}, just_lost=False)
    assert r.pay(1, reformed=True) is False and r.budget == 0 and history.free_returns == FREE_RETURNS
    culprits[1] = None  # (formed again: its return takes the same new processes)
    assert not r.reforms(1, culprits)
    r.refund(1, free=False, reformed=True)  # (given up, not its newcomers' fault: still a re-form)
    assert r.reforms(1, culprits) and r.able(1, culprits) and r.budget == 0
    r.pay(1, reformed=True)
    assert not r.reforms(1, culprits)
    # (a loss nobody caused comes back on its own processes: not a re-form, capped as ever)
    assert not r.reforms(2, {2: None}) and not r.able(2, {2: None})
    # (where the strategy does not re-form, a stage's own failure takes the budget)
    plain = Returns(0, InstanceLog())
    assert not plain.reforms(1, {1: "b1"}) and not plain.any_able([1], {1: "b1"}, just_lost=False)
