"""Pure stash decisions (flotilla.pipeline.stash_plan) and the event-driven dry-run against a naive
round-robin reference (flotilla.pipeline.timeline on flotilla.core.events)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.pipeline.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    format_action,
    gpipe,
    one_f_one_b,
    pipedream,
)
from flotilla.pipeline.stash_plan import peak_in_flight, peak_weight_versions, plan_stash
from flotilla.pipeline.timeline import ScheduleError, Timeline, TimelineEntry, dry_run, message_key
from flotilla.pipeline.validate import analyze


def test_stash_plan_loads_no_torch() -> None:
    code = "import sys, flotilla.pipeline.stash_plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_peaks_of_textbook_schedules() -> None:
    # 1F1B holds at most p - i microbatches; PipeDream stage i keeps p - i versions (weight stashing).
    assert [peak_in_flight(s) for s in one_f_one_b(3, 6).stages] == [3, 2, 1]
    assert [peak_in_flight(s) for s in gpipe(3, 6).stages] == [6, 6, 6]
    assert [peak_weight_versions(s) for s in gpipe(3, 6).stages] == [1, 1, 1]
    assert [peak_weight_versions(s) for s in pipedream(3, 8).stages] == [3, 2, 1]
    assert peak_in_flight(()) == 0 and peak_weight_versions(()) == 1


def test_last_use_marks_when_a_version_may_be_dropped() -> None:
    actions = pipedream(2, 3).stages[0]
    plan = plan_stash(actions)
    for version, idx in plan.last_use.items():
        assert plan.is_last_use(version, idx)
        assert not plan.needed_after(version, idx) and plan.needed_after(version, idx - 1)
        assert all(
            getattr(a, "weight_version", None) != version
            for a in actions[idx + 1 :]
            if isinstance(a, (Forward, Backward))
        )
    assert not plan.needed_after(99, 0) and not plan.is_last_use(99, 0)


def test_a_backward_without_forward_is_refused() -> None:
    with pytest.raises(ValueError, match="Backward of microbatch 4 at action 0 has no forward"):
        plan_stash((Backward(4, 0),))


@given(p=st.integers(1, 5), n=st.integers(1, 8), vsync=st.booleans())
def test_analyze_and_the_runtime_share_one_peak_in_flight(p: int, n: int, vsync: bool) -> None:
    schedule = pipedream(p, n, vertical_sync=vsync)
    stats = analyze(schedule)
    assert stats.peak_in_flight == tuple(peak_in_flight(s) for s in schedule.stages)
    assert stats.peak_weight_versions == tuple(peak_weight_versions(s) for s in schedule.stages)
    plans = [plan_stash(s) for s in schedule.stages]
    if not vsync:
        assert not plans[-1].stashed  # the last stage runs F b, B b, update: no stash
    for i, plan in enumerate(plans):  # a stashed pass means two versions alive at once
        assert stats.peak_weight_versions[i] >= (2 if plan.stashed else 1)


# ----------------------------------------------------------------- dry-run vs naive reference


def _reference_dry_run(schedule: Schedule, durations: dict[tuple[int, Action], float]) -> Timeline:
    """The original round-robin replay: sweep the stages until none can move."""
    p = schedule.num_stages
    pcs, clock = [0] * p, [0.0] * p
    link_free: dict[tuple[int, int], float] = {}
    arrivals: dict[tuple[str, int, int, int], deque[float]] = {}
    entries: Timeline = []
    progress = True
    while progress:
        progress = False
        for i, stage in enumerate(schedule.stages):
            while pcs[i] < len(stage):
                a, d = stage[pcs[i]], durations.get((i, stage[pcs[i]]), 0.0)
                if isinstance(a, (RecvAct, RecvGrad)):
                    queue = arrivals.get(message_key(i, a))
                    if not queue:
                        break
                    end = max(clock[i], queue.popleft())
                    entries.append(TimelineEntry(i, a, clock[i], end))
                    clock[i] = end
                elif isinstance(a, (SendAct, SendGrad)):
                    start = max(clock[i], link_free.get((i, a.peer_stage), 0.0))
                    link_free[(i, a.peer_stage)] = start + d
                    arrivals.setdefault(message_key(i, a), deque()).append(start + d)
                    entries.append(TimelineEntry(i, a, start, start + d))
                else:
                    entries.append(TimelineEntry(i, a, clock[i], clock[i] + d))
                    clock[i] += d
                pcs[i] += 1
                progress = True
    blocked = [i for i in range(p) if pcs[i] < len(schedule.stages[i])]
    if blocked:
        waits = ", ".join(
            f"stage {i} at action {pcs[i]} ({format_action(schedule.stages[i][pcs[i]])})" for i in blocked
        )
        raise ScheduleError(f"deadlock: no stage can proceed; blocked: {waits}")
    return sorted(entries, key=lambda e: (e.start_s, e.stage_idx, e.end_s))


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[Schedule, dict[tuple[int, Action], float]]:
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["gpipe", "1f1b", "pipedream"]))
    base = {"gpipe": gpipe, "1f1b": one_f_one_b, "pipedream": pipedream}[kind](p, m)
    stages = [list(s) for s in base.stages]
    for _ in range(draw(st.integers(0, 2))):  # swaps may create deadlocks: both must report them
        i = draw(st.integers(0, p - 1))
        a, b = draw(st.integers(0, len(stages[i]) - 1)), draw(st.integers(0, len(stages[i]) - 1))
        stages[i][a], stages[i][b] = stages[i][b], stages[i][a]
    schedule = dataclasses.replace(base, stages=tuple(tuple(s) for s in stages))
    times = st.sampled_from([0.0, 0.25, 1.0, 1.5, 3.0])
    durations = {
        (i, a): draw(times) for i, s in enumerate(stages) for a in s if not isinstance(a, OptimizerStep)
    }
    return schedule, durations


@settings(max_examples=60, deadline=None)
@given(case=_schedules())
def test_event_driven_dry_run_equals_the_round_robin_reference(
    case: tuple[Schedule, dict[tuple[int, Action], float]],
) -> None:
    schedule, durations = case
    try:
        expected: Timeline | str = _reference_dry_run(schedule, durations)
    except ScheduleError as exc:
        expected = str(exc)
    try:
        got: Timeline | str = dry_run(schedule, lambda i, a: durations.get((i, a), 0.0))
    except ScheduleError as exc:
        got = str(exc)
    assert got == expected
