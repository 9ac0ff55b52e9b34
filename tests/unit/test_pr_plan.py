"""Partial Reduce controller (pure, ``sync/pr_plan.py``): the isolation bound with two fast and two
slow workers, DPR weight properties, atomic group decisions, refused messages."""

from __future__ import annotations

import heapq
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.sync.pr_plan import (
    ControllerConfig,
    ControllerError,
    GroupController,
    GroupState,
    dpr_weights,
    round_bound,
)


def simulate(durations: dict[int, float], cfg: ControllerConfig, num_groups: int):
    """Event simulation: worker w takes durations[w] per local step, then is ready; groups commit at
    once.  Returns the list of groups and, per worker, the set of (worker, step) updates its model
    holds after each group (time-respecting propagation, independent of the controller's own sets)."""
    ctrl = GroupController(cfg, durations)
    holds = {w: set() for w in durations}
    steps = dict.fromkeys(durations, 0)
    events = [(d, w) for w, d in durations.items()]
    heapq.heapify(events)
    groups: list[tuple[int, ...]] = []
    made_at: dict[tuple[int, int], int] = {}  # update -> number of groups formed before it
    snapshots: list[dict[int, frozenset]] = []
    while len(groups) < num_groups:
        t, w = heapq.heappop(events)
        holds[w].add((w, steps[w]))
        made_at[(w, steps[w])] = len(groups)
        steps[w] += 1
        ctrl.ready(w, steps[w], t)
        for a in ctrl.form(t):
            union = set().union(*(holds[m] for m in a.members))
            for m in a.members:
                holds[m] = set(union)
                assert ctrl.report(m, a.group_id, True) in (GroupState.OPEN, GroupState.COMMITTED)
                heapq.heappush(events, (t + durations[m], m))
            assert ctrl.state_of(a.group_id) is GroupState.COMMITTED
            groups.append(a.members)
            snapshots.append({m: frozenset(h) for m, h in holds.items()})
    return ctrl, groups, made_at, snapshots


FAST_SLOW = {0: 1.0, 1: 1.03, 2: 3.1, 3: 3.3}  # two fast, two slow
# in lockstep: the fast pair is always ready together, and so is the slow pair (FIFO never mixes)
LOCKSTEP = {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0}


def test_without_bridging_the_fast_workers_are_isolated_from_the_slow_ones() -> None:
    """The failure the controller prevents: never forced, the fast pair only meets itself."""
    ctrl, groups, made_at, snaps = simulate(LOCKSTEP, ControllerConfig(group_size=2, bridge_after=10**6), 200)
    fast_holds = snaps[-1][0]
    assert not any(u[0] in (2, 3) for u in fast_holds), "a slow worker's update reached a fast one"
    assert ctrl.rounds_completed == 0


@pytest.mark.parametrize("durations", [LOCKSTEP, FAST_SLOW])
@pytest.mark.parametrize("group_size", [2, 3])
@pytest.mark.parametrize("bridge_after", [0, 3])
def test_every_update_reaches_every_worker_within_the_bound(
    durations: dict[int, float], group_size: int, bridge_after: int
) -> None:
    cfg = ControllerConfig(group_size=group_size, bridge_after=bridge_after)
    ctrl, groups, made_at, snaps = simulate(durations, cfg, 300)
    bound = 2 * round_bound(4, ctrl.bridge_after)
    assert ctrl.rounds_completed >= 300 // round_bound(4, ctrl.bridge_after) // 2
    checked = 0
    for update, k in made_at.items():
        if k + bound >= len(snaps):
            continue
        holders = {w for w, h in snaps[k + bound - 1].items() if update in h}
        assert holders == set(durations), f"update {update} (made before group {k}) only at {holders}"
        checked += 1
    assert checked > 100
    # the fast workers are not held to the slow ones' pace: they take part in more groups
    count = {w: sum(1 for g in groups if w in g) for w in durations}
    assert min(count[0], count[1]) > 1.5 * max(count[2], count[3])


def test_timeout_forms_a_smaller_group_and_one_live_worker_goes_solo() -> None:
    ctrl = GroupController(ControllerConfig(group_size=3, group_timeout_s=0.5), [0, 1, 2, 3])
    ctrl.ready(0, 1, now=0.0)
    ctrl.ready(1, 1, now=0.1)
    assert ctrl.form(0.4) == []
    (a,) = ctrl.form(0.5)
    assert a.members == (0, 1) and a.weights == (0.5, 0.5)
    for w in (1, 2, 3):
        ctrl.drop(w)  # 1 was in the open group: it is aborted
    assert ctrl.state_of(a.group_id) is GroupState.ABORTED
    ctrl.ready(0, 2, now=1.0)
    (solo,) = ctrl.form(1.0)
    assert solo.solo and solo.members == (0,)


