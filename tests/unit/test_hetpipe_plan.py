"""A HetPipe stage's wave arithmetic (``sync/hetpipe_plan.py``) and PipeDream's schedule with a
chosen number of minibatches in flight (``pipeline/schedule.pipedream(in_flight=N)``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import Forward, OptimizerStep, pipedream, pipedream_warmup
from flotilla.pipeline.validate import analyze
from flotilla.ps.wsp import MinibatchRecord
from flotilla.sync.hetpipe_plan import WavePlan, WaveView


def test_waves_end_every_w_minibatches_and_at_the_last_one() -> None:
    plan = WavePlan(s_local=2, num_minibatches=10)
    assert plan.wave_size == 3 and plan.num_waves == 4
    assert [m for m in range(10) if plan.ends_wave(m) is not None] == [2, 5, 8, 9]
    assert [plan.ends_wave(m) for m in (2, 5, 8, 9)] == [0, 1, 2, 3]


def test_the_last_minibatch_of_a_full_wave_waits_for_the_pull_of_the_wave_before() -> None:
    plan = WavePlan(s_local=3, num_minibatches=16)  # the paper's example: W = 4
    needs = {b + 1: plan.needed_clock(b) for b in range(16) if plan.needed_clock(b)}
    assert needs == {8: 1, 12: 2, 16: 3}  # minibatch 12 waits for clock 2: wave 1 (up to 8)


@pytest.mark.parametrize(
    "kwargs", [{"s_local": -1, "num_minibatches": 4}, {"s_local": 0, "num_minibatches": 0}]
)
def test_bad_plans_are_refused(kwargs) -> None:
    with pytest.raises(ConfigError):
        WavePlan(**kwargs)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 4), st.integers(1, 6), st.integers(1, 30))
def test_a_later_plan_is_the_tail_of_the_whole_plan(s_local: int, first_wave: int, n: int) -> None:
    """A VW coming back at wave j (sync/hetpipe_plan.py): its process's minibatch m is the VW's
    jW + m; it ends the same waves and waits for the same clocks as a VW that ran from the start."""
    w = s_local + 1
    whole = WavePlan(s_local=s_local, num_minibatches=first_wave * w + n)
    tail = WavePlan(s_local=s_local, num_minibatches=n, first_wave=first_wave)
    assert tail.first_minibatch == first_wave * w
    for m in range(n):
        assert tail.ends_wave(m) == whole.ends_wave(first_wave * w + m)
        assert tail.needed_clock(m) == whole.needed_clock(first_wave * w + m)
    # (its first wave's last minibatch waits for the clock of that wave: the pull it starts from)
    if n >= w:
        assert tail.needed_clock(w - 1) == first_wave


def test_a_plan_from_a_negative_wave_is_refused() -> None:
    with pytest.raises(ConfigError, match="first_wave"):
        WavePlan(s_local=1, num_minibatches=4, first_wave=-1)


def test_a_vw_coming_back_gets_a_new_worker_id_that_still_names_it() -> None:
    from flotilla.sync.hetpipe_stage import worker_id_of

    vws = 3
    ids = {(i, a): worker_id_of(i, a, vws) for i in range(vws) for a in range(12)}
    assert len(set(ids.values())) == len(ids)  # (a departed id never comes back)
    assert all(w % vws == i for (i, _a), w in ids.items()) and [ids[i, 0] for i in range(vws)] == [0, 1, 2]
    with pytest.raises(ValueError, match="arrival"):
        worker_id_of(0, -1, vws)


def test_a_view_records_own_waves_as_pulled_and_the_others_as_c_global() -> None:
    r = WaveView(vw=1, num_vws=3, pulled=2, c_global=1, local_done=9).record(10, 4)
    assert r == MinibatchRecord(
        vw=1, minibatch=11, wave_size=4, start_tick=0, global_waves=(1, 2, 1), local_done=9
    )
    assert r.local_updates == frozenset({9})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.integers(1, 14))
def test_pipedream_keeps_n_in_flight_on_stage_0_and_is_valid(stages: int, in_flight: int, n: int) -> None:
    """Stage 0's forward of minibatch b runs right after its update of b - N (local staleness
    N - 1), stage i keeps max(1, N - i) in flight, and the schedule passes the validator."""
    sched = pipedream(stages, n, in_flight=in_flight)
    report = analyze(sched)
    assert report.peak_in_flight == tuple(
        min(pipedream_warmup(stages, i, in_flight), n) for i in range(stages)
    )
    acts = sched.stages[0]
    for idx, a in enumerate(acts):
        if isinstance(a, Forward) and a.microbatch_idx >= in_flight:
            assert acts[idx - 1] == OptimizerStep(
                a.microbatch_idx - in_flight, a.microbatch_idx - in_flight + 1
            )
            assert a.weight_version == a.microbatch_idx - in_flight + 1


def test_pipedream_defaults_to_the_number_of_stages_and_refuses_a_bad_depth() -> None:
    assert pipedream(3, 6) == pipedream(3, 6, in_flight=3)
    with pytest.raises(ConfigError, match="in_flight"):
        pipedream(3, 6, in_flight=0)
