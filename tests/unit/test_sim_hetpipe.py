"""HetPipe's virtual workers in virtual time (``sim/hetpipe.py``): the launcher's placement, the
servers' WSP gate driven event by event, evictions with the data views' split."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import flotilla.sim.hetpipe as sim_hetpipe
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.sim.hetpipe import HetPipeSpec, hetpipe_of, simulate_hetpipe
from flotilla.sim.hetpipe_place import place
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob

MIB = 2**20
# the character LM's layers (tests/unit/test_vw_placement.py's fixed profile): embedding, four
# transformer blocks, head, for 32 samples on a device of speed 1
_BLOCK = LayerProfile(name="b", forward_s=0.006, backward_s=0.009, activation_bytes=524288,
                      param_bytes=198912, saved_bytes=7913472)  # fmt: skip
PROFILE = ModelProfile(
    layers=(
        LayerProfile(name="0:emb", forward_s=0.0006, backward_s=0.0005, activation_bytes=524288,
                     param_bytes=40960, saved_bytes=0),
        *(replace(_BLOCK, name=f"{i}:block") for i in range(1, 5)),
        LayerProfile(name="5:head", forward_s=0.0014, backward_s=0.002, activation_bytes=786432,
                     param_bytes=24960, saved_bytes=1343492),
    ),
    batch_size=32,
    input_bytes=16384,
)  # fmt: skip
JOB = SimJob(steps=200, step_s=0.05, model_bytes=1_000_000, profile=PROFILE, global_batch=32)
# examples/hetpipe.yaml's cluster: two devices of each of four types, one node per type
MIXED = SimCluster(
    classes=(
        DeviceClass(type="V", count=2, speed=1.0, per_node=2, memory_bytes=64 * MIB),
        DeviceClass(type="R", count=2, speed=0.6, per_node=2, memory_bytes=64 * MIB),
        DeviceClass(type="G", count=2, speed=0.4, per_node=2, memory_bytes=3 * MIB),
        DeviceClass(type="Q", count=2, speed=0.25, per_node=2, memory_bytes=3 * MIB),
    )
)


def _note_waits(note: str) -> float:
    return float(note.split("gate waits ")[1].split(" s")[0])


def test_equal_virtual_workers_run_at_the_planners_wave() -> None:
    spec = HetPipeSpec(placement="ed", s_local=1)
    placement, _ = place(JOB, MIXED, spec, list(MIXED.devices()))
    assert placement.policy == "ed" and len(placement.vws) == 2
    vw = placement.vws[0]
    res = simulate_hetpipe(JOB, MIXED, spec)
    assert res.completed and res.steps == 200 and res.samples == 200 * 32
    waves, W = math.ceil(200 / 2), 2
    minibatch = vw.wave_compute_s / W
    expected = W * minibatch + (waves - 1) * vw.wave_s + vw.wave_sync_s / 2  # (module doc)
    assert res.time_s == pytest.approx(expected, rel=1e-9)
    # the steady pace is the planner's: throughput -> the placement's prediction
    assert 32 * 200 / res.time_s == pytest.approx(placement.throughput_samples_per_s, rel=0.02)
    assert res.timeline[-1][1] == 200 and "placement ed: 2 VW(s)" in res.note


def test_a_fast_vw_waits_at_the_gate_for_d_and_not_beyond() -> None:
    # two nodes, a fast and a slow one, each holding the model: np makes one VW per node
    two = SimCluster(
        classes=(
            DeviceClass(type="F", count=2, speed=1.0, per_node=2, memory_bytes=64 * MIB),
            DeviceClass(type="S", count=2, speed=0.5, per_node=2, memory_bytes=64 * MIB),
        )
    )
    tight = simulate_hetpipe(JOB, two, HetPipeSpec(placement="np", clock_distance=0))
    loose = simulate_hetpipe(JOB, two, HetPipeSpec(placement="np", clock_distance=1000))
    assert tight.completed and loose.completed
    assert _note_waits(tight.note) > 1 and _note_waits(loose.note) == 0  # (the fast VW never waits)
    # the job ends with the slow VW either way: every VW trains every step
    assert tight.time_s == pytest.approx(loose.time_s, rel=1e-9)
    # the mutation: servers whose gate always answers -- the output changes
    real = sim_hetpipe.may_serve_pull
    try:
        sim_hetpipe.may_serve_pull = lambda *a: True  # type: ignore[assignment]
        broken = simulate_hetpipe(JOB, two, HetPipeSpec(placement="np", clock_distance=0))
    finally:
        sim_hetpipe.may_serve_pull = real  # type: ignore[assignment]
    assert _note_waits(broken.note) == 0 != _note_waits(tight.note)


def test_a_revoked_device_evicts_its_vw_and_the_others_take_its_share() -> None:
    spec = HetPipeSpec(placement="ed", s_local=1)
    calm = simulate_hetpipe(JOB, MIXED, spec)
    placement, _ = place(JOB, MIXED, spec, list(MIXED.devices()))
    victim = placement.vws[1].devices[0]
    res = simulate_hetpipe(JOB, MIXED, spec, changes=[Change(at_s=calm.time_s / 3, kill=True, name=victim)])
    assert res.completed and res.steps == 200
    assert "VW(s) [1] lost" in res.note and len(res.recoveries_s) == 1
    dropped = int(res.note.split("lost, ")[1].split(" samples")[0])
    assert res.samples + dropped == 200 * 32  # every sample trained once or dropped
    assert 0 < dropped < 32 * 8  # (a few waves of its half at most)
    # the survivor trains the whole batch from the view without VW 1: slower than both together
    assert res.time_s > calm.time_s
    # a spare's revocation (a device no VW uses) changes nothing but the bill
    unused = sorted({d.name for d in MIXED.devices()} - {n for v in placement.vws for n in v.devices})
    if unused:
        spare = simulate_hetpipe(JOB, MIXED, spec, changes=[Change(at_s=1.0, kill=True, name=unused[0])])
        assert spare.time_s == pytest.approx(calm.time_s) and spare.device_s < calm.device_s


def test_with_every_vw_lost_the_job_ends_incomplete() -> None:
    spec = HetPipeSpec(placement="ed")
    placement, _ = place(JOB, MIXED, spec, list(MIXED.devices()))
    kills = [Change(at_s=0.5 + k, kill=True, name=v.devices[0]) for k, v in enumerate(placement.vws)]
    res = simulate_hetpipe(JOB, MIXED, spec, changes=kills, recovery=Recovery(detect_s=0.1))
    assert not res.completed and res.steps < 200


def test_bad_input_is_one_line() -> None:
    small = SimCluster(classes=(DeviceClass(type="G", count=4, speed=0.4, per_node=4, memory_bytes=1 * MIB),))
    with pytest.raises(ValueError, match="hetpipe: placement 'np'"):
        simulate_hetpipe(JOB, small, HetPipeSpec(placement="np"))
    with pytest.raises(ValueError, match="placement must be one of np, ed, hd, auto"):
        HetPipeSpec(placement="given")
    with pytest.raises(ValueError, match="s_local must be an integer >= 0"):
        HetPipeSpec(s_local=-1)
    with pytest.raises(ValueError, match="needs the model's layer profile"):
        simulate_hetpipe(replace(JOB, profile=None), MIXED)


def test_the_strategy_spec_names_its_simulation() -> None:
    from flotilla.sync.hetpipe import SPEC, HetPipeStrategy

    assert SPEC.simulated == "flotilla.sim.hetpipe:hetpipe_of"
    spec = hetpipe_of(HetPipeStrategy(placement="given", num_stages=2, replicas=2, s_local=3))
    assert (spec.placement, spec.s_local, spec.wave_size) == ("auto", 3, 4) and not spec.reform
    assert hetpipe_of(HetPipeStrategy(reform=True)).reform  # (flotilla simulate forms lost VWs again)


def test_two_evictions_follow_the_servers_data_views() -> None:
    # three nodes that each hold the model: np makes three VWs; two are revoked one after another
    three = SimCluster(
        classes=(
            DeviceClass(type="A", count=2, speed=1.0, per_node=2, memory_bytes=64 * MIB),
            DeviceClass(type="B", count=2, speed=0.8, per_node=2, memory_bytes=64 * MIB),
            DeviceClass(type="C", count=2, speed=0.6, per_node=2, memory_bytes=64 * MIB),
        )
    )
    spec = HetPipeSpec(placement="np", s_local=1, clock_distance=1)
    calm = simulate_hetpipe(JOB, three, spec)
    kills = [Change(at_s=calm.time_s * f, kill=True, name=n) for f, n in ((0.3, "C-0"), (0.31, "A-1"))]
    res = simulate_hetpipe(JOB, three, spec, changes=kills, recovery=Recovery(detect_s=0.05))
    assert res.completed and res.steps == 200 and "VW(s) [0, 2] lost" in res.note
    dropped = int(res.note.split("lost, ")[1].split(" samples")[0])
    assert res.samples + dropped == 200 * 32  # every sample trained once or dropped, both evictions
    assert len(res.recoveries_s) == 2 and all(r > 0 for r in res.recoveries_s)
    assert res.time_s > calm.time_s


# two nodes of two devices, each node a VW (np); with s_local 0 a VW runs one minibatch at a time,
# so one device of a node trains about as fast as the node's two-stage pipeline
TWO = SimCluster(
    classes=(
        DeviceClass(type="A", count=2, speed=1.0, per_node=2, memory_bytes=64 * MIB),
        DeviceClass(type="B", count=2, speed=1.0, per_node=2, memory_bytes=64 * MIB),
    )
)
REFORM = HetPipeSpec(placement="np", s_local=0, clock_distance=1, reform=True)
LONG = replace(JOB, steps=400)


def test_with_reform_a_lost_vw_is_formed_again_from_its_surviving_devices() -> None:
    """``reform``: the survivor of a VW whose device was revoked forms a VW again
    (``pipeline/vw_reform``: it holds the model and the job is faster with it), which joins the
    servers after its stages start (``ps/clock_rules.hello``) and takes its share again: sooner
    done than without it, every sample trained once or dropped."""
    calm = simulate_hetpipe(LONG, TWO, REFORM)
    assert calm.time_s == simulate_hetpipe(LONG, TWO, replace(REFORM, reform=False)).time_s
    kill = [Change(at_s=calm.time_s / 4, kill=True, name="B-1")]
    recovery = Recovery(detect_s=0.1, startup_s=0.5)
    without = simulate_hetpipe(LONG, TWO, replace(REFORM, reform=False), changes=kill, recovery=recovery)
    res = simulate_hetpipe(LONG, TWO, REFORM, changes=kill, recovery=recovery)
    assert res.completed and res.steps == 400 and "1 formed again from other devices" in res.note
    assert "formed again" not in without.note
    dropped = int(res.note.split("lost, ")[1].split(" samples")[0])
    assert res.samples + dropped == 400 * 32  # every sample trained once or dropped
    assert res.time_s < without.time_s  # (two VWs again after ~0.6 s, not one to the end)


def test_with_reform_an_arrival_forms_a_vw_whose_devices_were_all_revoked() -> None:
    """Every device of a VW revoked: nothing survives it and no device is free -- it waits (the
    note says why); an arrival (a spot trace's new slot) then forms it again."""
    calm = simulate_hetpipe(LONG, TWO, REFORM)
    t = calm.time_s / 4
    gone = [Change(at_s=t, kill=True, name=n) for n in ("B-0", "B-1")]
    recovery = Recovery(detect_s=0.1, startup_s=0.5)
    alone = simulate_hetpipe(LONG, TWO, REFORM, changes=gone, recovery=recovery)
    assert alone.completed and "1 not formed again" in alone.note and "no device left" in alone.note
    arrival = Change(at_s=t + 1.0, kill=False, name="new-0")
    back = simulate_hetpipe(LONG, TWO, REFORM, changes=[*gone, arrival], recovery=recovery)
    assert back.completed and "1 formed again" in back.note and back.time_s < alone.time_s
    dropped = int(back.note.split("lost, ")[1].split(" samples")[0])
    assert back.samples + dropped == 400 * 32


def test_with_reform_a_vw_losing_a_device_while_it_starts_is_formed_again_at_once() -> None:
    """A VW formed again from one arrival loses it while its stages start: its place waits again
    and is tried at once, with the other arrival, free since."""
    calm = simulate_hetpipe(LONG, TWO, REFORM)
    t = calm.time_s / 4
    gone = [Change(at_s=t, kill=True, name=n) for n in ("B-0", "B-1")]
    arrivals = [Change(at_s=t + 1.0, kill=False, name=n) for n in ("new-0", "new-1")]
    recovery = Recovery(detect_s=0.1, startup_s=0.5)  # (ready at t + 1.5, in at t + 2.0)
    lost_again = Change(at_s=t + 1.7, kill=True, name="new-0")
    res = simulate_hetpipe(LONG, TWO, REFORM, changes=[*gone, *arrivals, lost_again], recovery=recovery)
    assert res.completed and "1 formed again" in res.note and "not formed again" not in res.note
    dropped = int(res.note.split("lost, ")[1].split(" samples")[0])
    assert res.samples + dropped == 400 * 32
