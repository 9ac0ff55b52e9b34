"""The pure membership/rendezvous state machine and the failure-detection policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.failure import FailurePolicy, check_silence, suspects
from flotilla.cluster.rendezvous import (
    Rendezvous,
    RendezvousConfig,
    WorkerState,
    broken_epoch,
    initial_state,
    reporter,
    standby,
    step,
)

POLICY = FailurePolicy(heartbeat_timeout_s=5.0, report_grace_s=3.0)


class Sim:
    """Drives the machine like the coordinator does and checks the invariants after every event."""

    def __init__(self, num_workers: int = 3, min_workers: int | None = None) -> None:
        self.s: Rendezvous = initial_state(
            RendezvousConfig(min_workers=min_workers or num_workers, policy=POLICY)
        )
        self.now = 0.0
        self.told: dict[int, int] = {}  # worker -> epoch it was last told to meet in
        for _ in range(num_workers):
            self.join()
        for _ in range(2):  # the first view forms at the last one's poll: everybody learns it next
            for w in range(num_workers):
                self.poll(w)

    def apply(self, event: ev.Event) -> ev.Reply:
        before = self.s
        t = step(before, event)
        self.s = t.state
        epochs = [before.latest_epoch] + [v.epoch for v in t.published]
        assert epochs == sorted(set(epochs)), f"epochs must strictly increase: {epochs}"
        assert self.s.adopted_epoch >= before.adopted_epoch
        assert self.s.latest_epoch >= self.s.adopted_epoch
        dead = self.s.dead()
        latest = self.s.latest
        assert latest is None or not dead & set(latest.members), "the latest view holds a dead worker"
        # broken_epoch names the adopted epoch exactly while it is broken
        adopted = self.s.adopted
        is_broken = self.s.failure is not None or (adopted is not None and bool(dead & set(adopted.members)))
        assert broken_epoch(self.s) == (
            (self.s.failure.epoch if self.s.failure is not None else self.s.adopted_epoch) if is_broken else 0
        )
        told = None
        if isinstance(t.reply, ev.PollReply) and t.reply.view is not None:
            told = t.reply.view
            assert told.epoch > event.after_epoch and event.worker_id in told
        elif isinstance(t.reply, ev.ViewReply):
            told = t.reply.view
        if told is not None:
            assert not dead & set(told.members), f"told to meet with dead {dead & set(told.members)}"
            assert self.s.failure is None and told.epoch == self.s.adopted_epoch
            self.told[event.worker_id] = told.epoch
        return t.reply

    def join(self) -> int:
        reply = self.apply(ev.Joined(self.now))
        assert isinstance(reply, ev.Registered)
        return reply.worker_id

    def poll(self, w: int, adopt: bool = False) -> ev.Reply:
        return self.apply(ev.Polled(w, self.told.get(w, 0), adopt, self.now))

    def heartbeat(self, w: int) -> None:
        self.apply(ev.Heartbeat(w, self.now, trained=True))

    def view_of(self, w: int) -> tuple[int, ...] | None:
        reply = self.poll(w, adopt=True)
        assert isinstance(reply, ev.PollReply)
        return reply.view.members if reply.view is not None else None


def test_first_view_from_ready_workers_then_join_and_leave() -> None:
    sim = Sim(num_workers=2)
    first = sim.s.adopted
    assert first is not None and first.members == (0, 1) and sim.s.initial_epoch == first.epoch == 1
    x = sim.join()
    assert sim.s.latest_epoch == 1  # joining alone changes nothing
    assert sim.poll(x) == ev.PollReply(ev.PollStatus.WAIT)  # ready: view 2 published, not adopted
    reply = sim.apply(ev.ViewRequested(0, 2, sim.now))  # the survivors voted for epoch 2
    assert isinstance(reply, ev.ViewReply) and reply.view.joined == (x,)
    reply = sim.poll(x)
    assert isinstance(reply, ev.PollReply) and reply.view is not None and not reply.initial
    assert sim.apply(ev.LeaveRequested(1, sim.now)) == ev.EpochReply(3)
    assert sim.s.latest is not None and sim.s.latest.members == (0, x) and sim.s.latest.left == (1,)
    assert sim.poll(1, adopt=True) == ev.PollReply(ev.PollStatus.REMOVED)
    assert sim.apply(ev.LeaveRequested(1, sim.now)) == ev.EpochReply(3)  # no-op: same epoch


def test_a_finished_leave_makes_the_worker_done_and_changes_nothing_for_the_gone() -> None:
    sim = Sim(num_workers=3)
    assert sim.apply(ev.LeaveRequested(1, sim.now, finished=True)) == ev.EpochReply(2)
    assert sim.s.workers[1].state is WorkerState.DONE
    assert sim.s.latest is not None and sim.s.latest.members == (0, 2)
    sim.apply(ev.Exited(1, sim.now))  # its process exits 0 afterwards: still done
    assert sim.s.workers[1].state is WorkerState.DONE and sim.s.latest_epoch == 2
    sim.apply(ev.DeathNoticed(2, sim.now))
    assert sim.apply(ev.LeaveRequested(2, sim.now, finished=True)) == ev.EpochReply(sim.s.latest_epoch)
    assert sim.s.workers[2].state is WorkerState.DEAD  # a dead worker's late word changes nothing


def test_failure_before_death_notice_waits_for_the_notice() -> None:
    sim = Sim(num_workers=3)
    assert sim.view_of(0) is None and sim.view_of(1) is None  # worker 2 silent, not known dead
    sim.apply(ev.DeathNoticed(2, sim.now))
    assert sim.view_of(0) == sim.view_of(1) == (0, 1)
    assert sim.s.adopted_epoch == 2 and sim.s.workers[2].state is WorkerState.DEAD


def test_timeout_without_death_meets_in_a_fresh_epoch_with_the_same_members() -> None:
    sim = Sim(num_workers=2)
    assert sim.view_of(0) is None
    assert sim.view_of(1) == (0, 1) and sim.s.adopted_epoch == 2


def test_grace_suspects_a_hung_member_which_comes_back_as_a_newcomer() -> None:
    sim = Sim(num_workers=3)
    assert sim.view_of(0) is None
    sim.now += 2.0
    assert sim.view_of(1) is None  # the grace runs from the first report
    sim.now += 1.0
    assert sim.view_of(0) == (0, 1) and sim.s.workers[2].state is WorkerState.SUSPECTED
    assert sim.view_of(2) is None  # ready again: in the latest view, waits for the vote
    assert sim.s.latest is not None and sim.s.latest.members == (0, 1, 2)


def test_silence_kills_unless_the_checker_itself_stalled() -> None:
    seen = {0: 0.0, 1: 4.0}
    assert check_silence(POLICY, last_check_s=4.0, now_s=6.0, last_seen_s=seen).dead == {0}
    stalled = check_silence(POLICY, last_check_s=0.0, now_s=6.0, last_seen_s=seen)
    assert stalled.stalled and not stalled.dead
    assert suspects(POLICY, opened_s=0.0, now_s=2.9, pending=[1]) == frozenset()
    assert suspects(POLICY, opened_s=0.0, now_s=3.0, pending=[1]) == {1}
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        FailurePolicy(heartbeat_timeout_s=0, report_grace_s=1)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(2, 4))
def test_survivors_meet_as_soon_as_every_member_is_accounted_for(data: st.DataObject, n: int) -> None:
    """Any order of survivors' reports and death notices: no view until all are in, then one."""
    sim = Sim(num_workers=n)
    dead = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))
    survivors = sorted(set(range(n)) - dead)
    events = data.draw(st.permutations([("report", w) for w in survivors] + [("death", w) for w in dead]))
    for i, (kind, w) in enumerate(events):
        if kind == "death":
            sim.apply(ev.DeathNoticed(w, sim.now))
        else:
            got = sim.view_of(w)
            assert got is None or i == len(events) - 1, "a view formed before all were accounted for"
    for w in survivors:  # those that reported before the last event poll again, as workers do
        if sim.told[w] == 1:
            assert sim.view_of(w) == tuple(survivors)
    final = sim.s.adopted
    assert final is not None and final.members == tuple(survivors) and final.left == tuple(sorted(dead))
    assert {sim.told[w] for w in survivors} == {final.epoch}


