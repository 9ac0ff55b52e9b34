"""The pure neighbour watch (``cluster/peer_watch.py``): whom a worker watches, when a watched
peer is suspected (within two heartbeat intervals of its last answer), and no blame after the
watcher itself stalled."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.peer_watch import PeerWatchPolicy, watched


def test_watched_is_the_ring_predecessor_and_successor() -> None:
    assert watched((3, 7, 9, 12), 9) == (7, 12)
    assert watched((3, 7, 9, 12), 3) == (7, 12)  # the ring wraps
    assert watched((12, 3, 9, 7), 12) == (3, 9)  # worker_id order, whatever the input order
    assert watched((4, 5), 4) == (5,)
    assert watched((4,), 4) == ()
    assert watched((4, 5), 6) == ()


@given(st.sets(st.integers(0, 50), min_size=1, max_size=20))
@settings(max_examples=200, deadline=None)
def test_every_member_is_watched_by_its_two_neighbours(members: set[int]) -> None:
    watchers: dict[int, list[int]] = {m: [] for m in members}
    for m in members:
        peers = watched(tuple(members), m)
        assert m not in peers and set(peers) <= members
        for p in peers:
            watchers[p].append(m)
    expected = min(2, len(members) - 1)
    assert all(len(w) == expected for w in watchers.values())


def test_a_silent_peer_is_suspected_within_two_intervals() -> None:
    policy = PeerWatchPolicy(interval_s=0.25)
    assert policy.period_s == 0.125 and policy.limit_s == 0.375
    heard = {1: 10.0, 2: 10.0}
    t, last_check, suspected_at = 10.0, 10.0, None
    while suspected_at is None:  # peer 1 answers every round, peer 2 stopped after 10.0
        t += policy.period_s
        heard[1] = t
        verdict = policy.silent(last_heard_s=heard, now_s=t, last_check_s=last_check)
        last_check = t
        assert not verdict.stalled and 1 not in verdict.suspects
        if 2 in verdict.suspects:
            suspected_at = t
    assert suspected_at - 10.0 <= 2 * policy.interval_s


def test_a_stalled_watcher_blames_nobody() -> None:
    policy = PeerWatchPolicy(interval_s=0.25)
    verdict = policy.silent(last_heard_s={1: 0.0, 2: 5.0}, now_s=6.0, last_check_s=5.0)
    assert verdict.stalled and not verdict.suspects
    verdict = policy.silent(last_heard_s={1: 0.0, 2: 5.9}, now_s=6.0, last_check_s=5.9)
    assert not verdict.stalled and verdict.suspects == {1}


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        PeerWatchPolicy(interval_s=0)
