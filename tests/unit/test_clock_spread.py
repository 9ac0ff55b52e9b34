"""ClockSpread: the exact spread of the workers' clocks at common instants, whatever order the
heartbeats bring the records in (compared with a sweep over all records at once)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.report.clock_spread import ClockSpread


def reference_max_spread(records: dict[str, list[tuple[float, int]]], dead: set[str]) -> int:
    """All records at once, in time order; a dead worker counts up to its last record only."""
    last_t = {n: rs[-1][0] for n, rs in records.items() if rs}
    times = sorted({t for rs in records.values() for t, _ in rs})
    best = 0
    for t in times:
        clocks = []
        for name, rs in records.items():
            seen = [c for tt, c in rs if tt <= t]
            if seen and not (name in dead and last_t[name] < t):
                clocks.append(seen[-1])
        if clocks:
            best = max(best, max(clocks) - min(clocks))
    return best


@st.composite
def runs(draw):
    n = draw(st.integers(1, 4))
    records: dict[str, list[tuple[float, int]]] = {}
    for i in range(n):
        # a worker's records have increasing times (its clock); workers may share instants
        times = sorted(draw(st.lists(st.integers(0, 40), min_size=0, max_size=12, unique=True)))
        clocks = sorted(draw(st.lists(st.integers(0, 30), min_size=len(times), max_size=len(times))))
        records[f"w{i}"] = [(float(t), c) for t, c in zip(times, clocks)]
    dead = {name for name in records if draw(st.booleans())}
    # arrival order: per worker in order, interleaved at random, batched like heartbeats
    queues = {name: list(rs) + [("close", None)] for name, rs in records.items()}
    order = []
    while any(queues.values()):
        name = draw(st.sampled_from(sorted(n for n, q in queues.items() if q)))
        take = draw(st.integers(1, 3))
        for _ in range(take):
            if queues[name]:
                order.append((name, queues[name].pop(0)))
        if draw(st.booleans()):  # the display reads the figures (sweeps)
            order.append((None, ("read", None)))
    return records, dead, order


@settings(max_examples=300, deadline=None)
@given(runs())
def test_max_spread_equals_a_sweep_over_all_records(run) -> None:
    records, dead, order = run
    cs = ClockSpread()
    for name in records:  # they joined
        cs.expect(name)
    for name, (t, clock) in order:
        if t == "read":
            assert 0 <= cs.spread <= cs.max_spread <= 30
        elif t == "close":
            cs.close(name, keep=name not in dead)
        else:
            cs.add(name, t, clock)
    assert cs.max_spread == reference_max_spread(records, dead)
    kept = {n: rs[-1][1] for n, rs in records.items() if rs and n not in dead}
    assert cs.clocks == kept


def test_latest_clocks_overstate_the_spread_when_reports_lag() -> None:
    """Worker b's records arrive a batch late: its latest clock is old, but at every instant
    the two clocks were at most 1 apart."""
    cs = ClockSpread()
    cs.expect("a"), cs.expect("b")
    for i in range(10):
        cs.add("a", float(i), i)
    cs.add("b", 0.0, 0)
    naive = 9 - 0
    assert cs.spread == 0 and cs.swept_t == 0.0  # nothing after b's latest record is swept
    for i in range(1, 10):
        cs.add("b", float(i) + 0.5, i)
    assert naive == 9 and cs.max_spread == 1 and cs.spread == 1


def test_a_late_first_record_is_not_swept_past() -> None:
    """Without ``expect``, a worker whose first heartbeat comes late is unknown meanwhile and the
    others' records are swept without it; ``expect`` (at join) holds the sweep back."""
    late, expected = ClockSpread(), ClockSpread()
    expected.expect("a"), expected.expect("b")
    for cs in (late, expected):
        for i in range(5):
            cs.add("a", float(i), i)
        assert cs.spread == 0  # the display reads it before b's heartbeat
        for i in range(5):  # b's heartbeat brings the same clocks later
            cs.add("b", float(i), i)
    assert late.max_spread == 4 and expected.max_spread == 0


def test_a_worker_that_stops_reporting_holds_the_watermark_until_closed() -> None:
    cs = ClockSpread()
    cs.add("a", 0.0, 0), cs.add("b", 0.0, 0)
    for i in range(1, 6):
        cs.add("a", float(i), i)
    assert cs.swept_t == 0.0
    cs.close("b", keep=False)  # it died: dropped, never compared later
    assert cs.max_spread == 0 and cs.clocks == {"a": 5} and cs.swept_t == 5.0
    cs.add("b", 9.0, 9)  # a closed worker's late record is ignored
    assert "b" not in cs.clocks


