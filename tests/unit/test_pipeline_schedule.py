"""Schedule IR, generators, validator and dry-run (flotilla.pipeline.schedule / validate / timeline).

Golden files live in tests/unit/golden/pipeline/.  After an intended change of a generator,
regenerate them with:  FLOTILLA_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_pipeline_schedule.py
and review the diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import (
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    Schedule,
    ScheduleKind,
    SendAct,
    format_action,
    gpipe,
    make_schedule,
    one_f_one_b,
    parse_action,
    pipedream,
)
from flotilla.pipeline.validate import (
    ScheduleError,
    analyze,
    bubble_fraction,
    check,
    dry_run,
    makespan_s,
    modelled_timeline,
    validate,
)

GOLDEN = Path(__file__).parent / "golden" / "pipeline"
GENERATORS = {
    "gpipe": lambda p, m: gpipe(p, m),
    "1f1b": lambda p, m: one_f_one_b(p, m),
    "pipedream": lambda p, m: pipedream(p, m, vertical_sync=False),
    "pipedream_vsync": lambda p, m: pipedream(p, m, vertical_sync=True),
}


def _golden_payload(schedule: Schedule) -> dict:
    stats = analyze(schedule)
    timeline = dry_run(schedule)
    return {
        "schedule": schedule.to_dict(),
        "peak_in_flight": list(stats.peak_in_flight),
        "peak_weight_versions": list(stats.peak_weight_versions),
        "unit_makespan": makespan_s(timeline),
    }


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6)])
def test_golden(name: str, p: int, m: int) -> None:
    schedule = GENERATORS[name](p, m)
    payload = _golden_payload(schedule)
    path = GOLDEN / f"{name}_p{p}_m{m}.json"
    if os.environ.get("FLOTILLA_REGEN_GOLDEN") == "1":
        atomic_write_json(path, payload)
    expected = json.loads(path.read_text())
    assert payload == expected
    assert Schedule.from_dict(expected["schedule"]) == schedule
    assert validate(schedule) == []


def test_1f1b_p2_m4_exact_order() -> None:
    s = one_f_one_b(2, 4)
    assert [format_action(a) for a in s.stages[0]] == [
        "F0@v0",
        "SA0>1",
        "F1@v0",
        "SA1>1",
        "RG0<1",
        "B0@v0",
        "F2@v0",
        "SA2>1",
        "RG1<1",
        "B1@v0",
        "F3@v0",
        "SA3>1",
        "RG2<1",
        "B2@v0",
        "RG3<1",
        "B3@v0",
        "OPT0>1",
    ]


def test_pipedream_stashing_and_vertical_sync_versions() -> None:
    s = pipedream(3, 6)
    stage0 = [a for a in s.stages[0] if isinstance(a, (Forward, Backward))]
    # stage 0 runs 3 warm-up forwards on v0; F3 runs on v1 after B0's update; B3 reuses v1 (stash).
    assert Forward(3, 1) in stage0 and Backward(3, 1) in stage0 and Backward(1, 0) in stage0
    vs = pipedream(3, 6, vertical_sync=True)
    for b in range(6):
        versions = {
            a.weight_version
            for st_ in vs.stages
            for a in st_
            if isinstance(a, (Forward, Backward)) and a.microbatch_idx == b
        }
        assert versions == {max(0, b - 2)}


sizes = st.tuples(st.integers(1, 5), st.integers(1, 8), st.integers(1, 3))


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_generated_schedules_are_valid_with_bounds(size: tuple[int, int, int]) -> None:
    p, m, n = size
    for schedule in (gpipe(p, m, n), one_f_one_b(p, m, n)):
        assert validate(schedule) == []
        stats = analyze(schedule)
        assert stats.peak_weight_versions == (1,) * p
        if schedule.kind is ScheduleKind.GPIPE:
            assert stats.peak_in_flight == (m,) * p
        else:
            assert stats.peak_in_flight == tuple(min(p - i, m) for i in range(p))
    for vertical_sync in (False, True):
        schedule = pipedream(p, m * n, vertical_sync)
        assert validate(schedule) == []
        stats = analyze(schedule)
        assert stats.peak_in_flight == tuple(min(p - i, m * n) for i in range(p))
        versions = stats.peak_weight_versions
        if not vertical_sync:  # stage i holds p - i versions once the pipeline is full
            assert all(v <= p - i for i, v in enumerate(versions))
            if m * n >= 2 * p:
                assert versions == tuple(p - i for i in range(p))
        else:  # every stage must keep the versions stage 0 tagged in-flight minibatches with
            assert max(versions) <= p
            if m * n >= 2 * p:
                assert versions == (p,) * p


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.integers(1, 3))
def test_bubble_fraction_unit_times(p: int, m: int, n: int) -> None:
    for schedule in (gpipe(p, m, n), one_f_one_b(p, m, n)):
        timeline = dry_run(schedule)
        assert bubble_fraction(timeline, p) == pytest.approx((p - 1) / (m + p - 1))
        assert makespan_s(timeline) == pytest.approx(n * 2 * (m + p - 1))


def test_modelled_timeline_with_comm() -> None:
    timeline = modelled_timeline(
        gpipe(2, 1), forward_s=1.0, backward_s=[2.0, 3.0], comm_s=0.5, optimizer_s=0.25
    )
    by_action = {(e.stage_idx, format_action(e.action)): (e.start_s, e.end_s) for e in timeline}
    assert by_action[(0, "F0@v0")] == (0.0, 1.0)
    assert by_action[(0, "SA0>1")] == (1.0, 1.5)
    assert by_action[(1, "RA0<0")] == (0.0, 1.5)  # stage 1 waits for the activation
    assert by_action[(1, "F0@v0")] == (1.5, 2.5)
    assert by_action[(1, "B0@v0")] == (2.5, 5.5)
    assert by_action[(1, "SG0>0")] == (5.5, 6.0)
    assert by_action[(0, "B0@v0")] == (6.0, 8.0)
    assert by_action[(0, "OPT0>1")] == (8.0, 8.25)
    assert makespan_s(timeline) == 8.25
    assert len(timeline) == sum(len(s) for s in gpipe(2, 1).stages)


def test_link_serialises_transfers() -> None:
    timeline = modelled_timeline(gpipe(2, 2), forward_s=1.0, backward_s=1.0, comm_s=3.0)
    sends = [(e.start_s, e.end_s) for e in timeline if isinstance(e.action, SendAct)]
    assert sends == [(1.0, 4.0), (4.0, 7.0)]  # the second activation waits for the link


def _replace(schedule: Schedule, stage: int, actions: list) -> Schedule:
    stages = list(schedule.stages)
    stages[stage] = tuple(actions)
    return dataclasses.replace(schedule, stages=tuple(stages))


def _codes(schedule: Schedule) -> set[str]:
    return {p.code for p in validate(schedule)}


def test_missing_recv_is_caught() -> None:
    s = gpipe(2, 2)
    broken = _replace(s, 1, [a for a in s.stages[1] if a != RecvAct(1, 0)])
    assert {"unmatched", "dataflow"} <= _codes(broken)
    problem = next(p for p in validate(broken) if p.code == "unmatched")
    assert problem.stage_idx == 0 and "act" in problem.message


def test_deadlock_order_is_caught() -> None:
    s = one_f_one_b(2, 2)
    actions = list(s.stages[0])
    actions.remove(RecvGrad(0, 1))
    actions.insert(0, RecvGrad(0, 1))  # stage 0 waits for a gradient before sending anything
    broken = _replace(s, 0, actions)
    assert "deadlock" in _codes(broken)
    with pytest.raises(ScheduleError, match="deadlock.*stage 0 at action 0 \\(RG0<1\\)"):
        dry_run(broken)
    with pytest.raises(ScheduleError, match="invalid schedule"):
        check(broken)


def test_wrong_stash_version_is_caught() -> None:
    s = pipedream(2, 4)
    actions = [Backward(1, 1) if a == Backward(1, 0) else a for a in s.stages[0]]
    problems = validate(_replace(s, 0, actions))
    assert [p.code for p in problems] == ["stash"]
    assert problems[0].stage_idx == 0 and "used version 0" in problems[0].message


def test_vertical_sync_violation_is_caught() -> None:
    s = pipedream(2, 4, vertical_sync=True)
    # stage 1 runs minibatch 3 on its newest version (3) instead of stage 0's tag (2), consistently.
    actions = [
        type(a)(3, 3) if isinstance(a, (Forward, Backward)) and a.microbatch_idx == 3 else a
        for a in s.stages[1]
    ]
    assert _codes(_replace(s, 1, actions)) == {"vertical_sync"}


def test_pipedream_forward_must_use_newest_without_vertical_sync() -> None:
    s = pipedream(2, 4)
    actions = [Forward(3, 1) if a == Forward(3, 2) else a for a in s.stages[0]]
    actions = [Backward(3, 1) if a == Backward(3, 2) else a for a in actions]
    assert _codes(_replace(s, 0, actions)) == {"newest"}


def test_missing_update_and_early_flush_are_caught() -> None:
    s = pipedream(2, 3)
    drop_first = list(s.stages[1])
    drop_first.remove(OptimizerStep(0, 1))
    assert "update" in _codes(_replace(s, 1, drop_first))
    g = gpipe(2, 2)
    early = list(g.stages[0])
    early.remove(OptimizerStep(0, 1))
    early.insert(early.index(Backward(0, 0)), OptimizerStep(0, 1))
    problems = [p for p in validate(_replace(g, 0, early)) if p.code == "flush"]
    assert problems and "after 1 of 2 backwards" in problems[0].message


def test_fifo_and_bad_peer_and_duplicate_pass() -> None:
    g = gpipe(2, 2)
    swapped = list(g.stages[1])
    a, b = swapped.index(RecvAct(0, 0)), swapped.index(RecvAct(1, 0))
    swapped[a], swapped[b] = swapped[b], swapped[a]
    assert "fifo" in _codes(_replace(g, 1, swapped))
    bad_peer = [SendAct(0, 0) if x == SendAct(0, 1) else x for x in g.stages[0]]
    assert _codes(_replace(g, 0, bad_peer)) == {"bad_index"}
    dup = list(g.stages[0]) + [Forward(0, 0)]
    assert "pass" in _codes(_replace(g, 0, dup))


def test_action_text_roundtrip_and_errors() -> None:
    for stage in pipedream(3, 4, True).stages + one_f_one_b(3, 4).stages:
        for action in stage:
            assert parse_action(format_action(action)) == action
    with pytest.raises(ConfigError, match="not a schedule action"):
        parse_action("X1")
    with pytest.raises(ConfigError, match="num_microbatches must be 1"):
        make_schedule(ScheduleKind.PIPEDREAM, 2, 4)
    with pytest.raises(ConfigError, match="num_stages"):
        gpipe(0, 4)
    with pytest.raises(ConfigError, match="vertical_sync"):
        dataclasses.replace(gpipe(2, 2), vertical_sync=True)
    assert make_schedule(ScheduleKind.ONE_F_ONE_B, 2, 3) == one_f_one_b(2, 3)
