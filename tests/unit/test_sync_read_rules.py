"""PS read rules (ps/read_rules.py): cached reads, read-ahead clocks, the held clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.ps.read_rules import (
    all_pushed,
    held_c_global,
    may_skip_pull,
    read_plan,
    reference_may_skip_pull,
    within_ssp_bound,
)

clocks = st.integers(0, 200)


@given(held=clocks, clock=clocks, s=st.integers(0, 10))
def test_skip_rule_matches_the_reference_and_keeps_the_ssp_bound(held, clock, s) -> None:
    skip = may_skip_pull(held=held, clock=clock, staleness=s)
    assert skip == reference_may_skip_pull(held=held, clock=clock, staleness=s)
    if skip:  # the weights held are good enough for the next clock
        assert within_ssp_bound(held=held, clock=clock + 1, staleness=s)


@given(held=clocks, clock=clocks)
def test_bsp_never_skips_a_pull_it_needs(held, clock) -> None:
    # under BSP the held weights come from a pull for clock <= the current one: held <= clock
    assert not may_skip_pull(held=min(held, clock), clock=clock, staleness=0)


def test_read_plans() -> None:
    assert read_plan("plain", clock=4, held=4, staleness=3, ahead_in_flight=False).kind == "push_pull"
    cached = read_plan("cached", clock=4, held=3, staleness=2, ahead_in_flight=False)
    assert cached.kind == "push_only" and not cached.pulls
    assert read_plan("cached", clock=4, held=2, staleness=2, ahead_in_flight=False).kind == "push_pull"
    first = read_plan("read_ahead", clock=0, held=0, staleness=1, ahead_in_flight=False)
    assert (first.kind, first.sync_pull, first.ahead_pull) == ("ahead", 1, 2)
    later = read_plan("read_ahead", clock=5, held=4, staleness=1, ahead_in_flight=True)
    assert (later.sync_pull, later.ahead_pull, later.pulls) == (None, 7, True)
    with pytest.raises(ValueError, match="read mode"):
        read_plan("eager", clock=0, held=0, staleness=0, ahead_in_flight=False)
    with pytest.raises(ValueError, match="clock"):
        read_plan("plain", clock=-1, held=0, staleness=0, ahead_in_flight=False)


def test_held_clock_is_the_slowest_shard_and_final_pull_waits_for_all() -> None:
    assert held_c_global([5, 3, 4]) == 3
    assert all_pushed([5, 5], 5) and not all_pushed([5, 4], 5)
    with pytest.raises(ValueError):
        held_c_global([])