def test_a_finished_worker_keeps_counting() -> None:
    cs = ClockSpread()
    cs.add("fast", 0.0, 4), cs.add("slow", 0.0, 1)
    cs.close("fast", keep=True)
    cs.add("slow", 1.0, 2), cs.add("slow", 2.0, 4)
    assert cs.max_spread == 3 and cs.spread == 0 and cs.clocks == {"fast": 4, "slow": 4}


@pytest.mark.parametrize("bad", [(float("nan"), 1), (1.0, 1.5), ("1", 1), (1.0, True)])
def test_malformed_records_are_refused_and_change_nothing(bad) -> None:
    cs = ClockSpread()
    cs.add("a", 0.0, 0)
    with pytest.raises(ValueError, match="clock record"):
        cs.add("a", *bad)
    assert cs.clocks == {"a": 0} and cs.max_spread == 0


def test_out_of_order_record_of_one_worker_is_ignored() -> None:
    cs = ClockSpread()
    cs.add("a", 2.0, 5)
    cs.add("a", 1.0, 9)
    cs.close("a", keep=True)
    assert cs.clocks == {"a": 5}


def test_a_record_shipped_after_leaving_counts_if_not_yet_swept_past() -> None:
    cs = ClockSpread()
    cs.expect("a"), cs.expect("b")
    cs.add("a", 1.0, 1), cs.add("b", 1.0, 1)
    cs.close("a", keep=True)  # "leave" arrived before a's last heartbeat
    cs.add("a", 2.0, 2)  # later than anything swept: counts
    cs.add("b", 3.0, 2)
    assert cs.swept_t == 3.0  # (the display read the figures)
    cs.add("a", 2.5, 3)
    assert cs.clocks == {"a": 2, "b": 2}  # 2.5 < swept 3.0: that instant has passed
    assert cs.max_spread == 1


def test_past_max_pending_the_sweep_goes_past_a_silent_worker() -> None:
    cs = ClockSpread(max_pending=50)
    cs.expect("silent"), cs.expect("a")
    cs.add("silent", 0.0, 0)
    for i in range(1, 100):
        cs.add("a", float(i), i)
    assert cs.forced >= 1 and cs._pending <= 50  # memory stays bounded
    assert cs.max_spread >= 50  # the silent worker compared at its clock 0


def test_the_lazy_heaps_track_min_and_max_through_drops() -> None:
    cs = ClockSpread()
    for name in "abc":
        cs.expect(name)
    cs.add("a", 1.0, 5), cs.add("b", 1.0, 1), cs.add("c", 1.0, 3)
    assert cs.spread == 4
    cs.close("b", keep=False)  # the minimum dies
    assert cs.spread == 2 and cs.clocks == {"a": 5, "c": 3}
    cs.close("a", keep=False)  # then the maximum
    assert cs.spread == 0 and cs.clocks == {"c": 3}


def test_heaps_stay_bounded_over_long_runs() -> None:
    cs = ClockSpread(max_pending=100)
    for name in ("a", "b", "silent"):
        cs.expect(name)
    cs.add("silent", 0.0, 0)
    for i in range(1, 5000):
        cs.add("a", float(i), i), cs.add("b", i + 0.5, i)
        if i % 10 == 0:
            assert cs.spread >= 0  # the display reads (sweeps)
    # stale entries are dropped: the heaps hold O(workers) entries, not one per record
    assert max(len(cs._low), len(cs._high), len(cs._open_latest)) <= 2 * 3 + 64 + 1
    # the records the cap lets wait (at most 100) are not swept yet: the silent worker holds them
    assert 4999 - 100 <= cs.clocks["a"] <= 4999 and cs.clocks["silent"] == 0
    assert cs.max_spread == cs.clocks["a"] and cs.forced > 0


def test_forced_counts_only_sweeps_past_a_silent_worker() -> None:
    cs = ClockSpread(max_pending=20)
    cs.expect("a"), cs.expect("b")
    for i in range(200):  # nobody reads: the cap forces sweeps
        cs.add("a", float(i), i), cs.add("b", i + 0.5, i)
    assert cs.forced == 0 and cs.max_spread == 1  # both report: no one was gone past