ACTIONS = st.one_of(
    st.tuples(
        st.sampled_from(["report", "poll", "death", "heartbeat", "leave", "get_view", "exit", "suspect"]),
        st.integers(0, 5),
    ),
    st.tuples(st.just("advance"), st.floats(0.0, 4.0)),
    st.tuples(st.sampled_from(["join", "tick", "finish"]), st.just(0)),
)


def apply_action(sim: Sim, kind: str, arg: float) -> None:
    """One of ``ACTIONS`` (also driven by ``tests/unit/test_rendezvous_lease.py``)."""
    w = int(arg)
    if kind == "advance":
        sim.now += arg
    elif kind == "join":
        sim.apply(ev.Joined(sim.now))
    elif kind == "tick":
        sim.apply(ev.Tick(sim.now))
    elif kind == "finish":
        sim.apply(ev.Finished(sim.now))
    elif w not in sim.s.workers:
        return
    elif kind in ("report", "poll"):
        sim.poll(w, adopt=kind == "report")
    elif kind == "death":
        sim.apply(ev.DeathNoticed(w, sim.now))
    elif kind == "suspect":  # w's neighbours (by id) suspect it
        sim.apply(ev.Suspected((w + 1) % 3, (w,), 1.0, sim.now))
    elif kind == "heartbeat":
        sim.heartbeat(w)
    elif kind == "leave":
        sim.apply(ev.LeaveRequested(w, sim.now))
    elif kind == "exit":
        sim.apply(ev.Exited(w, sim.now))
    elif kind == "get_view":
        reply = sim.apply(ev.ViewRequested(w, sim.s.latest_epoch, sim.now))
        assert isinstance(reply, ev.ViewReply | ev.Refused)


