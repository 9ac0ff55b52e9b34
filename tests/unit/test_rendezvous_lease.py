"""The lease in the membership machine (``cluster/rendezvous_draft.py``, ``cluster/lease.py``):
the coordinator adopts a view, and acts on silence, only while at least half of the last view
renews its lease (fresh *and* in the view to adopt, or proven gone); a ring view handed back at a
heal is taken over; a worker declared gone hears so.  Driven through ``step`` like the coordinator
does, with the invariants of ``tests/unit/test_rendezvous.py`` checked after every event."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.lease import LeaseTerms
from flotilla.cluster.rendezvous import WorkerState, broken_epoch
from flotilla.cluster.rendezvous_state import IN_PLAY
from tests.unit.test_rendezvous import ACTIONS, POLICY, Sim, apply_action

LEASE = LeaseTerms(lease_s=POLICY.heartbeat_timeout_s, margin_s=0.25)


class LeaseSim(Sim):
    """Three (or ``n``) workers in view 1 under lease terms; each renews when it beats."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n)
        self.s = replace(self.s, config=replace(self.s.config, lease=LEASE))
        self.stamps: dict[int, float] = {}  # worker -> the newest lease stamp it received
        self.beat(*range(n))
        self.beat(*range(n))  # (the second one echoes the first reply's stamp: a renewal)

    def beat(self, *workers: int, renew: bool = True) -> None:
        for w in workers:
            stamp = self.stamps.get(w) if renew else None
            self.apply(ev.Heartbeat(w, self.now, stamp=stamp, runs=self.told.get(w, 0)))
            self.stamps[w] = self.now  # (the reply's lease_t)

    def until(self, t: float, *beating: int) -> None:
        """Advance to ``t`` with ``beating`` workers heartbeating every 0.25 s."""
        while self.now < t:
            self.now = round(self.now + 0.25, 6)
            self.beat(*beating)

    def heartbeat(self, w: int) -> None:  # (apply_action's: renewing two beats in three)
        self.beat(w, renew=int(self.now * 4) % 3 != 0)

    def back(self, w: int, epoch: int, members: tuple[int, ...]) -> ev.Reply:
        return self.apply(ev.RingReturned(w, epoch, members, self.now))

    def state(self, w: int) -> WorkerState:
        return self.s.workers[w].state

    def in_play(self, *workers: int) -> bool:
        return all(self.state(w) in IN_PLAY for w in workers)


def test_a_coordinator_left_with_a_minority_blames_nobody_and_adopts_nothing() -> None:
    sim = LeaseSim()
    assert sim.s.adopted.members == (0, 1, 2)
    sim.until(20.0, 0)  # (1 and 2 are cut off: 15 s of silence, three heartbeat timeouts)
    assert sim.in_play(1, 2) and sim.s.dead() == frozenset()
    # a peer's suspicion is not acted on either, and the report only breaks the epoch
    sim.apply(ev.Suspected(0, (1, 2), 1.0, sim.now))
    assert sim.in_play(1, 2) and broken_epoch(sim.s) == 1
    assert sim.view_of(0) is None  # the failure round stays open: no view without the lease
    sim.until(40.0, 0)
    assert sim.view_of(0) is None and sim.s.adopted_epoch == 1


def test_the_heal_hands_the_ring_view_over_and_the_minority_comes_back_as_newcomers() -> None:
    sim = LeaseSim()
    sim.until(20.0, 0)
    sim.apply(ev.Suspected(0, (1, 2), 1.0, sim.now))
    # the ring side (1, 2: a majority of view 1) went on in its own view 2
    sim.back(1, 2, (1, 2))
    assert sim.s.adopted.members == (1, 2) and sim.s.adopted_epoch == 2 and sim.s.failure is None
    assert sim.state(0) is WorkerState.SUSPECTED
    sim.back(2, 2, (1, 2))  # (the second report of the same view changes nothing)
    assert sim.s.adopted_epoch == 2
    assert sim.view_of(0) is None  # 0 is ready again: a view with it is published, not adopted yet
    assert sim.s.latest.members == (0, 1, 2)
    reply = sim.apply(ev.ViewRequested(1, sim.s.latest_epoch, sim.now))
    assert isinstance(reply, ev.Refused) and reply.code == "no_lease"  # (1, 2 renew nothing yet)
    sim.stamps.pop(1), sim.stamps.pop(2)
    sim.until(sim.now + 0.5, 0, 1, 2)  # back with the coordinator: their heartbeats renew again
    reply = sim.apply(ev.ViewRequested(1, sim.s.latest_epoch, sim.now))
    assert isinstance(reply, ev.ViewReply) and reply.view.members == (0, 1, 2)
    assert reply.view.joined == (0,)  # (it takes the state from a donor, as a newcomer does)
    assert sim.view_of(0) == (0, 1, 2)


