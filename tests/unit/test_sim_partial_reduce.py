"""``flotilla.sim.partial_reduce``: partial reduce in virtual time, the real group controller deciding.

Pure and fast (4 workers, no torch): the closed form of full synchronous groups, a straggler that
is done early while all-reduce waits for it, the real controller being the one consulted
(mutations of its bridging and done rules change the prediction), a revocation (an aborted group,
one recovery) and a newcomer's admission, determinism, bad input, the settings hook.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.emulation import TransientSlowdown
from flotilla.sim import partial_reduce as pr_sim
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob, SimResult
from flotilla.sim.partial_reduce import PRSpec, partial_reduce_of, simulate_partial_reduce
from flotilla.sim.vote import simulate_vote
from flotilla.sync.pr_plan import Assignment, GroupController

FOUR = SimCluster(classes=(DeviceClass(type="a", count=4),))
STRAGGLER = SimCluster(
    classes=(DeviceClass(type="fast", count=3), DeviceClass(type="slow", count=1, speed=1 / 3))
)
SLOWDOWN = SimCluster(
    classes=(DeviceClass(type="a", count=6),), slowdown=TransientSlowdown(p=0.2, factor=4, seed=3)
)
RECOVERY = Recovery(detect_s=0.2, startup_s=1.0)


def job(steps: int = 20, model_bytes: int = 1_000_000, batch: int = 8) -> SimJob:
    return SimJob(steps=steps, step_s=0.1, model_bytes=model_bytes, batch_per_worker=batch)


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[Assignment]:
    """Every assignment the real controller makes (a spy around ``GroupController._assign``)."""
    seen: list[Assignment] = []
    real = GroupController._assign

    def spy(self: GroupController, members: list[int], *, bridging: bool) -> Assignment:
        a = real(self, members, bridging=bridging)
        seen.append(a)
        return a

    monkeypatch.setattr(GroupController, "_assign", spy)
    return seen


@pytest.mark.parametrize("timeout_s", [0.0, 0.5])
@pytest.mark.parametrize("p", [2, 4])
def test_full_synchronous_groups_follow_the_closed_form(
    p: int, timeout_s: float, groups: list[Assignment]
) -> None:
    # 4 identical workers are ready together every step; the controller forms full groups at once
    # (simultaneous readies are one batch: no timeout fires).  A step: compute, pr_ready (one
    # message), the assignment (one), the ring all-reduce, pr_done (one), the commit (one).
    r = simulate_partial_reduce(job(), FOUR, PRSpec(group_size=p, group_timeout_s=timeout_s))
    link = FOUR.inter_node
    message = transfer_s(pr_sim._MESSAGE_BYTES, link)
    assert r.completed and r.steps == 20 and r.note == ""
    assert r.time_s == pytest.approx(
        20 * (0.1 + ring_allreduce_s(p, 1_000_000, link) + 4 * message), rel=1e-12
    )
    assert r.samples == 20 * 4 * 8 and r.recoveries_s == []
    assert [s for _, s, _ in r.timeline] == [s for s in range(1, 21) for _ in range(4 // p)]
    got = [(a.members, a.bridging) for a in groups]
    if p == 4:
        assert got == [((0, 1, 2, 3), False)] * 20
    else:
        # FIFO pairs (ties by id) for bridge_after = 2 x 4 committed groups, then the round is
        # forced to end by bridging pairs (0, 2), (1, 3): every worker knows every worker
        ordinary = [((0, 1), False), ((2, 3), False)] * 4
        assert got == (ordinary + [((0, 2), True), ((1, 3), True)]) * 4


def test_a_straggler_is_done_early_while_all_reduce_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[int] = []
    real_done_for = GroupController.done_for

    def spy(self: GroupController, worker_id: int) -> bool:
        d = real_done_for(self, worker_id)
        if d:
            done.append(worker_id)
        return d

    monkeypatch.setattr(GroupController, "done_for", spy)
    run = pr_sim._run(job(), STRAGGLER, PRSpec(group_size=3), (), Recovery())
    r = simulate_partial_reduce(job(), STRAGGLER, PRSpec(group_size=3))
    allreduce = simulate_vote(job(), STRAGGLER)
    # measured: 3.94 s against all-reduce's 6.03 s (paced every step by the 0.3 s straggler)
    assert r.completed and r.steps == 20
    assert r.time_s < allreduce.time_s
    slow = run.workers[3]
    assert [run.workers[w].state for w in range(3)] == ["finished"] * 3
    assert slow.state == "done" and slow.steps < 20 and done == [3, 3]  # (in both runs)
    assert r.samples == (3 * 20 + slow.steps) * 8  # its unaveraged tail is never trained
    assert r.time_s < 20 * 0.3


def test_the_real_controller_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = PRSpec(group_size=3, bridge_after=1)
    real = simulate_partial_reduce(job(), STRAGGLER, spec)
    # no bridging groups (the plain FIFO ones instead): the fast workers need not wait for the
    # straggler to end a mixing round
    monkeypatch.setattr(GroupController, "_bridging", lambda self, order, size: order[:size])
    fifo = simulate_partial_reduce(job(), STRAGGLER, spec)
    assert fifo.time_s < real.time_s and fifo.timeline != real.timeline
    monkeypatch.undo()
    # never done: the straggler trains all its steps alone, and the job lasts as long as it
    monkeypatch.setattr(GroupController, "done_for", lambda self, worker_id: False)
    never_done = simulate_partial_reduce(job(), STRAGGLER, spec)
    assert never_done.samples == 4 * 20 * 8 > real.samples
    assert never_done.time_s > 20 * 0.3 > real.time_s


KILL = Change(1.05, True, "a-2")  # during a group's all-reduce (100 MB)
ARRIVE = Change(1.5, False, "new-0")


def test_a_revocation_aborts_its_group_and_an_arrival_joins_as_a_newcomer(groups: list[Assignment]) -> None:
    j = job(steps=40, model_bytes=100_000_000, batch=2)
    run = pr_sim._run(j, FOUR, PRSpec(group_size=2), [KILL], RECOVERY)
    killed = simulate_partial_reduce(j, FOUR, PRSpec(group_size=2), changes=[KILL], recovery=RECOVERY)
    assert run.ctrl.aborted == 1 and run.workers[2].state == "revoked"
    assert killed.completed and killed.steps == 40 and len(killed.recoveries_s) == 1
    assert killed.timeline[-1][2] == 3 and killed.timeline[-1][1] == 40
    assert killed.samples == 2 * sum(w.steps for w in run.workers.values())

    groups.clear()
    run = pr_sim._run(j, FOUR, PRSpec(group_size=2), [KILL, ARRIVE], RECOVERY)
    both = simulate_partial_reduce(j, FOUR, PRSpec(group_size=2), changes=[KILL, ARRIVE], recovery=RECOVERY)
    new = run.workers[4]  # (a new worker id, after the 4 first)
    first = next(a for a in groups if 4 in a.members)
    assert first.weights[first.members.index(4)] == 0.0  # the controller's newcomer rule
    assert 0 < new.joined_at < 40 and new.state == "finished" and new.steps == 40
    assert both.completed and len(both.recoveries_s) == 1 and both.timeline[-1][2] == 4
    # every local step counts, the newcomer's from the step it joined at
    assert both.samples == 2 * sum(w.steps - w.joined_at for w in run.workers.values())
    assert both.samples > killed.samples and both.device_s > killed.device_s


def test_every_worker_revoked_loses_the_model() -> None:
    kills = [Change(1.0, True, f"a-{i}") for i in range(4)]
    r = simulate_partial_reduce(job(), FOUR, PRSpec(group_size=2), changes=[*kills, ARRIVE])
    assert not r.completed and r.time_s == 1.0 and 0 < r.steps < 20
    assert "revoked" in r.note and r.recoveries_s == [0.0]  # (one revocation instant)


@pytest.mark.parametrize(("at_s", "filled"), [(2.55, False), (2.75, True)])
def test_a_newcomer_is_lost_without_holders_or_trains_on_alone_once_filled(at_s: float, filled: bool) -> None:
    # the newcomer is ready at 2.5 s; every holder is revoked at ``at_s``: before any group
    # filled it (lost, when the controller drops the holders detect_s later), or after
    j = job(steps=40, model_bytes=100_000_000, batch=2)
    changes = [*(Change(at_s, True, f"a-{i}") for i in range(4)), ARRIVE]
    run = pr_sim._run(j, FOUR, PRSpec(group_size=2), changes, RECOVERY)
    r = simulate_partial_reduce(j, FOUR, PRSpec(group_size=2), changes=changes, recovery=RECOVERY)
    new = run.workers[4]
    if filled:  # (alone: solo steps, as a survivor of deaths)
        assert new.state == "finished" and r.completed and r.steps == 40 and r.note == ""
    else:
        assert new.state == "lost" and new.steps == 0 and not r.completed
        assert r.time_s == pytest.approx(at_s + RECOVERY.detect_s) and "revoked" in r.note


def test_deterministic() -> None:
    def once() -> SimResult:
        changes = [Change(0.7, True, "a-4"), ARRIVE]
        return simulate_partial_reduce(
            job(steps=30), SLOWDOWN, PRSpec(group_size=3, group_timeout_s=0.05), changes=changes
        )

    a, b = once(), once()
    assert a.summary() == b.summary()
    assert (a.timeline, a.recoveries_s, a.device_s) == (b.timeline, b.recoveries_s, b.device_s)
    assert (
        PRSpec(group_size=3).simulate(job(), SLOWDOWN).summary()
        == simulate_partial_reduce(job(), SLOWDOWN, PRSpec(group_size=3)).summary()
    )


def test_bad_input_names_the_field() -> None:
    for bad in (1, 0, True, 2.5, "3"):
        with pytest.raises(ValueError, match="PRSpec.group_size"):
            PRSpec(group_size=bad)  # type: ignore[arg-type]
    for alpha in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="PRSpec.alpha"):
            PRSpec(group_size=2, alpha=alpha)
    with pytest.raises(ValueError, match="PRSpec.group_timeout_s"):
        PRSpec(group_size=2, group_timeout_s=-1.0)
    with pytest.raises(ValueError, match="PRSpec.bridge_after"):
        PRSpec(group_size=2, bridge_after=-1)


def test_the_settings_hook() -> None:
    settings = SimpleNamespace(
        kind="partial_reduce", group_size=3, weighting="constant", alpha=0.3, group_timeout_s=0.2,
        bridge_after=7, step_timeout_s=30.0,
    )  # fmt: skip
    assert partial_reduce_of(settings) == PRSpec(group_size=3, alpha=1.0, group_timeout_s=0.2, bridge_after=7)
    settings.weighting = "dynamic"
    assert partial_reduce_of(settings).alpha == 0.3
    assert partial_reduce_of(SimpleNamespace(group_size=2)) == PRSpec(group_size=2)
