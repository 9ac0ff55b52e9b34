"""AD-PSGD's pure decisions (``sync/adpsgd_plan.py``): the bipartition, the seeded peer choice and
the passive slot (one exchange or own step at a time; an expired exchange is aborted, a decided
one keeps its outcome)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from flotilla.sync import adpsgd_plan as plan

ids = st.sets(st.integers(0, 40), max_size=12)


@given(ids, ids, ids)
def test_roles_split_the_live_members_in_two_alternating_halves(
    members: set[int], gone: set[int], fin: set[int]
) -> None:
    active, passive = plan.roles(members, gone, fin)
    live = sorted(members - gone - fin)
    assert sorted(active + passive) == live
    assert not set(active) & set(passive)
    assert len(active) - len(passive) in (0, 1)
    assert all(live.index(a) % 2 == 0 for a in active)


@given(ids, ids, ids, ids, st.integers(0, 40))
def test_candidates_are_live_unsuspected_passives_and_only_for_an_active(
    members: set[int], gone: set[int], fin: set[int], suspected: set[int], me: int
) -> None:
    among = plan.candidates(me, members, gone=gone, finished=fin, suspected=suspected)
    active, passive = plan.roles(members, gone, fin)
    if me not in active:
        assert among == ()
    else:
        assert set(among) == set(passive) - suspected
        assert me not in among


@given(st.integers(0, 2**32), st.integers(0, 40), st.integers(0, 10**6), st.integers(0, 8),
       st.lists(st.integers(0, 40), min_size=1, max_size=10, unique=True))  # fmt: skip
def test_the_peer_choice_is_pure_and_among_the_candidates(
    seed: int, me: int, step: int, attempt: int, among: list[int]
) -> None:
    peer = plan.choose_peer(seed, me, step, attempt, tuple(among))
    assert peer in among
    assert peer == plan.choose_peer(seed, me, step, attempt, tuple(among))


def test_the_peer_choice_is_close_to_uniform_and_varies_with_the_seed() -> None:
    among = (1, 3, 5, 7)
    counts = Counter(plan.choose_peer(0, 0, step, 0, among) for step in range(4000))
    assert set(counts) == set(among)
    assert all(800 <= c <= 1200 for c in counts.values()), counts
    a = [plan.choose_peer(0, 0, s, 0, among) for s in range(50)]
    b = [plan.choose_peer(1, 0, s, 0, among) for s in range(50)]
    assert a != b
    assert plan.choose_peer(0, 0, 0, 0, ()) is None


def test_one_exchange_at_a_time_and_the_owner_waits_for_it() -> None:
    slot = plan.Slot()
    assert slot.prepare("a:1", 0, now=0.0, timeout_s=1.0) == "prepared"
    assert slot.prepare("b:1", 2, now=0.1, timeout_s=1.0) == "busy"
    assert not slot.take(now=0.2)  # the worker's own step waits
    assert slot.commit("a:1") == "committed"
    assert slot.take(now=0.3)
    assert slot.prepare("b:1", 2, now=0.3, timeout_s=1.0) == "busy"  # (own step in progress)
    slot.release()
    assert slot.prepare("b:1", 2, now=0.4, timeout_s=1.0) == "prepared"
    assert slot.abort("b:1") == "aborted"
    assert slot.holder is None


def test_an_exchange_past_its_deadline_is_aborted_and_keeps_that_outcome() -> None:
    slot = plan.Slot()
    slot.prepare("a:1", 0, now=0.0, timeout_s=1.0)
    assert slot.expire(now=0.5) is None
    expired = slot.expire(now=1.0)
    assert expired is not None and expired.xid == "a:1"
    assert slot.commit("a:1") == "aborted"  # a late commit does not apply it
    assert slot.abort("a:1") == "aborted"
    assert slot.prepare("a:1", 0, now=1.1, timeout_s=1.0) == "busy"  # an xid is never reused
    assert slot.commit("zz:9") == "unknown"


def test_an_exchange_whose_active_was_declared_dead_is_aborted_before_its_deadline() -> None:
    # (the passive's own step waited out the whole exchange_timeout_s for a dead active)
    slot = plan.Slot()
    slot.prepare("a:1", 3, now=0.0, timeout_s=2.0)
    assert slot.expire(now=0.1, gone={5}) is None and slot.holder is not None  # (another one died)
    expired = slot.expire(now=0.1, gone={3, 5})
    assert expired is not None and expired.xid == "a:1" and slot.holder is None
    assert slot.commit("a:1") == "aborted"  # (an active that was alive after all applies nothing)
    assert slot.take(now=0.2)


def test_a_committed_exchange_answers_committed_to_a_later_abort() -> None:
    slot = plan.Slot()
    slot.prepare("a:1", 0, now=0.0, timeout_s=1.0)
    slot.commit("a:1")
    assert slot.abort("a:1") == "committed"  # (an active whose commit reply was lost asks)


def test_a_closed_slot_takes_no_exchange() -> None:
    slot = plan.Slot(closed=True)
    assert slot.prepare("a:1", 0, now=0.0, timeout_s=1.0) == "closed"


@given(st.lists(st.tuples(st.sampled_from(["prepare", "commit", "abort", "take", "release", "tick"]),
                          st.integers(0, 3)), max_size=60))  # fmt: skip
def test_the_slot_never_holds_two_things(ops: list[tuple[str, int]]) -> None:
    slot, now = plan.Slot(), 0.0
    for op, n in ops:
        xid = f"x:{n}"
        if op == "prepare":
            before = slot.holder
            if slot.prepare(xid, n, now, 1.0) == "prepared":
                assert before is None or (isinstance(before, plan.Prepared) and now >= before.deadline)
        elif op == "commit":
            slot.commit(xid)
        elif op == "abort":
            slot.abort(xid)
        elif op == "take":
            before = slot.holder
            if slot.take(now):
                assert before is None or (isinstance(before, plan.Prepared) and now >= before.deadline)
        elif op == "release":
            slot.release()
        else:
            now += 0.4
        decided = list(slot.decided)
        assert len(decided) == len(set(decided))


@given(
    st.sets(st.integers(0, 30), max_size=12),
    st.sets(st.integers(0, 30), max_size=12),
)
def test_the_collector_is_the_lowest_finished_worker_whose_replica_lives(
    finished: set[int], lost: set[int]
) -> None:
    who = plan.collector(finished, lost)
    if finished <= lost:
        assert who is None
    else:
        assert who in finished and who not in lost
        assert all(w >= who for w in finished - lost)
