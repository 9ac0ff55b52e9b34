"""The pure step-boundary rule (trainer/boundary.py): examples and property tests over random
sequences of unit outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.trainer.boundary import (
    Action,
    BoundaryPolicy,
    LoopState,
    StopReason,
    SwitchAt,
    UnitReport,
    decide,
)


def report(state: LoopState, **kw) -> UnitReport:
    k = kw.pop("k", 1)
    base = dict(first_step=state.step, last_step=state.step + k - 1, rank=0, epoch=1, committed=True)
    return UnitReport(**{**base, **kw})


def test_commit_advances_and_duties_fall_due() -> None:
    policy = BoundaryPolicy(total_steps=10, eval_every_units=2, checkpoint_every_steps=3)
    s = LoopState()
    seen = []
    for _ in range(10):
        b = decide(policy, s, report(s))
        seen.append((b.state.step, b.checkpoint, b.evaluate))
        s = b.state
    assert [st for st, _, _ in seen] == list(range(1, 11))
    assert [st for st, ck, _ in seen if ck] == [3, 6, 9]
    assert [st for st, _, ev in seen if ev] == [2, 4, 6, 8]  # never at the last step
    assert b.stop is StopReason.FINISHED and b.flush_records


def test_units_of_several_steps_fall_due_when_they_cross_a_multiple() -> None:
    """Units of 5 steps (diloco's inner steps, WSP's waves) with duties every 12 steps: each is
    due at the first boundary past each multiple, never skipped (12 is never a boundary)."""
    policy = BoundaryPolicy(total_steps=60, eval_every_steps=12, checkpoint_every_steps=12)
    s, seen = LoopState(), []
    while s.step < 60:
        b = decide(policy, s, report(s, k=5))
        seen.append((b.state.step, b.checkpoint, b.evaluate))
        s = b.state
    assert [st for st, ck, _ in seen if ck] == [15, 25, 40, 50, 60]
    assert [st for st, _, ev in seen if ev] == [15, 25, 40, 50]  # never at the last step


def test_rank_gates_rank_zero_duties_only() -> None:
    policy = BoundaryPolicy(total_steps=10, eval_every_units=1, checkpoint_every_steps=1)
    b0 = decide(policy, LoopState(), report(LoopState(), rank=0))
    b1 = decide(policy, LoopState(), report(LoopState(), rank=1))
    assert b0.checkpoint and b0.evaluate and not b1.checkpoint and not b1.evaluate
    assert b0.state.step == b1.state.step and b0.action is b1.action


def test_checkpoint_by_time() -> None:
    policy = BoundaryPolicy(total_steps=100, checkpoint_every_s=5.0)
    s = LoopState()
    b = decide(policy, s, report(s, now_s=4.0))
    assert not b.checkpoint
    b = decide(policy, b.state, report(b.state, now_s=5.5))
    assert b.checkpoint and b.state.last_checkpoint_s == 5.5
    b = decide(policy, b.state, report(b.state, now_s=9.0))
    assert not b.checkpoint


def test_broken_group_redoes_or_drops_and_recovers() -> None:
    s = LoopState(step=4)
    redo = decide(BoundaryPolicy(total_steps=10), s, report(s, committed=False, broken=True))
    assert redo.action is Action.REDO and redo.recover and redo.state.step == 4
    drop = decide(BoundaryPolicy(total_steps=10, on_abort="drop"), s, report(s, committed=False, broken=True))
    assert drop.action is Action.DROP and drop.recover and drop.state.step == 5
    assert not drop.checkpoint and not drop.switch_to and not drop.change_view


def test_nonfinite_stops_by_default_and_skips_with_a_limit() -> None:
    s = LoopState(step=3)
    b = decide(BoundaryPolicy(total_steps=10), s, report(s, committed=False, local_ok=False))
    assert b.stop is StopReason.NONFINITE and b.state.step == 3  # nothing applied
    policy = BoundaryPolicy(total_steps=10, on_nonfinite="skip", max_nonfinite=2)
    for expected in (None, None, StopReason.NONFINITE_LIMIT):
        b = decide(policy, s, report(s, committed=False, local_ok=False))
        assert b.action is Action.SKIP and b.stop is expected
        s = b.state
    assert s.nonfinite_skipped == 3 and s.step == 6


def test_agreed_view_change_switch_and_stop() -> None:
    s = LoopState(step=2)
    b = decide(BoundaryPolicy(total_steps=10), s, report(s, pending_epoch=3, epoch=1, switch=2))
    assert b.change_view == 3 and b.switch_to == 2 and b.flush_records
    b = decide(BoundaryPolicy(total_steps=10), s, report(s, pending_epoch=3, stop=True))
    assert b.stop is StopReason.REQUESTED and not b.change_view and not b.switch_to
    planned = BoundaryPolicy(total_steps=10, switch_plan=(SwitchAt(step=3, option=1),))
    assert decide(planned, s, report(s)).switch_to == 1
    with pytest.raises(ValueError, match="does not start"):
        decide(planned, s, report(LoopState(step=5)))


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on_abort must be one of redo, drop"):
        BoundaryPolicy(total_steps=1, on_abort="retry")
    with pytest.raises(ValueError, match="on_nonfinite must be one of stop, skip"):
        BoundaryPolicy(total_steps=1, on_nonfinite="ignore")


outcomes = st.sampled_from(["commit", "broken", "fault", "nonfinite"])


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.tuples(outcomes, st.integers(0, 3), st.booleans(), st.integers(1, 3)), max_size=60),
    on_abort=st.sampled_from(["redo", "drop"]),
    on_nonfinite=st.sampled_from(["stop", "skip"]),
    total=st.integers(1, 40),
)
def test_properties_over_random_outcomes(seq, on_abort, on_nonfinite, total) -> None:
    policy = BoundaryPolicy(
        total_steps=total,
        on_abort=on_abort,
        on_nonfinite=on_nonfinite,
        max_nonfinite=3,
        eval_every_units=2,
        checkpoint_every_steps=2,
        switch_plan=(SwitchAt(step=5, option=1),),
    )
    states = {r: LoopState() for r in (0, 1)}  # two ranks fed the same agreed reports
    for kind, epoch_ahead, stop, k in seq:
        s = states[0]
        if s.step >= total:
            break
        last = min(s.step + k, total) - 1
        kw = dict(
            first_step=s.step,
            last_step=last,
            epoch=1,
            committed=kind == "commit",
            broken=kind == "broken",
            local_ok=kind != "nonfinite",
            pending_epoch=1 + epoch_ahead,
            stop=stop,
        )
        b0 = decide(policy, s, UnitReport(rank=0, **kw))
        b1 = decide(policy, states[1], UnitReport(rank=1, **kw))
        # every member decides the same thing; rank only gates rank-0 duties
        assert (b0.state.step, b0.action, b0.recover, b0.change_view, b0.switch_to, b0.stop) == (
            b1.state.step,
            b1.action,
            b1.recover,
            b1.change_view,
            b1.switch_to,
            b1.stop,
        )
        assert not b1.checkpoint and not b1.evaluate
        # the step never decreases nor passes the total
        assert s.step <= b0.state.step <= total
        if kind != "commit":
            assert not b0.checkpoint and not b0.switch_to and not b0.change_view
        if kind == "commit":
            assert b0.state.step == last + 1
        states = {0: b0.state, 1: b1.state}
        if b0.stop is not None:
            break


def test_every_rank_saves_its_local_state_when_the_steps_rule_falls_due() -> None:
    """``local_checkpoint`` (each rank's own state beside rank 0's checkpoint) falls due on every
    rank at the same steps, by the steps rule only (the time rule reads rank 0's clock)."""
    policy = BoundaryPolicy(total_steps=40, checkpoint_every_steps=10, checkpoint_every_s=5.0)
    for rank in (0, 1):
        s, main, local = LoopState(), [], []
        while s.step < 40:
            b = decide(policy, s, report(s, k=5, rank=rank, now_s=s.step * 1.2))  # 6 s a unit
            main += [b.state.step] if b.checkpoint else []
            local += [b.state.step] if b.local_checkpoint else []
            s = b.state
        assert local == [10, 20, 30, 40]
        assert main == ([10, 15, 20, 25, 30, 35, 40] if rank == 0 else [])  # 15, 25, 35: by time
    stages = BoundaryPolicy(total_steps=20, checkpoint_every_steps=10, duties_on_every_rank=True)
    b = decide(stages, LoopState(step=5), report(LoopState(step=5), k=5, rank=1))
    assert b.checkpoint and not b.local_checkpoint  # (a stage's checkpoint holds all of its state)
