"""The coordinator's lease (``cluster/lease.py``, issue 37 item 2): over random cuts, heartbeat
phases and message delays, the coordinator never holds its lease while a majority side of the same
view is in ring mode -- and when it counts a heartbeat's receipt time instead of the stamp the
worker echoes, it does, so the check can fail.  Plus the rule's functions on their own."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.lease import (
    LeaseTerms,
    coordinator_gone,
    coordinator_may_mint,
    min_margin_s,
    side_may_commit,
)

HEARTBEAT_S = 0.25
MAX_DELAY_S = 0.05
LEASE_S = 2.0
MARGIN_S = min_margin_s(drift=1e-4, lease_s=LEASE_S)  # (the link uses one heartbeat interval: far more)


@dataclass(frozen=True)
class Cut:
    """Workers in ``away`` lose the coordinator (and the workers left with it) from ``start_s``
    to ``end_s``."""

    away: frozenset[int]
    start_s: float
    end_s: float

    def connected(self, w: int, t: float) -> bool:  # (with the coordinator's side)
        return w not in self.away or not self.start_s <= t < self.end_s


def conflicts(
    n: int, cut: Cut, seed: int, terms: LeaseTerms, horizon_s: float, *, by_receipt: bool = False
) -> list[float]:
    """Simulate heartbeats (each worker every HEARTBEAT_S from a random phase; each message
    delayed up to MAX_DELAY_S and lost if either end is cut off when it is sent or arrives; each
    reply stamped with the coordinator's clock, each heartbeat echoing the newest stamp its
    sender received, none once it is in ring mode) and return the instants at which both the
    coordinator may mint and a side in ring mode may commit.  ``by_receipt``: the mutation --
    the coordinator takes a heartbeat's arrival as the renewal, whatever it echoes."""
    rng = random.Random(seed)
    view = list(range(n))
    renewed: dict[int, float] = {w: 0.0 for w in view}
    replied: dict[int, float] = {w: 0.0 for w in view}
    beats: list[tuple[float, int]] = []
    for w in view:
        t = rng.uniform(0, HEARTBEAT_S)
        while t < horizon_s:
            beats.append((t, w))
            t += HEARTBEAT_S
    # what each heartbeat echoes depends on the replies received before it: in time order
    replies: dict[int, list[tuple[float, float]]] = {w: [(0.0, 0.0)] for w in view}  # (receipt, stamp)
    deliveries: list[tuple[float, str, int, float]] = []
    for t, w in sorted(beats):
        got = [r for r in replies[w] if r[0] <= t]
        last_reply, echo = max(r[0] for r in got), max(r[1] for r in got)
        if not cut.connected(w, t) or coordinator_gone(last_reply, t, terms):
            continue  # (in ring mode it echoes nothing: it renews nothing)
        arrive = t + rng.uniform(0, MAX_DELAY_S)
        if not cut.connected(w, arrive):
            continue
        deliveries.append((arrive, "renew", w, arrive if by_receipt else echo))
        back = arrive + rng.uniform(0, MAX_DELAY_S)
        if cut.connected(w, back):
            deliveries.append((back, "reply", w, arrive))
            replies[w].append((back, arrive))
    found = []
    checks = sorted({*(d[0] for d in deliveries), *(i * 0.01 for i in range(int(horizon_s * 100)))})
    pending = sorted(deliveries)
    i = 0
    for now in checks:
        while i < len(pending) and pending[i][0] <= now:
            at, kind, w, stamp = pending[i]
            if kind == "renew":
                renewed[w] = max(renewed[w], stamp)
            else:
                replied[w] = at
            i += 1
        minting = coordinator_may_mint(view, renewed, now, terms)
        ring = [w for w in view if coordinator_gone(replied[w], now, terms)]
        sides = [[w for w in ring if w in cut.away], [w for w in ring if w not in cut.away]]
        if minting and any(side_may_commit(side, view) for side in sides):
            found.append(now)
    return found


cuts = st.builds(
    lambda n, away_bits, start, length: (
        n,
        Cut(frozenset(w for w in range(n) if away_bits >> w & 1), start, start + length),
    ),
    st.integers(min_value=2, max_value=7),
    st.integers(min_value=0, max_value=127),
    st.floats(min_value=0.5, max_value=3.0),
    st.floats(min_value=0.0, max_value=8.0),
)


