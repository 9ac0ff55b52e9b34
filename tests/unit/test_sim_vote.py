"""The simulator's voting strategies (``sim/vote.py``): the loop machine driven in virtual time.

Checked against the cost model's closed form (no failures), against the runtime's decisions
(mutating the boundary rule or the abort rule changes the prediction: the simulator runs them,
it does not copy them), under revocations, arrivals and a spot trace mapped onto groups."""

from __future__ import annotations

import pytest

from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.emulation import TransientSlowdown
from flotilla.cluster.revocation_trace import parse_trace
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob
from flotilla.sim.trace import trace_changes
from flotilla.sim.vote import VoteSpec, simulate_vote
from flotilla.sync.base import VOTE_BYTES
from flotilla.trainer import boundary

ONE_NODE = SimCluster(classes=(DeviceClass(type="V100", count=4, per_node=4, price_per_hour=3.0),))
MIXED = SimCluster(
    classes=(DeviceClass(type="V100", count=3, per_node=4), DeviceClass(type="K80", count=1, speed=0.25)),
)
JOB = SimJob(steps=100, step_s=0.1, model_bytes=40_000_000, batch_per_worker=32)


def vote_s(members: int, link) -> float:
    """The unit's vote: a second, small all-reduce (``sync.base.VOTE_BYTES``)."""
    return ring_allreduce_s(members, VOTE_BYTES, link)


def test_without_failures_a_step_is_the_slowest_compute_plus_the_ring_all_reduce_and_the_vote() -> None:
    for cluster in (ONE_NODE, MIXED):
        r = simulate_vote(JOB, cluster)
        devices = cluster.devices()
        link = cluster.link_among(devices)
        step = JOB.step_s / min(d.speed for d in devices) + ring_allreduce_s(4, JOB.model_bytes, link)
        step += vote_s(4, link)
        assert r.completed and r.steps == 100
        assert r.time_s == pytest.approx(100 * step, rel=1e-12)
        assert r.samples == 100 * 4 * 32
    one = simulate_vote(JOB, ONE_NODE)
    assert one.device_s == pytest.approx(4 * one.time_s) and one.cost == pytest.approx(
        one.device_s / 3600 * 3.0
    )


def test_diloco_reduces_once_per_unit() -> None:
    ar = simulate_vote(JOB, MIXED)
    dl = simulate_vote(JOB, MIXED, VoteSpec(name="diloco", inner_steps=10))
    comm = ring_allreduce_s(4, JOB.model_bytes, MIXED.inter_node) + vote_s(4, MIXED.inter_node)
    assert ar.time_s - dl.time_s == pytest.approx(90 * comm, rel=1e-9)  # (one unit, one vote)
    assert len(dl.timeline) == 10 and dl.timeline[-1][1] == 100