@settings(max_examples=80, deadline=None)
@given(st.lists(ACTIONS, max_size=50))
def test_random_interleavings_keep_the_invariants(actions: list[tuple[str, float]]) -> None:
    sim = Sim(num_workers=3, min_workers=2)  # Sim.apply checks the invariants after each event
    for kind, arg in actions:
        apply_action(sim, kind, arg)


def test_a_known_death_breaks_the_adopted_epoch_for_late_votes() -> None:
    sim = Sim(num_workers=3)
    sim.apply(ev.DeathNoticed(0, sim.now))  # worker 0 (id 0: falsy, on purpose) is gone
    reply = sim.apply(ev.ViewRequested(1, sim.s.latest_epoch, sim.now))
    assert isinstance(reply, ev.Refused) and reply.code == "view_broken"  # counts as 1's report
    assert sim.view_of(2) == (1, 2)
    assert sim.view_of(1) == (1, 2)


def test_a_silent_suspect_is_out_at_once_and_comes_back_as_a_newcomer() -> None:
    sim = Sim(num_workers=3)
    sim.now += 0.5
    sim.apply(ev.Heartbeat(0, sim.now, trained=True))
    sim.apply(ev.Heartbeat(1, sim.now, trained=True))  # worker 2 froze at 0.0
    assert sim.apply(ev.Suspected(1, (2,), 0.375, sim.now)) == ev.EpochReply(2)
    assert sim.s.workers[2].state is WorkerState.SUSPECTED and broken_epoch(sim.s) == 1
    assert sim.view_of(0) == (0, 1)  # no grace to wait out: 1 reported with its suspicion
    assert sim.view_of(1) == (0, 1)
    sim.now += 5.0
    assert sim.view_of(2) is None  # it woke up: ready again, in the latest view as a newcomer
    assert sim.s.latest is not None and sim.s.latest.members == (0, 1, 2) and sim.s.latest.joined == (2,)


def test_a_suspect_that_still_heartbeats_is_left_alone() -> None:
    sim = Sim(num_workers=3)
    sim.now += 0.5
    for w in (0, 1, 2):
        sim.apply(ev.Heartbeat(w, sim.now, trained=True))
    sim.now += 0.1
    assert sim.apply(ev.Suspected(1, (2,), 0.375, sim.now)) == ev.EpochReply(1)
    assert sim.s.workers[2].state is WorkerState.TRAINING and broken_epoch(sim.s) == 0
    assert sim.apply(ev.Suspected(9, (2,), 0.375, sim.now)) == ev.Refused(
        "unknown_worker", "worker 9 never joined"
    )
    assert sim.apply(ev.Suspected(1, (1,), 0.0, sim.now + 9)) == ev.EpochReply(1)  # nobody suspects itself


