"""Which stage process a stage worker runs (``pipeline/stage_claims.py``, pure)."""

from __future__ import annotations

import pytest

from flotilla.pipeline.layout import Layout
from flotilla.pipeline.stage_claims import ClaimRefused, StageClaims

NAMES = ["a0", "a1", "b0", "b1"]  # 2 stages x 2 instances


def claims() -> StageClaims:
    return StageClaims(NAMES, Layout.uniform(2, len(NAMES) // 2))


def test_a_worker_names_its_process_by_name_or_by_stage_and_instance():
    c = claims()
    assert [c.place_of(n, None, None) for n in NAMES] == [0, 1, 2, 3]
    assert c.place_of(None, 1, None) == 1  # (instance 0 by default)
    assert c.place_of(None, 0, 1) == 2 and c.place_of("b1", 1, 1) == 3


@pytest.mark.parametrize(
    ("name", "stage", "instance", "says"),
    [
        (
            "zz",
            None,
            None,
            "worker 'zz' is not a stage of this job: the stage processes are a0 (stage 0 of instance 0)",
        ),
        (None, 2, None, "stage index 2 is not in this job: its pipelines have 2 stage(s) (0..1)"),
        (None, 0, 2, "pipeline instance 2 is not in this job: it runs 2 instance(s) (0..1)"),
        (None, None, 1, "instance 1 given without a stage index"),
        ("a0", 1, 0, "worker 'a0' asked for stage 1 of instance 0, which is a1 (stage 1 of instance 0)"),
        (None, None, None, "a stage worker needs a name or a stage index"),
    ],
)
def test_an_unknown_or_inconsistent_process_is_refused_in_one_line(name, stage, instance, says):
    c = claims()
    with pytest.raises(ClaimRefused) as err:
        c.place_of(name, stage, instance)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert c.claims == {}  # (nothing changed)


def test_two_workers_cannot_claim_one_process_and_a_repeated_join_gets_the_same_claim():
    c = claims()
    first = c.claim(1, "tok-a", 100, "hostA", 5.0)
    assert c.claim(1, "tok-a", 100, "hostA", 6.0) == first  # (a join sent again: the same claim)
    with pytest.raises(
        ClaimRefused,
        match=r"a1 \(stage 1 of instance 0\) is already claimed by the worker with pid 100 on hostA",
    ):
        c.claim(1, "tok-b", 200, "hostB", 7.0)
    assert c.claims[1].token == "tok-a" and c.missing() == [0, 2, 3] and not c.all_claimed()


def test_only_the_holder_beats_and_a_silent_holder_is_found_by_the_times_fed_in():
    c = claims()
    c.claim(0, "t0", 1, "h", 0.0)
    c.claim(1, "t1", 2, "h", 0.0)
    assert c.beat(0, "t0", 8.0) and not c.beat(1, "intruder", 9.0)
    assert c.silent(now_s=11.0, timeout_s=10.0) == [1]  # (the intruder's beat did not count for 1)
    assert c.silent(now_s=11.0, timeout_s=10.0, done=[1]) == []
    assert c.silent(now_s=19.0, timeout_s=10.0) == [0, 1]


def test_processes_must_make_whole_pipelines():
    with pytest.raises(ValueError, match="3 stage processes for a layout of 4"):
        StageClaims(["a", "b", "c"], Layout.uniform(2, 2))


def test_instances_of_different_stage_counts_are_claimed_by_instance_and_stage():
    c = StageClaims(["x0", "x1", "y0", "y1", "y2"], Layout((2, 3)))
    assert c.place_of(None, 2, 1) == 4 and c.describe(4) == "y2 (stage 2 of instance 1)"
    assert c.place_of("y0", None, None) == 2
    with pytest.raises(ClaimRefused, match="instance 0 has 2 stage"):
        c.place_of(None, 2, 0)


def test_a_released_process_may_be_claimed_by_a_newcomer():
    c = claims()
    c.claim(3, "old", 1, "h", 0.0)
    c.release(3)
    assert c.missing() == [0, 1, 2, 3] and c.silent(now_s=100.0, timeout_s=1.0) == []
    assert c.claim(3, "new", 2, "h", 1.0).token == "new"