def test_the_boundary_rule_is_the_runtimes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints cost time where the loop machine's boundary rule puts them; a wrong rule (never
    due) gives another prediction."""
    job = SimJob(steps=100, step_s=0.1, model_bytes=1000, checkpoint_every_steps=10, checkpoint_s=1.0)
    with_ckpt = simulate_vote(job, ONE_NODE)
    plain = simulate_vote(SimJob(steps=100, step_s=0.1, model_bytes=1000), ONE_NODE)
    assert with_ckpt.time_s == pytest.approx(plain.time_s + 10.0)  # at steps 10, 20, ..., 100
    monkeypatch.setattr(boundary, "_checkpoint_steps_due", lambda policy, nxt: False)
    assert simulate_vote(job, ONE_NODE).time_s == pytest.approx(plain.time_s)


def test_a_revoked_member_breaks_its_unit_which_is_redone_by_the_survivors() -> None:
    rec = Recovery(detect_s=0.2, repair_s=0.05, startup_s=5.0)
    plain = simulate_vote(JOB, ONE_NODE)
    kill_at = 5.0
    r = simulate_vote(JOB, ONE_NODE, changes=[Change(kill_at, True, "V100-3")], recovery=rec)
    assert r.completed and r.steps == 100 and len(r.recoveries_s) == 1
    step_before = plain.time_s / 100
    step_after = JOB.step_s + ring_allreduce_s(3, JOB.model_bytes, ONE_NODE.intra_node)
    step_after += vote_s(3, ONE_NODE.intra_node)
    done_before = int(kill_at // step_before)  # steps committed before the kill
    restart = kill_at + rec.detect_s + rec.repair_s
    assert r.time_s == pytest.approx(restart + (100 - done_before) * step_after, rel=1e-9)
    assert r.recoveries_s[0] == pytest.approx(rec.detect_s + rec.repair_s + step_after, rel=1e-9)
    assert r.timeline[-1][2] == 3
    # ``on_abort: drop``: the broken unit's step is not redone (the machine's rule, not the sim's)
    dropped = simulate_vote(
        JOB, ONE_NODE, VoteSpec(on_abort="drop"), changes=[Change(kill_at, True, "V100-3")]
    )
    assert dropped.time_s == pytest.approx(r.time_s - step_after, rel=1e-9)


def test_an_arrival_joins_after_its_start_up_and_is_sent_the_model() -> None:
    three = SimCluster(classes=(DeviceClass(type="V100", count=3, per_node=4),))
    rec = Recovery(startup_s=2.0, repair_s=0.05)
    r = simulate_vote(JOB, three, changes=[Change(1.0, False, "new-0")], recovery=rec)
    assert r.completed and [n for _, _, n in r.timeline][0] == 3 and r.timeline[-1][2] == 4
    joined_at = next(t for t, _, n in r.timeline if n == 4)
    assert joined_at > 3.0  # ready at 1.0 + 2.0, then the next boundary
    link = three.inter_node  # (the newcomer is on a node of its own)
    move = rec.repair_s + transfer_s(JOB.model_bytes, link)
    assert move > 0 and r.device_s == pytest.approx(3 * r.time_s + (r.time_s - 1.0))


def test_every_worker_revoked_ends_the_simulation_incomplete() -> None:
    kills = [Change(2.0, True, d.name) for d in ONE_NODE.devices()]
    r = simulate_vote(JOB, ONE_NODE, changes=kills)
    assert not r.completed and r.steps < 100 and "revoked" in r.note


def test_slowdowns_are_drawn_as_the_runtime_seeds_them_and_the_result_is_deterministic() -> None:
    slow = SimCluster(classes=ONE_NODE.classes, slowdown=TransientSlowdown(p=0.2, factor=5.0, seed=3))
    a, b = simulate_vote(JOB, slow), simulate_vote(JOB, slow)
    assert a.time_s == b.time_s and a.timeline == b.timeline
    assert a.time_s > simulate_vote(JOB, ONE_NODE).time_s * 1.5  # (the slowest of 4 draws, every step)


def test_a_spot_trace_drives_groups_of_devices() -> None:
    text = "0,add,a\n0,add,b\n1000,remove,a\n3000,add,c\n"
    cluster = SimCluster(classes=(DeviceClass(type="V100", count=8, per_node=8),))
    changes, group = trace_changes(cluster, parse_trace(text), time_scale=1.0)
    assert group == 4
    kills = sorted(c.name for c in changes if c.kill)
    assert kills == [f"V100-{i}" for i in range(4)] and all(c.at_s == 1.0 for c in changes if c.kill)
    adds = [c for c in changes if not c.kill]
    # (the runtime's slot rule: c takes the lowest free slot, a's: its group comes back as new processes)
    assert sorted(c.name for c in adds) == kills and all(c.at_s == 3.0 for c in adds)
    wider = trace_changes(cluster, parse_trace(text + "3000,add,d\n"), time_scale=1.0)[0]
    assert sorted(c.name for c in wider if c.name.startswith("spot-0/")) == [f"spot-0/{m}" for m in range(4)]
    r = simulate_vote(JOB, cluster, changes=changes, recovery=Recovery(startup_s=0.5))
    assert r.completed and {n for _, _, n in r.timeline} >= {4, 8}


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="VoteSpec.inner_steps"):
        VoteSpec(inner_steps=0)
    with pytest.raises(ValueError, match="SimJob.step_s"):
        SimJob(steps=1, step_s=0.0, model_bytes=1)
    with pytest.raises(ValueError, match="DeviceClass.count"):
        DeviceClass(type="x", count=0)
    with pytest.raises(ValueError, match="DeviceClass.price_per_hour"):
        DeviceClass(type="x", count=1, price_per_hour=-1.0)
    with pytest.raises(ValueError, match="each type once"):
        SimCluster(classes=(DeviceClass(type="x", count=1), DeviceClass(type="x", count=2)))


def test_a_thousand_devices_simulate_in_seconds() -> None:
    big = SimCluster(classes=(DeviceClass(type="A100", count=1024, per_node=8),))
    r = simulate_vote(SimJob(steps=1000, step_s=0.2, model_bytes=10**9), big)
    assert r.completed and r.events < 10_000  # (one machine for the agreed view: not per worker)
