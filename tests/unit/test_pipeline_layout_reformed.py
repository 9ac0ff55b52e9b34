"""An instance formed again on other processes (``pipeline/layout.py``: ``Layout.reformed``,
``trainer/pipeline_job.StageJob.reformed``): its new processes are numbered after every existing
one, the other instances' numbers never change, the old processes are retired but keep their
place, and the job carries it all through JSON to a stage process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.pipeline.layout import Layout, device_of, process_name
from flotilla.trainer.pipeline_job import StageJob


def test_a_reformed_instance_takes_new_numbers_and_retires_its_old_ones() -> None:
    layout = Layout((2, 3)).reformed(0, 1)
    assert layout.counts == (1, 3) and layout.num_processes == 6
    assert list(layout.processes(0)) == [5] and list(layout.processes(1)) == [2, 3, 4]
    assert [layout.current(g) for g in range(6)] == [False, False, True, True, True, True]
    assert layout.instance_of(1) == 0 and layout.place(1).stage == 1  # (a retired one keeps its place)
    assert layout.describe(0, "abcdef") == "a (stage 0 of instance 0, retired)"
    again = layout.reformed(0, 2)
    assert list(again.processes(0)) == [6, 7] and again.counts == (2, 3) and not again.current(5)
    assert Layout(again.counts, again.places) == again
    with pytest.raises(ConfigError, match="cannot form instance 2 again"):
        layout.reformed(2, 1)
    with pytest.raises(ConfigError, match="number instance 0's 2 stage"):
        Layout((2, 3), ((0, 0), (1, 0), (1, 1), (1, 2), (0, 1)))
    with pytest.raises(ConfigError, match="must name instances 0..1"):
        Layout((1, 1), ((0, 0), (1, 0), (2, 0)))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    moves=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), max_size=6),
)
def test_every_current_process_belongs_to_one_instance_and_numbers_never_move(
    counts: list[int], moves: list[tuple[int, int]]
) -> None:
    layout = Layout(tuple(counts))
    for instance, count in moves:
        instance %= layout.num_instances
        before = {r: list(layout.processes(r)) for r in range(layout.num_instances) if r != instance}
        layout = layout.reformed(instance, count)
        assert {r: list(layout.processes(r)) for r in before} == before
        assert list(layout.processes(instance)) == list(
            range(layout.num_processes - count, layout.num_processes)
        )
    current = [g for r in range(layout.num_instances) for g in layout.processes(r)]
    assert len(current) == len(set(current)) == sum(layout.counts)
    assert sorted(current) == [g for g in range(layout.num_processes) if layout.current(g)]
    for r in range(layout.num_instances):
        assert [layout.place(g).stage for g in layout.processes(r)] == list(range(layout.counts[r]))
        assert all(layout.instance_of(g) == r for g in layout.processes(r))


def _job(tmp_path: Path) -> StageJob:
    return StageJob(
        config={},
        store_host="127.0.0.1",
        store_port=1,
        layer_ends=(3, 6),
        stage_names=("a0", "a1", "b0"),
        speeds=(1.0, 0.5, 0.8),
        total_steps=10,
        run_dir=tmp_path,
        replicas=2,
        instance_ends=((3, 6), (6,)),
    )


def test_a_job_with_a_reformed_instance_survives_json_and_names_its_new_processes(tmp_path: Path) -> None:
    job = _job(tmp_path).reformed(0, ("a1", "c0"), (0.5, 0.25), (2, 6))
    assert job.stage_names == ("a0", "a1", "b0", "a1~3", "c0~4") and job.speeds[3:] == (0.5, 0.25)
    assert job.names_of(0) == ("a1~3", "c0~4") and job.names_of(1) == ("b0",)
    assert job.ends_of(0) == (2, 6) and job.layer_ends == (2, 6) and job.num_processes == 5
    assert [device_of(n) for n in job.stage_names] == ["a0", "a1", "b0", "a1", "c0"]
    assert process_name("a1", 3) == "a1~3" and device_of("a1") == "a1"
    back = StageJob.from_json(job.to_json())
    assert back == job and back.layout.place(4).stage == 1 and not back.layout.current(1)
    with pytest.raises(ConfigError, match="one device and speed per stage"):
        job.reformed(1, ("x",), (1.0,), (3, 6))


def test_places_that_do_not_fit_the_splits_are_refused(tmp_path: Path) -> None:
    raw = _job(tmp_path).reformed(1, ("c0",), (0.25,), (6,)).to_dict()
    raw["process_places"] = [[0, 0], [1, 0], [1, 0], [0, 1]]
    with pytest.raises(ConfigError, match="number instance 0's 2 stage"):
        StageJob.from_json(json.dumps(raw))
