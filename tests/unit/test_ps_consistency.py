"""The PS clock table, the consistency gates and their guarantees (flotilla.ps.consistency)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.ps.consistency import (
    ASP,
    BSP,
    SSP,
    WSP,
    ClockError,
    ClockTable,
    allowed_lag,
    blocked_workers,
    may_serve_pull,
    reference_may_serve_pull,
    s_global,
    simulate,
    wake_set,
)

models = st.one_of(
    st.just(BSP()),
    st.just(ASP()),
    st.builds(SSP, staleness=st.integers(0, 4)),
    st.builds(WSP, s_local=st.integers(0, 4), clock_distance=st.integers(0, 4)),
)


def test_models_validate_fields() -> None:
    for call, field in [
        (lambda: SSP(staleness=-1), "staleness"),
        (lambda: SSP(staleness=True), "staleness"),
        (lambda: WSP(s_local=-1, clock_distance=0), "s_local"),
        (lambda: WSP(s_local=0, clock_distance=1.5), "clock_distance"),
    ]:
        with pytest.raises(ValueError, match=field) as info:
            call()
        assert isinstance(info.value, ConfigError)


def test_s_global_and_lags() -> None:
    assert s_global(WSP(s_local=3, clock_distance=0)) == 6  # SPEC §2 worked example
    assert s_global(WSP(s_local=0, clock_distance=2)) == 2  # s_local = 0 is SSP(D)
    assert s_global(WSP(s_local=2, clock_distance=1)) == 7
    assert [allowed_lag(m) for m in (BSP(), ASP(), SSP(staleness=3))] == [0, None, 3]


def test_clock_table_transitions_and_errors() -> None:
    t = ClockTable.start([2, 0, 1])
    assert t.worker_ids == (0, 1, 2) and t.c_global == 0
    t = t.advance(0, 0).advance(1, 0)
    assert t.as_dict() == {0: 1, 1: 1, 2: 0} and t.c_global == 0
    t = t.advance(2, 0)
    assert t.c_global == 1
    for clock, kind in [(0, "duplicate"), (5, "jump")]:
        with pytest.raises(ClockError, match=kind) as info:
            t.advance(0, clock)
        assert info.value.kind == kind
    t2 = t.advance(0, 1).advance(0, 2).advance(0, 3)
    with pytest.raises(ClockError, match="regression"):
        t2.advance(0, 1)
    with pytest.raises(ClockError) as info:
        t.advance(9, 0)
    assert info.value.kind == "unknown_worker"


def test_membership_keeps_c_global_monotone() -> None:
    t = ClockTable.start([0, 1]).advance(0, 0).advance(0, 1).advance(1, 0)
    assert t.c_global == 1
    joined = t.with_worker(7)
    assert joined.clock_of(7) == 1 and joined.c_global == 1
    with pytest.raises(ClockError, match="bad_join"):
        t.with_worker(8, clock=0)
    with pytest.raises(ClockError, match="bad_join"):
        t.with_worker(1)
    assert t.without_worker(1).c_global == 2  # the slow worker left
    empty = t.without_worker(0).without_worker(1)
    assert empty.worker_ids == () and empty.c_global == 1
    assert empty.with_worker(3).clock_of(3) == 1


ops = st.lists(st.tuples(st.sampled_from(["push", "join", "leave"]), st.integers(0, 5)), max_size=60)


@settings(deadline=None, max_examples=100)
@given(ops)
def test_c_global_never_decreases(op_list: list[tuple[str, int]]) -> None:
    t = ClockTable.start([0, 1, 2])
    for op, w in op_list:
        before = t.c_global
        if op == "push" and w in t.worker_ids:
            t = t.advance(w, t.clock_of(w))
        elif op == "join" and w not in t.worker_ids:
            t = t.with_worker(w, clock=t.c_global + w % 2)
        elif op == "leave" and w in t.worker_ids:
            t = t.without_worker(w)
        assert t.c_global >= before
        assert t.c_global == min(t.as_dict().values(), default=t.floor)


@settings(deadline=None, max_examples=150)
@given(models, st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 10))
def test_gate_matches_naive_oracle(model, pushed_counts: list[int], clock: int) -> None:
    t = ClockTable.start(range(len(pushed_counts)))
    pushes = set()
    for w, n in enumerate(pushed_counts):
        for k in range(n):
            t = t.advance(w, k)
            pushes.add((w, k))
    workers = range(len(pushed_counts))
    expected = reference_may_serve_pull(model, pushes, workers, clock)
    assert may_serve_pull(model, t, 0, clock) == expected
    pending = [(w, clock) for w in workers]
    woken = wake_set(model, t, pending)
    assert (len(woken) == len(pending)) == expected
    assert blocked_workers(model, t, pending) == (frozenset() if expected else frozenset(workers))


def test_gate_examples() -> None:
    t = ClockTable.start([0, 1]).advance(0, 0).advance(0, 1).advance(0, 2)  # clocks {0: 3, 1: 0}
    assert may_serve_pull(BSP(), t, 1, 0) and not may_serve_pull(BSP(), t, 0, 3)
    assert may_serve_pull(ASP(), t, 0, 3)
    assert not may_serve_pull(SSP(staleness=2), t, 0, 3)
    assert may_serve_pull(SSP(staleness=3), t, 0, 3)
    assert may_serve_pull(WSP(s_local=5, clock_distance=3), t, 0, 3)
    assert not may_serve_pull(WSP(s_local=5, clock_distance=2), t, 0, 3)
    assert wake_set(BSP(), t, [(1, 0), (0, 3)]) == ((1, 0),)
    assert blocked_workers(BSP(), t, [(1, 0), (0, 3)]) == frozenset({0})
    with pytest.raises(ClockError, match="unknown_worker"):
        may_serve_pull(ASP(), t, 5, 0)


@settings(deadline=None, max_examples=120)
@given(
    models,
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
    st.integers(0, 8),
    st.integers(0, 2**16),
)
def test_simulated_pulls_respect_the_model(model, speeds: list[int], num_clocks: int, seed: int) -> None:
    trace = simulate(model, speeds, num_clocks, seed)
    workers = range(len(speeds))
    assert trace.finished  # no deadlock, for every model
    assert trace.final_table.as_dict() == {w: num_clocks for w in workers}
    for w in workers:
        assert [p.clock for p in trace.pulls if p.worker_id == w] == list(range(num_clocks))
    lag = allowed_lag(model)
    for p in trace.pulls:
        if lag is None:  # ASP never blocks
            assert p.served_tick == p.issued_tick
            continue
        # SSP guarantee (BSP: lag 0, WSP: lag D): every update of clocks < c - lag is visible
        assert {(w, k) for w in workers for k in range(p.clock - lag)} <= p.seen
        # ... and no worker ran more than lag clocks ahead of the puller
        assert all(k <= p.clock + lag for _, k in p.seen)
        # the gate is not stricter than the SPEC: a pull waits only if the oracle says so
        blocked_at_issue = not reference_may_serve_pull(model, p.seen_at_issue, workers, p.clock)
        assert (p.served_tick > p.issued_tick) <= blocked_at_issue
        assert reference_may_serve_pull(model, p.seen, workers, p.clock)


def test_bsp_pull_sees_exactly_the_previous_clock_and_blocks() -> None:
    trace = simulate(BSP(), [1, 5], 4, rng_seed=3)
    fast = [p for p in trace.pulls if p.worker_id == 0]
    assert [max((k for w, k in p.seen if w == 1), default=-1) for p in fast] == [-1, 0, 1, 2]
    assert any(p.served_tick > p.issued_tick for p in fast)  # the fast worker waited


def test_simulate_is_deterministic_and_seed_dependent() -> None:
    a = simulate(SSP(staleness=1), [1, 2, 3], 6, rng_seed=11)
    assert a == simulate(SSP(staleness=1), [1, 2, 3], 6, rng_seed=11)
    assert any(simulate(SSP(staleness=1), [1, 2, 3], 6, rng_seed=s).pulls != a.pulls for s in range(5))
    assert simulate(BSP(), [1, 1], 0).pulls == ()
    with pytest.raises(ValueError, match="speeds"):
        simulate(BSP(), [0], 2)