@settings(max_examples=300, deadline=None)
@given(cut=cuts, seed=st.integers(min_value=0, max_value=2**31))
def test_never_a_minting_coordinator_and_a_committing_ring_at_once(cut, seed) -> None:
    n, c = cut
    terms = LeaseTerms(LEASE_S, MARGIN_S)
    assert conflicts(n, c, seed, terms, horizon_s=c.end_s + 2 * LEASE_S) == []


def test_counting_receipt_times_lets_both_sides_commit() -> None:
    """The mutation the property must catch: renewals at the heartbeat's arrival.  A cut that
    isolates a majority right after a heartbeat arrived, but before its reply came back, finds a
    conflict (the margin only covers clock drift, not that gap); the echoed stamps find none."""
    terms = LeaseTerms(LEASE_S, MARGIN_S)

    def cut(n: int) -> Cut:  # (a majority away)
        return Cut(frozenset(range(n // 2 + 1)), 1.0, 9.0)

    found = [n for n in (3, 5) for s in range(40) if conflicts(n, cut(n), s, terms, 6.0, by_receipt=True)]
    assert found, "no conflict with receipt times: the simulation cannot tell a bad rule"
    assert not [s for n in (3, 5) for s in range(40) if conflicts(n, cut(n), s, terms, 6.0)]


def test_the_margin_covers_clock_drift_only() -> None:
    assert min_margin_s(drift=1e-4, lease_s=10.0) == pytest.approx(2e-3)
    assert min_margin_s(drift=0.0, lease_s=10.0) == 0.0


def test_the_majority_side_goes_on_and_the_minority_side_stops() -> None:
    """Liveness of the rule: a cut that leaves the coordinator with a minority hands the job to
    the majority side (in ring mode) once the lease and margin passed; the other way round the
    coordinator keeps its lease and the cut-off minority never may commit."""
    terms = LeaseTerms(LEASE_S, MARGIN_S)
    view = [0, 1, 2]
    at = 10.0  # long after a cut at 0: the cut-off side heard nothing since
    renewed, replied = {0: at - 0.1, 1: 0.0, 2: 0.0}, {0: at - 0.05, 1: 0.0, 2: 0.0}
    assert not coordinator_may_mint(view, renewed, at, terms)  # 1 of 3 renews: it stops
    ring = [w for w in view if coordinator_gone(replied[w], at, terms)]
    assert ring == [1, 2] and side_may_commit(ring, view)
    renewed = {0: at - 0.1, 1: at - 0.2, 2: 0.0}  # the coordinator keeps 2 of 3
    assert coordinator_may_mint(view, renewed, at, terms)
    assert not side_may_commit([2], view)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2"])
def test_lease_terms_are_checked(bad) -> None:
    with pytest.raises(ValueError, match="LeaseTerms"):
        LeaseTerms(bad, 0.5)
    with pytest.raises(ValueError, match="LeaseTerms"):
        LeaseTerms(2.0, bad)


def test_an_empty_view_has_no_majority() -> None:
    terms = LeaseTerms(LEASE_S, 0.5)
    assert not coordinator_may_mint([], {}, 1.0, terms) and not side_may_commit([1], [])


def test_a_tie_goes_to_the_coordinator_and_only_members_of_the_new_view_count() -> None:
    terms = LeaseTerms(LEASE_S, MARGIN_S)
    renewed = {0: 9.9, 1: 0.0}
    assert coordinator_may_mint([0, 1], renewed, 10.0, terms)  # 1 of 2: the tie
    assert not side_may_commit([1], [0, 1])  # (and the other side's 1 of 2 is no majority)
    view, renewed = [0, 1, 2], {0: 9.9, 1: 9.9, 2: 0.0}
    assert coordinator_may_mint(view, renewed, 10.0, terms, new_members=[0, 1, 7])
    # a fresh member left out of the view to adopt may be on the other side: it does not count
    assert not coordinator_may_mint(view, renewed, 10.0, terms, new_members=[0, 7])
    # a member proven gone counts (it is on no side); a silent one does not
    assert coordinator_may_mint(view, {0: 9.9}, 10.0, terms, new_members=[0], gone=[1])
    assert coordinator_may_mint(view, {}, 10.0, terms, new_members=[7], gone=[0, 1])
    assert not coordinator_may_mint(view, {0: 9.9}, 10.0, terms, new_members=[0])