def test_a_ring_view_under_an_epoch_the_coordinator_used_is_taken_under_the_next_one() -> None:
    sim = LeaseSim()
    sim.until(20.0, 0)
    sim.join()  # (a newcomer on the coordinator's side: view 2 published, never adopted)
    sim.poll(3)
    assert sim.s.latest_epoch == 2 and sim.s.adopted_epoch == 1
    sim.back(1, 2, (1, 2))
    assert sim.s.views[3].members == (1, 2) and sim.s.adopted_epoch == 3
    assert sim.s.latest.members == (1, 2, 3)  # the newcomer waits for the view after it


def test_a_worker_declared_dead_hears_so_after_the_heal() -> None:
    sim = LeaseSim()
    sim.until(20.0, 0, 1)  # 2 cut off from a coordinator that keeps 0 and 1
    assert sim.state(2) is WorkerState.DEAD
    sim.view_of(0)
    assert sim.view_of(1) == (0, 1) and sim.view_of(0) == (0, 1)
    sim.back(2, 1, (0, 1, 2))  # its ring held (no majority): it reports the view it ran
    assert sim.state(2) is WorkerState.DEAD and sim.s.latest.members == (0, 1)
    reply = sim.poll(2, adopt=True)
    assert isinstance(reply, ev.PollReply) and reply.status is ev.PollStatus.REMOVED


def test_a_tie_goes_to_the_coordinator() -> None:
    sim = LeaseSim(2)
    sim.until(20.0, 0)  # 1 silent: 1 of 2 renews
    assert sim.state(1) is WorkerState.DEAD
    assert sim.view_of(0) == (0,)


def test_proven_deaths_count_and_silent_members_do_not() -> None:
    sim = LeaseSim()
    sim.apply(ev.DeathNoticed(1, sim.now))
    sim.apply(ev.DeathNoticed(2, sim.now))
    assert sim.view_of(0) == (0,)  # 1 fresh + 2 proven gone of 3
    sim = LeaseSim()
    sim.apply(ev.DeathNoticed(1, sim.now))
    sim.until(sim.now + 20.0, 0)  # 2 silent: 0 fresh + 1 proven = 2 of 3 -- enough
    assert sim.state(2) is WorkerState.DEAD and sim.view_of(0) == (0,)


def test_a_fresh_member_left_out_of_the_view_does_not_count() -> None:
    """The lease's second half (``new_members``): members suspected while their lease was still
    fresh may be the other side of a cut, so a view without them needs a majority of its own."""
    sim = LeaseSim()
    sim.until(1.5, 0)  # 1 and 2 silent for 1.5 s: fresh still (lease 5 s), silent to a peer
    sim.apply(ev.Suspected(0, (1, 2), 1.0, sim.now))
    assert sim.state(1) is WorkerState.SUSPECTED and sim.state(2) is WorkerState.SUSPECTED
    assert sim.view_of(0) is None and sim.s.adopted_epoch == 1  # 1 of 3 in the view {0}
    sim.until(sim.now + 10.0, 0)
    assert sim.view_of(0) is None and sim.s.adopted_epoch == 1  # (and later: they renew no more)