def test_a_closed_connection_is_proof_and_needs_no_silence() -> None:
    sim = Sim(num_workers=3)
    sim.now += 0.5
    for w in (0, 1, 2):
        sim.apply(ev.Heartbeat(w, sim.now, trained=True))  # 2 heartbeated just now, then died
    sim.now += 0.01
    assert sim.apply(ev.Suspected(1, (2,), 0.375, sim.now, closed=True)) == ev.EpochReply(2)
    assert sim.s.workers[2].state is WorkerState.SUSPECTED and broken_epoch(sim.s) == 1
    assert sim.view_of(0) == (0, 1)
    assert sim.view_of(1) == (0, 1)
    # a worker that already left is not in play: a late "closed" report changes nothing
    sim.apply(ev.LeaveRequested(0, sim.now))
    before = sim.s.latest_epoch
    sim.apply(ev.Suspected(1, (2,), 0.375, sim.now, closed=True))
    assert sim.s.latest_epoch == before


def test_a_view_whose_every_member_died_is_replaced_by_the_ready_newcomers() -> None:
    sim = Sim(num_workers=2)
    x = sim.join()
    assert sim.poll(x) == ev.PollReply(ev.PollStatus.WAIT)  # ready, waiting for the others' vote
    sim.apply(ev.DeathNoticed(0, sim.now))  # both members die: nobody is left to report
    sim.apply(ev.DeathNoticed(1, sim.now))
    reply = sim.poll(x)  # the newcomer is handed a view at once (it finds no replica, and says so)
    assert isinstance(reply, ev.PollReply) and reply.view is not None and reply.view.members == (x,)
    assert reply.view.left == (0, 1) and reply.view.joined == (x,)


def test_a_view_is_not_replaced_while_a_member_lives() -> None:
    sim = Sim(num_workers=2)
    x = sim.join()
    sim.poll(x)
    sim.apply(ev.DeathNoticed(1, sim.now))  # 0 lives: it reports, and the failure round decides
    assert sim.poll(x) == ev.PollReply(ev.PollStatus.WAIT)
    assert sim.view_of(0) == (0, x)


# ---------------------------------------------------------------------- barrier-free members
# A strategy without a barrier and with fixed membership (partial_reduce) never waits for a view:
# between two units it sends ONE poll (``CoordinatedMembership.catch_up``): a failure report
# (adopt) while its epoch is broken, else a plain poll once a newer view exists; on ``wait`` it
# trains on.  These tests drive the machine that way and check that the failure round closes
# without suspecting anyone alive, however long the survivors' units take (within the grace).


def _catch_up(sim: Sim, w: int, *, broken: bool) -> tuple[int, ...] | None:
    """One barrier-free boundary of worker ``w``: the view it runs next (None: still the old one)."""
    reply = sim.poll(w, adopt=broken)
    assert isinstance(reply, ev.PollReply) and reply.status in (ev.PollStatus.VIEW, ev.PollStatus.WAIT)
    return reply.view.members if reply.view is not None else None


def _training(n: int) -> Sim:
    sim = Sim(num_workers=n)
    for w in range(n):
        sim.apply(ev.Heartbeat(w, sim.now, trained=True))
    return sim


def test_barrier_free_survivors_report_between_units_and_nobody_alive_is_suspected() -> None:
    sim = _training(4)
    sim.apply(ev.DeathNoticed(3, sim.now))
    assert broken_epoch(sim.s) == 1
    sim.now += 0.1
    assert _catch_up(sim, 0, broken=True) is None  # reported; trains on (no wait)
    sim.now += POLICY.report_grace_s * 0.9  # a long unit, still within the grace
    assert _catch_up(sim, 0, broken=True) is None  # its next boundary: still waiting for 1 and 2
    assert _catch_up(sim, 1, broken=True) is None
    assert _catch_up(sim, 2, broken=True) == (0, 1, 2)  # the last report closes the round
    assert _catch_up(sim, 0, broken=True) == (0, 1, 2) and _catch_up(sim, 1, broken=True) == (0, 1, 2)
    assert broken_epoch(sim.s) == 0 and sim.s.adopted_epoch == 2
    assert {w: sim.s.workers[w].state for w in (0, 1, 2)} == dict.fromkeys((0, 1, 2), WorkerState.TRAINING)
    sim.now += POLICY.report_grace_s * 2  # long after: nobody is suspected later either
    sim.apply(ev.Tick(sim.now))
    assert sim.s.adopted is not None and sim.s.adopted.members == (0, 1, 2)


