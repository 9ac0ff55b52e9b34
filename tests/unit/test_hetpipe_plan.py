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