def test_a_survivor_of_deaths_trains_on_solo_but_one_whose_partners_finished_is_done() -> None:
    dead = GroupController(ControllerConfig(group_size=2), [0, 1, 2])
    for w in (1, 2):
        dead.drop(w)  # died: 0 is the survivor and trains on alone
    dead.ready(0, 5, now=0.0)
    assert dead.form(0.0)[0].solo and not dead.done_for(0)
    fin = GroupController(ControllerConfig(group_size=2), [0, 1, 2])
    fin.finish(1)  # 1 and 2 did their last step (a straggler, 0, is left behind)
    assert not fin.done_for(0)  # 2 is still there to average with
    fin.ready(0, 5, now=0.0)
    fin.ready(2, 6, now=0.0)
    (a,) = fin.form(0.0)
    assert a.members == (0, 2) and not a.solo
    assert fin.report(0, a.group_id, True) is GroupState.OPEN
    assert fin.finish(2) == [a.group_id]  # left before reporting: its open group is aborted
    fin.ready(0, 6, now=1.0)
    (solo,) = fin.form(1.0)
    assert solo.solo and fin.done_for(0) and fin.finished == {1, 2}
    assert not fin.done_for(1)  # (a finished worker is not live)


def test_group_is_committed_only_when_every_member_reported_success() -> None:
    ctrl = GroupController(ControllerConfig(group_size=3), [0, 1, 2, 3])
    for w in (0, 1, 2):
        ctrl.ready(w, 5 + w, now=0.0)
    (a,) = ctrl.form(0.0)
    assert ctrl.report(0, a.group_id, True) is GroupState.OPEN
    assert ctrl.report(1, a.group_id, True) is GroupState.OPEN
    ctrl.drop(2)  # dies before reporting: survivors apply none of it
    assert ctrl.state_of(a.group_id) is GroupState.ABORTED
    assert ctrl.report(1, a.group_id, True) is GroupState.ABORTED  # (a late report changes nothing)
    # the member set's next group gets a fresh namespace
    ctrl2 = GroupController(ControllerConfig(group_size=2), [0, 1])
    ctrl2.ready(0, 1, 0.0), ctrl2.ready(1, 1, 0.0)
    (b,) = ctrl2.form(0.0)
    ctrl2.report(0, b.group_id, False)
    ctrl2.ready(0, 1, 1.0), ctrl2.ready(1, 1, 1.0)
    (c,) = ctrl2.form(1.0)
    assert b.namespace != c.namespace and c.members == b.members


def test_refuses_unknown_workers_replays_and_forged_reports() -> None:
    ctrl = GroupController(ControllerConfig(group_size=2), [0, 1, 2])
    with pytest.raises(ControllerError, match="not a live member"):
        ctrl.ready(9, 1, 0.0)
    ctrl.ready(0, 1, 0.0)
    with pytest.raises(ControllerError, match="already ready"):
        ctrl.ready(0, 1, 0.0)
    ctrl.ready(1, 1, 0.0)
    (a,) = ctrl.form(0.0)
    with pytest.raises(ControllerError, match="not its own"):
        ctrl.report(2, a.group_id, False)  # a forged abort by a non-member
    with pytest.raises(ControllerError, match="not its own"):
        ctrl.report(0, a.group_id + 7, True)
    assert ctrl.state_of(a.group_id) is GroupState.OPEN


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("group_size", {"group_size": 1}),
        ("alpha", {"alpha": 0.0}),
        ("alpha", {"alpha": 1.5}),
        ("group_timeout_s", {"group_timeout_s": -1.0}),
    ],
)
def test_bad_config_names_the_field(field: str, kw: dict) -> None:
    with pytest.raises(ValueError, match=field):
        ControllerConfig(**{"group_size": 2, **kw})


versions = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=16)
alphas = st.floats(min_value=1e-3, max_value=1.0)


@given(versions, alphas)
def test_dpr_weights_are_a_distribution_favouring_fresh_models(vs: list[int], alpha: float) -> None:
    w = dpr_weights(vs, alpha)
    assert math.isclose(sum(w), 1.0, rel_tol=1e-9)
    assert all(x >= 0 for x in w)
    top = max(range(len(vs)), key=lambda i: vs[i])
    assert w[top] == max(w) and w[top] > 0
    for i in range(len(vs)):
        for j in range(len(vs)):
            if vs[i] >= vs[j]:
                assert w[i] >= w[j] - 1e-15


@given(versions, alphas, st.integers(min_value=0, max_value=1000))
def test_dpr_weights_depend_only_on_versions_behind_the_freshest(vs: list[int], alpha: float, k: int) -> None:
    a, b = dpr_weights(vs, alpha), dpr_weights([v + k for v in vs], alpha)
    assert all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-300) for x, y in zip(a, b))


@given(versions)
def test_alpha_one_is_constant_partial_reduce(vs: list[int]) -> None:
    assert all(math.isclose(x, 1 / len(vs)) for x in dpr_weights(vs, 1.0))


def test_dpr_weights_ratio_is_alpha_per_version() -> None:
    w = dpr_weights([10, 9, 8], 0.5)
    assert w == pytest.approx((4 / 7, 2 / 7, 1 / 7))