def test_a_round_closed_between_two_heartbeats_is_caught_up_with_by_a_plain_poll() -> None:
    sim = _training(3)
    # worker 0's peer watch found worker 2's process gone (a report of 0), then worker 1 reported:
    # the round closed before worker 0 ever heard its epoch was broken -- it sees a newer epoch
    sim.apply(ev.Suspected(0, (2,), 0.375, sim.now, closed=True))
    assert _catch_up(sim, 1, broken=True) == (0, 1)
    assert broken_epoch(sim.s) == 0
    assert _catch_up(sim, 0, broken=False) == (0, 1)


def test_a_plain_poll_on_a_newer_unadopted_view_opens_no_failure_round() -> None:
    sim = _training(3)
    sim.apply(ev.Exited(2, sim.now))  # finished normally: a newer latest view, nothing broken
    assert sim.s.latest_epoch == 2 and sim.s.adopted_epoch == 1
    for w in (0, 1):
        assert _catch_up(sim, w, broken=False) is None
    assert sim.s.failure is None and broken_epoch(sim.s) == 0
    sim.now += POLICY.report_grace_s * 2
    sim.apply(ev.Tick(sim.now))
    assert all(sim.s.workers[w].state is WorkerState.TRAINING for w in (0, 1))


def test_a_reporter_is_named_only_once_nobody_trains_and_the_job_has_no_result() -> None:
    """Rank 0 died at the very end, after the others said they were done: the lowest done worker
    whose process runs reports the result (``rendezvous.reporter``); never while anyone trains,
    joins or is suspected, nor after the job finished or stopped."""
    sim = _training(4)
    for w in (1, 2, 3):
        sim.apply(ev.LeaveRequested(w, sim.now, finished=True))
    assert reporter(sim.s, frozenset()) is None  # (rank 0 still trains: it reports)
    sim.apply(ev.DeathNoticed(0, sim.now))
    assert reporter(sim.s, frozenset()) == 1
    assert reporter(sim.s, frozenset({1})) == 2  # (worker 1's process ended too)
    assert reporter(sim.s, frozenset({1, 2, 3})) is None
    joiner = sim.join()
    assert reporter(sim.s, frozenset()) is None  # (a joiner may still train: it is expected)
    sim.apply(ev.DeathNoticed(joiner, sim.now))
    assert reporter(sim.s, frozenset()) == 1
    sim.apply(ev.Finished(sim.now))
    assert reporter(sim.s, frozenset()) is None


def test_the_standby_is_the_last_worker_to_finish_whose_process_runs() -> None:
    """Where finished workers leave at once (the parameter server), one stays ready to report the
    job's result should the worker due to die first (``rendezvous.standby``): none while others
    still train (each finisher leaves: a worker held for the others' remaining training would
    waste its machine), then -- with only the one due to report left to talk -- the last to
    finish; the one before it if its process ended; none once the job finished or stopped.
    Once rank 0 is gone it is the one :func:`reporter` names."""
    sim = _training(4)
    assert standby(sim.s, frozenset()) is None  # (nobody finished yet)
    for w in (2, 1):  # (finish order: 2, 1, then 3; worker 0 reports and never says done)
        sim.now += 1.0
        sim.apply(ev.LeaveRequested(w, sim.now, finished=True))
        assert standby(sim.s, frozenset()) is None  # (worker 3 still trains: 2 and 1 leave)
    sim.now += 1.0
    sim.apply(ev.LeaveRequested(3, sim.now, finished=True))
    assert standby(sim.s, frozenset({1, 2})) == 3  # (only worker 0 left to talk: 3 stands by)
    sim.now += 1.0
    sim.apply(ev.LeaveRequested(3, sim.now, finished=True))  # (sent again: changes nothing)
    assert sim.s.workers[3].done_s == sim.now - 1.0 and standby(sim.s, frozenset()) == 3
    assert standby(sim.s, frozenset({3})) == 1 and standby(sim.s, frozenset({1, 2, 3})) is None
    joiner = sim.join()  # (a newcomer expected to train: nobody stands by until it finishes)
    assert standby(sim.s, frozenset({1, 2})) is None
    sim.apply(ev.DeathNoticed(joiner, sim.now))
    sim.apply(ev.DeathNoticed(0, sim.now))  # (rank 0 died before it reported: 2 and 1 had left)
    assert reporter(sim.s, frozenset({1, 2})) == standby(sim.s, frozenset({1, 2})) == 3
    sim.apply(ev.Finished(sim.now))
    assert standby(sim.s, frozenset()) is None
