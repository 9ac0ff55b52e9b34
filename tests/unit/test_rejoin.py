"""The rejoin rule (``cluster/rejoin.py``) and the lost-members ledger noting a member that came
back (``roles/members_lost.py``)."""

from __future__ import annotations

import pytest

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.rejoin import MAX_IDLE_SESSIONS, after_session
from flotilla.report.summary import degraded_note
from flotilla.roles.members_lost import LostMembers


def test_an_evicted_session_is_followed_by_a_fresh_one() -> None:
    v = after_session(evicted=True, commits=12, idle=0)
    assert v.rejoin and v.idle == 0 and "rejoining as a newcomer" in v.why


@pytest.mark.parametrize("commits", [0, 5])
def test_a_session_that_ended_by_itself_is_the_last(commits: int) -> None:
    assert not after_session(evicted=False, commits=commits, idle=2).rejoin


def test_without_a_coordinator_nobody_rejoins() -> None:
    v = after_session(evicted=True, commits=3, idle=0, coordinator=False)
    assert not v.rejoin and "no coordinator" in v.why


def test_idle_evictions_in_a_row_end_it_and_a_commit_resets_the_count() -> None:
    idle = 0
    for _ in range(MAX_IDLE_SESSIONS - 1):
        v = after_session(evicted=True, commits=0, idle=idle)
        assert v.rejoin
        idle = v.idle
    assert after_session(evicted=True, commits=1, idle=idle) == after_session(evicted=True, commits=1, idle=0)
    last = after_session(evicted=True, commits=0, idle=idle)
    assert not last.rejoin and last.idle == MAX_IDLE_SESSIONS and "giving up" in last.why


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        after_session(evicted=True, commits=-1, idle=0)
    with pytest.raises(ValueError):
        after_session(evicted=True, commits=0, idle=0, max_idle=0)


def test_the_ledger_notes_who_came_back_under_which_id() -> None:
    lost = LostMembers(t0_unix=0.0, heartbeat_timeout_s=10.0)
    lost.note(1, "w1", ev.DeathNoticed(1, 0.0), suspected=False)
    lost.note(2, "w2", ev.DeathNoticed(2, 0.0), suspected=False)
    lost.rejoined("w1", 4)
    lost.rejoined("w1", 5)  # (nobody else of that name is out: nothing more)
    lost.rejoined("w9", 6)  # a new name: nobody came back
    entries = {m["name"]: m for m in lost.to_list()}
    assert entries["w1"]["rejoined_as"] == 4 and entries["w1"]["rejoined_at_s"] is not None
    assert entries["w2"]["rejoined_as"] is None
    note = degraded_note(lost.to_list(), 3)
    assert note is not None and "w1 came back" in note and "w2," not in note


def test_the_ledger_notes_a_suspected_member_back_under_its_own_id() -> None:
    lost = LostMembers(t0_unix=0.0, heartbeat_timeout_s=10.0)
    lost.note(0, "w0", ev.RingReturned(2, 6, (0, 2), 0.0), suspected=True)
    lost.back(0)
    lost.back(1)  # (never lost: nothing)
    (entry,) = lost.to_list()
    assert entry["rejoined_as"] == 0 and "cut off from the majority" in entry["why"]