# ---------------------------------------------------------------------------------------- newcomers
def test_a_newcomer_weighs_zero_in_its_first_group_and_is_a_holder_after_it() -> None:
    ctrl = GroupController(ControllerConfig(group_size=2, alpha=0.5), [0, 1, 2])
    ctrl.admit(7)
    assert ctrl.newcomers == {7} and 7 in ctrl.live and not ctrl.lost_for(7)
    ctrl.ready(7, 0, 0.0)
    ctrl.ready(1, 5, 0.1)
    (a,) = ctrl.form(0.1)
    assert a.members == (1, 7) and a.weights == (1.0, 0.0) and a.versions == (5, 0)
    ctrl.report(1, a.group_id, True)
    assert ctrl.report(7, a.group_id, True) is GroupState.COMMITTED
    assert ctrl.newcomers == set() and ctrl.versions[7] == 5  # the holder's version, not the newcomer's
    ctrl.ready(7, 6, 0.2)
    ctrl.ready(0, 2, 0.3)
    (b,) = ctrl.form(0.3)
    assert b.members == (0, 7) and b.weights == dpr_weights([2, 6], 0.5)  # an ordinary member now


def test_newcomers_never_form_a_group_alone_nor_get_a_solo_step() -> None:
    ctrl = GroupController(ControllerConfig(group_size=2, group_timeout_s=0.0), [0, 1])
    ctrl.admit(5)
    ctrl.admit(6)
    ctrl.ready(5, 0, 0.0)
    ctrl.ready(6, 0, 0.0)
    assert ctrl.form(10.0) == []  # two newcomers: nothing to average
    ctrl.ready(0, 3, 1.0)
    (a,) = ctrl.form(1.0)
    assert set(a.members) == {0, 5} and dict(zip(a.members, a.weights)) == {0: 1.0, 5: 0.0}
    ctrl.report(0, a.group_id, False)  # aborted: the newcomer is still one
    assert ctrl.newcomers == {5, 6}
    ctrl.drop(1)
    ctrl.drop(0)  # no holder is left: the model is lost for the newcomers
    assert ctrl.lost_for(5) and ctrl.lost_for(6)
    assert ctrl.form(20.0) == [] and ctrl.assignment_for(6) is None


def test_a_group_of_newcomers_takes_the_oldest_ready_holder() -> None:
    ctrl = GroupController(ControllerConfig(group_size=3), [0, 1, 2, 3])
    for w in (8, 9):
        ctrl.admit(w)
    ctrl.ready(8, 0, 0.0)
    ctrl.ready(9, 0, 0.1)
    ctrl.ready(2, 4, 0.2)  # the newcomers are the oldest three's first two: still a holder among them
    (a,) = ctrl.form(0.2)
    assert a.members == (2, 8, 9) and a.weights == (1.0, 0.0, 0.0)


def test_admission_is_refused_for_a_member_and_a_holder_comes_back_as_one() -> None:
    ctrl = GroupController(ControllerConfig(group_size=2), [0, 1, 2])
    with pytest.raises(ControllerError, match="already a member"):
        ctrl.admit(1)
    with pytest.raises(ControllerError, match="int >= 0"):
        ctrl.admit(-1)
    ctrl.drop(2)  # (left for another strategy; who may come back is the caller's decision)
    ctrl.admit(2, holder=True)
    assert ctrl.live == {0, 1, 2} and ctrl.newcomers == set()
    ctrl.ready(2, 9, 0.0)
    ctrl.ready(0, 9, 0.0)
    (a,) = ctrl.form(0.0)
    assert a.members == (0, 2) and a.weights == (0.5, 0.5)


@given(st.lists(st.sampled_from(["ready", "form", "ok", "fail", "drop"]), max_size=60), st.integers(0, 2**16))
def test_every_committed_group_holds_a_holder_and_newcomers_weigh_zero(ops: list[str], seed: int) -> None:
    import random

    rng = random.Random(seed)
    ctrl = GroupController(ControllerConfig(group_size=3, group_timeout_s=0.0), [0, 1, 2, 3])
    for w in (10, 11, 12):
        ctrl.admit(w)
    t = 0.0
    for op in ops:
        t += 1.0
        live = sorted(ctrl.live)
        if not live:
            break
        w = rng.choice(live)
        if op == "ready" and w not in ctrl._queue and ctrl._open_group_of(w) is None:
            ctrl.ready(w, rng.randrange(0, 9), t)
        elif op == "form":
            for a in ctrl.form(t):
                holders = [m for m in a.members if m not in ctrl.newcomers]
                assert holders, f"a group of newcomers only: {a}"
                for m, weight in zip(a.members, a.weights):
                    assert (weight == 0.0) == (m in ctrl.newcomers)
                assert math.isclose(sum(a.weights), 1.0)
        elif op in ("ok", "fail") and (a := ctrl.assignment_for(w)) is not None and not a.solo:
            was_new = set(a.members) & ctrl.newcomers
            if ctrl.report(w, a.group_id, op == "ok") is GroupState.COMMITTED:
                assert not (was_new & ctrl.newcomers)
        elif op == "drop" and len(live) > 1:
            ctrl.drop(w)
        for n in ctrl.newcomers:
            assert ctrl.lost_for(n) == (not (ctrl.live - ctrl.newcomers))
