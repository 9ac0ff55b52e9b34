"""HetPipe virtual workers under WSP: the SPEC §2 worked example and the s_global bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.ps.consistency import SSP, WSP, ClockTable, ConsistencyModel, s_global
from flotilla.ps.wsp import (
    MinibatchRecord,
    VWTiming,
    check_sglobal_bound,
    check_slocal_bound,
    max_observed_staleness,
    simulate_wsp,
)

EXAMPLE = WSP(s_local=3, clock_distance=0)  # SPEC §2: s_global = 6


def _pipeline(period: int, s_local: int = 3) -> VWTiming:
    """A full pipeline: N_m = s_local + 1 minibatches in flight at ``period`` ticks each."""
    return VWTiming(period_ticks=period, latency_ticks=period * (s_local + 1))


def _broken_gate(model: ConsistencyModel, table: ClockTable, worker_id: int, clock: int) -> bool:
    assert isinstance(model, WSP)
    return table.c_global >= clock - (model.clock_distance + 1)  # off by one: D + 1


@pytest.mark.parametrize("slow_period", [1, 2, 3])
def test_worked_example_minibatches_11_and_12(slow_period: int) -> None:
    trace = simulate_wsp(EXAMPLE, [_pipeline(1), _pipeline(slow_period)], num_waves=4)
    assert not trace.deadlocked
    for vw in (0, 1):
        mb11, mb12 = trace.record(vw, 11), trace.record(vw, 12)
        # minibatch 11: global wave 0 (minibatches 1-4, of both VWs) + own local 5, 6, 7
        assert mb11.global_updates == {(0, 0), (1, 0)}
        assert mb11.local_updates == {5, 6, 7}
        assert mb11.observed_staleness == 6 == s_global(EXAMPLE)  # missing 8, 9, 10 and 5-7 elsewhere
        # minibatch 12 waits for the global updates of wave 1 (up to minibatch 8) of every VW
        wave1_global = max(t for t, _, u in trace.pushes if u == 1)
        assert mb12.start_tick >= wave1_global
        assert {(0, 1), (1, 1)} <= mb12.global_updates
    assert check_sglobal_bound(trace.records, EXAMPLE) == []
    assert max_observed_staleness(trace.records) == 6


def test_worked_example_exact_timeline_with_a_slow_vw() -> None:
    trace = simulate_wsp(EXAMPLE, [_pipeline(1), _pipeline(2)], num_waves=3)
    fast = {r.minibatch: r for r in trace.records if r.vw == 0}
    assert [fast[p].start_tick for p in range(1, 13)] == [0, 1, 2, 3, 4, 5, 6, 14, 15, 16, 17, 22]
    # the fast VW ran 5, 6, 7 while its pull for clock 1 waited for the slow VW's wave 0
    assert trace.pushes[:2] == ((7, 0, 0), (14, 1, 0))
    assert (14, 0, 1) in trace.pulls_served
    assert fast[8].global_updates == {(0, 0), (1, 0)} and fast[8].local_updates == {5, 6, 7}
    assert fast[12].local_updates == {9, 10, 11}


def test_no_global_waiting_in_the_first_d_plus_1_waves() -> None:
    wsp = WSP(s_local=2, clock_distance=1)
    trace = simulate_wsp(wsp, [_pipeline(1, 2), _pipeline(5, 2)], num_waves=4)
    fast = {r.minibatch: r for r in trace.records if r.vw == 0}
    first_gated = (wsp.clock_distance + 1) * wsp.wave_size + wsp.s_local + 1  # 9
    assert all(fast[p].start_tick == p - 1 for p in range(1, first_gated))
    assert fast[first_gated].start_tick > first_gated - 1
    assert fast[first_gated].global_updates >= {(0, 0), (1, 0)}


timings = st.builds(
    VWTiming,
    period_ticks=st.integers(1, 4),
    latency_ticks=st.integers(1, 12),
    jitter_ticks=st.integers(0, 2),
)


@settings(deadline=None, max_examples=100)
@given(
    st.integers(0, 4),
    st.integers(0, 3),
    st.lists(timings, min_size=1, max_size=5),
    st.integers(1, 6),
    st.integers(0, 2**16),
)
def test_sglobal_bound_holds_for_random_speeds(
    s_local: int, distance: int, vw_timings: list[VWTiming], num_waves: int, seed: int
) -> None:
    wsp = WSP(s_local=s_local, clock_distance=distance)
    trace = simulate_wsp(wsp, vw_timings, num_waves=num_waves, seed=seed)
    assert not trace.deadlocked
    per_vw = num_waves * wsp.wave_size
    assert len(trace.records) == len(vw_timings) * per_vw
    assert check_sglobal_bound(trace.records, wsp) == []
    assert check_slocal_bound(trace.records, wsp) == []
    assert max_observed_staleness(trace.records) <= s_global(wsp)
    # clock distance: no VW pushes wave u before every VW pushed wave u - D - 1
    done: dict[int, int] = {}
    for _, vw, u in trace.pushes:
        assert u - min(done.get(v, -1) for v in range(len(vw_timings))) <= distance + 1
        done[vw] = u


@pytest.mark.parametrize(("s_local", "distance"), [(0, 0), (1, 0), (3, 0), (2, 1), (1, 3)])
def test_broken_gate_is_caught(s_local: int, distance: int) -> None:
    wsp = WSP(s_local=s_local, clock_distance=distance)
    vws = [_pipeline(1, s_local), _pipeline(4, s_local)]
    good = simulate_wsp(wsp, vws, num_waves=8)
    assert check_sglobal_bound(good.records, wsp) == []
    bad = simulate_wsp(wsp, vws, num_waves=8, gate=_broken_gate)
    violations = check_sglobal_bound(bad.records, wsp)
    assert violations, "a gate allowing D + 1 must break the s_global bound"
    assert all(v.vw == 0 and v.kind == "global" for v in violations)  # only the fast VW
    assert all(m[0] == 1 for v in violations for m in v.missing)  # it lacks the slow VW's waves
    assert max_observed_staleness(bad.records) > s_global(wsp)


def test_checkers_flag_hand_made_records() -> None:
    wsp = WSP(s_local=1, clock_distance=0)  # s_global = 2, first bounded minibatch = 4
    ok = MinibatchRecord(vw=0, minibatch=4, wave_size=2, start_tick=0, global_waves=(1, 1), local_done=2)
    assert check_sglobal_bound([ok], wsp) == [] and check_slocal_bound([ok], wsp) == []
    stale = MinibatchRecord(vw=0, minibatch=6, wave_size=2, start_tick=0, global_waves=(1, 1), local_done=4)
    (v,) = check_sglobal_bound([stale], wsp)
    assert (v.vw, v.minibatch, v.kind, v.missing) == (0, 6, "global", ((1, 1),))
    slow_local = MinibatchRecord(
        vw=1, minibatch=5, wave_size=2, start_tick=0, global_waves=(2, 1), local_done=2
    )
    (lv,) = check_slocal_bound([slow_local], wsp)
    assert (lv.vw, lv.kind, lv.missing) == (1, "local", ((1, 1),))
    with pytest.raises(ValueError, match="wave_size"):
        check_sglobal_bound([ok], WSP(s_local=2, clock_distance=0))


def test_single_vw_and_determinism() -> None:
    wsp = WSP(s_local=2, clock_distance=1)
    vws = [VWTiming(period_ticks=2, latency_ticks=5, jitter_ticks=2)] * 3
    a = simulate_wsp(wsp, vws, num_waves=5, seed=4)
    assert a == simulate_wsp(wsp, vws, num_waves=5, seed=4)
    solo = simulate_wsp(wsp, vws[:1], num_waves=3)
    assert [u for _, _, u in solo.pushes] == [0, 1, 2] and not solo.deadlocked


def test_a_gate_that_never_opens_is_reported_as_deadlock() -> None:
    def never(model: ConsistencyModel, table: ClockTable, worker_id: int, clock: int) -> bool:
        return table.c_global >= clock + 1

    trace = simulate_wsp(EXAMPLE, [_pipeline(1), _pipeline(2)], num_waves=3, gate=never)
    assert trace.deadlocked
    assert max(r.minibatch for r in trace.records) == 7  # 8 waits for the pull of clock 1


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="period_ticks"):
        VWTiming(period_ticks=0, latency_ticks=1)
    with pytest.raises(ValueError, match="jitter_ticks"):
        VWTiming(period_ticks=1, latency_ticks=1, jitter_ticks=-1)
    with pytest.raises(ValueError, match="num_waves"):
        simulate_wsp(EXAMPLE, [_pipeline(1)], num_waves=0)
    with pytest.raises(ValueError, match="wsp"):
        simulate_wsp(SSP(staleness=1), [_pipeline(1)], num_waves=1)  # type: ignore[arg-type]
