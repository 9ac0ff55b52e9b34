"""Pure decisions of data-parallel sync: buckets and the state donor (sync/plan.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.core.errors import FlotillaError
from flotilla.sync.plan import (
    NO_STATE,
    StateProbe,
    choose_donor,
    donor_rank,
    plan_buckets,
    reference_donor,
)


def test_plan_buckets_respects_cap_and_order() -> None:
    assert plan_buckets([100, 100, 100, 500, 10], 250) == [[0, 1, 2], [3], [4]]
    assert plan_buckets([10, 10, 10], 1000) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1], 0)


@given(st.lists(st.integers(1, 10_000), max_size=40), st.integers(1, 20_000))
def test_plan_buckets_partitions_in_order_and_overshoots_by_one_tensor_at_most(sizes, cap) -> None:
    buckets = plan_buckets(sizes, cap)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for b in buckets:
        assert sum(sizes[i] for i in b[:-1]) < cap  # closed as soon as it reached the cap


def _decide(steps: list[int], wanted: list[bool]) -> tuple[bool, int]:
    """What the role computes from the gathered probe: transfer?, donor rank."""
    probe = StateProbe(wanted=any(wanted), max_step=max(steps), min_step=min(steps))
    choice = choose_donor(probe, epoch=3)
    donor = min(donor_rank(r, s, choice.step, len(steps)) for r, s in enumerate(steps))
    return choice.transfer, donor


@given(
    st.lists(st.integers(NO_STATE, 50), min_size=1, max_size=8).filter(lambda s: max(s) >= 0),
    st.data(),
)
def test_donor_is_the_most_advanced_replica_with_the_lowest_rank(steps, data) -> None:
    wanted = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    transfer, donor = _decide(steps, wanted)
    assert donor == reference_donor(steps)
    assert steps[donor] == max(steps)
    assert transfer == (any(wanted) or len(set(steps)) > 1)


def test_no_transfer_when_all_agree_and_nobody_asks() -> None:
    assert _decide([7, 7, 7], [False] * 3) == (False, 0)
    assert _decide([7, NO_STATE, 9], [False] * 3) == (True, 2)
    assert _decide([9, 9], [False, True]) == (True, 0)


def test_no_live_state_is_an_error_naming_the_view() -> None:
    with pytest.raises(FlotillaError, match="view 3: no live replica"):
        choose_donor(StateProbe(wanted=True, max_step=NO_STATE, min_step=NO_STATE), epoch=3)
    with pytest.raises(ValueError, match="min_step"):
        StateProbe(wanted=False, max_step=1, min_step=2)