def test_an_old_stamp_renews_nothing() -> None:
    """A heartbeat that waited (a frozen coordinator, a slow link) echoes an old stamp: the
    renewal is the stamp, not its arrival."""
    sim = LeaseSim(5)
    old = {w: sim.stamps[w] for w in range(1, 5)}
    sim.until(20.0, 0)
    for w in range(1, 5):  # (what waited in the sockets arrives now)
        sim.apply(ev.Heartbeat(w, sim.now, stamp=old[w]))
    sim.apply(ev.DeathNoticed(1, sim.now))
    assert sim.s.latest.members == (0, 2, 3, 4)
    for w in (0, 2, 3, 4):  # every member of the broken view reports: the round is complete
        sim.poll(w, adopt=True)
    # counted: 0 (fresh) and 1 (proven gone): 2 of 5, so no view; arrivals would have made it 5
    assert sim.s.adopted_epoch == 1 and sim.s.failure is not None
    for w in (2, 3):
        sim.apply(ev.Heartbeat(w, sim.now, stamp=sim.now - 0.25))  # (a reply they really got)
    sim.poll(0, adopt=True)
    assert sim.s.adopted.members == (0, 2, 3, 4)


def test_a_view_some_members_have_not_entered_yet_is_leased_too() -> None:
    """Members adopt a view one by one: while 1 and 2 still run view 1, a cut leaving them on
    one side is a majority of view 1 -- so the coordinator, with 0 and the newcomers 3 and 4
    (three of view 3's five), adopts nothing and blames nobody."""
    sim = LeaseSim()
    for _ in range(2):
        sim.poll(sim.join())
    assert sim.s.latest.members == (0, 1, 2, 3, 4)
    reply = sim.apply(ev.ViewRequested(0, sim.s.latest_epoch, sim.now))  # 0 enters it first
    assert isinstance(reply, ev.ViewReply) and sim.s.adopted.members == (0, 1, 2, 3, 4)
    sim.poll(3), sim.poll(4)
    sim.until(sim.now + 0.5, 0, 1, 2, 3, 4)  # (1 and 2 beat from view 1: they never got view 3)
    sim.told.pop(1), sim.told.pop(2)
    sim.until(sim.now + 20.0, 0, 3, 4)  # the cut: 1 and 2 gone silent
    assert sim.in_play(1, 2) and sim.s.dead() == frozenset()
    sim.apply(ev.Suspected(0, (1, 2), 1.0, sim.now))
    assert sim.in_play(1, 2) and sim.view_of(0) is None
    # once 1 and 2 are known to run view 3 as well, view 1 is no ring's base any more
    sim.told[1] = sim.told[2] = sim.s.adopted_epoch
    sim.beat(1, 2)
    sim.until(sim.now + 20.0, 0, 3, 4)
    assert sim.state(1) is WorkerState.DEAD and sim.state(2) is WorkerState.DEAD


def test_a_worker_proven_gone_that_speaks_again_counts_as_alive() -> None:
    sim = LeaseSim(4)
    sim.apply(ev.Suspected(0, (3,), 1.0, sim.now, closed=True))  # (a reset connection, say)
    assert sim.s.workers[3].proven and sim.state(3) is WorkerState.SUSPECTED
    sim.poll(0, adopt=True), sim.poll(1, adopt=True), sim.poll(2, adopt=True)
    sim.poll(3)  # it was alive: back as a newcomer
    assert not sim.s.workers[3].proven
    epoch = sim.s.latest_epoch
    sim.apply(ev.ViewRequested(0, epoch, sim.now))
    for w in range(4):
        sim.told[w] = epoch
    sim.until(sim.now + 0.5, 0, 1, 2, 3)
    sim.until(sim.now + 20.0, 0)  # a cut: {C, 0} against {1, 2, 3}
    assert sim.s.dead() == frozenset() and sim.view_of(0) is None


RING = st.tuples(
    st.just("ring"), st.integers(0, 5), st.integers(-1, 3), st.sets(st.integers(0, 5), max_size=5)
)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.one_of(ACTIONS.map(lambda a: (*a, 0, frozenset())), RING), max_size=50))
def test_random_interleavings_under_the_lease_keep_the_invariants(actions) -> None:
    """The invariants of ``tests/unit/test_rendezvous.py`` (checked after every event by
    ``Sim.apply``) under lease terms, with heartbeats that renew or not and ring views handed
    back at random (older, equal or newer epochs; any members)."""
    sim = LeaseSim()
    for kind, arg, shift, members in actions:
        w = int(arg)
        if kind != "ring":
            apply_action(sim, kind, arg)
        elif w in sim.s.workers:
            epoch = max(0, sim.s.adopted_epoch + shift)
            sim.apply(ev.RingReturned(w, epoch, tuple(sorted({w, *members})), sim.now))
