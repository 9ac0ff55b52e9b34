"""Ring repair (``cluster/ring_repair.py``), one worker at a time: the message codec and its
validation, ballot order, the split-brain rule, and hand-driven steps (the ring bypass, lowest
initiator wins, retries, refusals that change no state, eviction, takeover).  The whole protocol
under loss and reordering is in ``test_ring_repair_properties.py``."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.membership import View
from flotilla.cluster.ring_repair import awaiting_ack, may_adopt_alone, start, step
from flotilla.cluster.ring_repair_messages import (
    ACCEPT,
    ACK,
    COMMIT,
    KINDS,
    PROBE,
    RECONCILE,
    Adopt,
    Ballot,
    Effect,
    Evicted,
    Message,
    ProbeDue,
    Proposal,
    Received,
    Rejected,
    RepairState,
    RetryDue,
    Send,
    Suspect,
)

VIEW = View(epoch=7, members=(1, 2, 3, 4))


def sends(effects: tuple[Effect, ...], kind: str | None = None) -> list[tuple[int, Message]]:
    return [(e.dst, e.message) for e in effects if isinstance(e, Send) and kind in (None, e.message.kind)]


def pass_msg(kind: str, sender: int, initiator: int, members: tuple[int, ...], **kw: Any) -> Message:
    ballot = Ballot(kw.pop("generation", 0), initiator, kw.pop("attempt", 0))
    return Message(
        kind=kind, sender=sender, epoch=kw.pop("epoch", VIEW.epoch), ballot=ballot, members=members, **kw
    )


# ---- codec ---------------------------------------------------------------------------------------

ids = st.integers(0, 2**31)
members = st.lists(ids, min_size=1, max_size=8, unique=True).map(lambda m: tuple(sorted(m)))


@st.composite
def messages(draw: st.DrawFn) -> Message:
    kind = draw(st.sampled_from(KINDS))
    ballot = Ballot(draw(st.integers(0, 5)), draw(ids), draw(st.integers(0, 9)))
    if kind == ACK:
        acked = draw(st.sampled_from((RECONCILE, ACCEPT, COMMIT)))
        return Message(kind=ACK, sender=draw(ids), epoch=draw(ids), ballot=ballot, acked=acked)
    value = tuple(sorted({*draw(members), ballot.initiator}))
    forced = kind != COMMIT and draw(st.booleans())
    prior = None
    if kind != COMMIT and draw(st.booleans()):
        prior = Proposal(Ballot(ballot.generation + 1, ballot.initiator, 0), draw(members))
    sender = draw(st.sampled_from(value))
    return Message(
        kind=kind, sender=sender, epoch=draw(ids), ballot=ballot, members=value, forced=forced, prior=prior
    )


@given(messages())
@settings(max_examples=200, deadline=None)
def test_messages_survive_msgpack(m: Message) -> None:
    wire = msgpack.packb(m.to_dict())
    assert Message.from_dict(msgpack.unpackb(wire)) == m


GOOD = pass_msg(RECONCILE, 2, 1, (1, 2, 4), prior=Proposal(Ballot(0, 3, 1), (1, 2, 3, 4))).to_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "reconcilee"},
        {"kind": 3},
        {"sender": "2"},
        {"sender": True},
        {"epoch": -1},
        {"epoch": 7.0},
        {"members": [4, 2, 1]},
        {"members": [1, 1, 2]},
        {"members": "124"},
        {"members": []},
        {"attempt": None},
        {"forced": "yes"},
        {"prior": {"generation": 0, "initiator": 3, "attempt": 1}},
        {"prior": {"generation": 0, "initiator": 1, "attempt": 0, "members": [1]}},  # own round
        {"prior": [0, 3, 1, [1]]},
        {"acked": RECONCILE},  # only an ack names an acked kind
        {"sender": 3},  # neither a proposed member nor the initiator
        {"members": [2, 4]},  # an unforced pass without its initiator
        {"extra": 1},
    ],
)
def test_malformed_messages_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Message.from_dict({**GOOD, **change})


@pytest.mark.parametrize(
    "missing", ["kind", "sender", "epoch", "generation", "initiator", "attempt", "members"]
)
def test_a_message_missing_a_field_is_refused(missing: str) -> None:
    with pytest.raises(ValueError):
        Message.from_dict({k: v for k, v in GOOD.items() if k != missing})
    with pytest.raises(ValueError):
        Message.from_dict([("kind", "ack")])  # type: ignore[arg-type]


def test_an_ack_carries_nothing_but_what_it_acknowledges() -> None:
    ack = {**GOOD, "kind": ACK, "members": [], "prior": None, "acked": COMMIT}
    assert Message.from_dict(ack).acked == COMMIT
    for change in ({"acked": ""}, {"acked": ACK}, {"members": [1]}, {"forced": True}):
        with pytest.raises(ValueError):
            Message.from_dict({**ack, **change})


def test_decoding_against_a_view_refuses_other_epochs_and_strangers() -> None:
    assert Message.from_dict(GOOD, view=VIEW).sender == 2
    with pytest.raises(ValueError, match="epoch"):
        Message.from_dict({**GOOD, "epoch": 6}, view=VIEW)
    with pytest.raises(ValueError, match="outside"):
        Message.from_dict({**GOOD, "members": [1, 2, 9]}, view=VIEW)
    with pytest.raises(ValueError, match="outside"):
        Message.from_dict({**GOOD, "sender": 9, "members": [1, 9]}, view=VIEW)


# ---- ballots and the split-brain rule -------------------------------------------------------------


def test_ballot_order() -> None:
    assert Ballot(0, 2, 0).outranks(Ballot(0, 5, 9))  # the lowest initiator wins
    assert Ballot(0, 5, 3).outranks(Ballot(0, 5, 2))  # a later attempt of one round
    assert Ballot(1, 9, 0).outranks(Ballot(0, 0, 9))  # a takeover outranks the void round
    assert Ballot(0, 5, 0).outranks(None) and not Ballot(0, 5, 0).outranks(Ballot(0, 5, 0))


def test_may_adopt_alone_needs_a_strict_majority_of_the_previous_view() -> None:
    assert may_adopt_alone(VIEW, (1, 2, 3))
    assert not may_adopt_alone(VIEW, (1, 2))  # half is not a majority
    assert may_adopt_alone(View(epoch=0, members=(1, 2, 3)), [2, 3])
    assert not may_adopt_alone(View(epoch=0, members=(1, 2, 3)), [3, 9, 10])  # strangers don't count
    assert may_adopt_alone(View(epoch=0, members=(5,)), (5,))


# ---- one worker, by hand ------------------------------------------------------------------------


def test_only_a_member_starts() -> None:
    with pytest.raises(ValueError):
        start(9, VIEW)


def test_the_ring_bypasses_the_dead_and_commits_after_an_unchanged_accept() -> None:
    """Workers 1..4, worker 3 dead: 2 initiates, 4 closes the ring, 1 forwards."""
    s = {w: start(w, VIEW) for w in VIEW.members}
    s[2], eff = step(s[2], Suspect(frozenset({3})))
    [(dst, m)] = sends(eff)
    assert (dst, m.kind, m.members) == (4, RECONCILE, (1, 2, 4))  # bypasses 3
    s[4], eff = step(s[4], Received(m))
    assert [(d, x.kind) for d, x in sends(eff)] == [(2, ACK), (1, RECONCILE)]
    s[1], eff = step(s[1], Received(sends(eff, RECONCILE)[0][1]))
    [(dst, back)] = sends(eff, RECONCILE)
    assert dst == 2
    s[2], eff = step(s[2], Received(back))
    [(dst, accept)] = sends(eff, ACCEPT)
    assert (dst, accept.members, accept.ballot) == (4, (1, 2, 4), Ballot(0, 2, 1))
    s[4], eff = step(s[4], Received(accept))
    s[1], eff = step(s[1], Received(sends(eff, ACCEPT)[0][1]))
    s[2], eff = step(s[2], Received(sends(eff, ACCEPT)[0][1]))
    new = View(epoch=8, members=(1, 2, 4), left=(3,))
    assert Adopt(new) in eff and s[2].view == new
    [(dst, commit)] = sends(eff, COMMIT)
    s[4], eff = step(s[4], Received(commit))
    assert Adopt(new) in eff
    s[1], eff = step(s[1], Received(sends(eff, COMMIT)[0][1]))
    assert Adopt(new) in eff and not sends(eff, COMMIT)  # the wave stops before the initiator
    assert all(x.view == new for x in s.values() if x.me != 3)


def test_a_lone_survivor_adopts_without_a_message() -> None:
    s, eff = step(start(2, VIEW), Suspect(frozenset({1, 3, 4})))
    assert eff == (Adopt(View(epoch=8, members=(2,), left=(1, 3, 4))),)
    assert s.view.members == (2,)


def test_the_lowest_initiator_wins() -> None:
    s4, eff = step(start(4, VIEW), Suspect(frozenset({1})))  # 4 initiates
    assert s4.own is not None
    from_2 = pass_msg(RECONCILE, 3, 2, (2, 3, 4))
    s4, eff = step(s4, Received(from_2))  # a lower initiator: 4 drops its round and joins
    assert s4.own is None and s4.promised == from_2.ballot
    assert [(d, m.kind, m.initiator) for d, m in sends(eff)] == [(3, ACK, 2), (2, RECONCILE, 2)]
    from_3 = pass_msg(RECONCILE, 3, 3, (2, 3, 4))
    s4b, eff = step(s4, Received(from_3))  # a higher initiator: acknowledged and ignored
    assert s4b == s4 and [(d, m.kind) for d, m in sends(eff)] == [(3, ACK)]


def test_retry_resends_only_what_is_unacknowledged() -> None:
    assert not awaiting_ack(start(2, VIEW))  # (the driver's retry timer sleeps)
    s, eff = step(start(2, VIEW), Suspect(frozenset({3})))
    [(dst, m)] = sends(eff)
    assert awaiting_ack(s) and sends(step(s, RetryDue())[1]) == [(dst, m)]
    s, _ = step(s, Received(m.ack(5)))  # not from the destination
    assert awaiting_ack(s) and sends(step(s, RetryDue())[1]) == [(dst, m)]
    s, _ = step(s, Received(m.ack(dst)))
    assert not awaiting_ack(s) and step(s, RetryDue())[1] == ()


def test_a_suspect_of_the_next_hop_reroutes_the_pass() -> None:
    s, eff = step(start(1, VIEW), Received(pass_msg(RECONCILE, 4, 4, (1, 2, 3, 4))))
    assert sends(eff, RECONCILE)[0][0] == 2
    s, eff = step(s, Suspect(frozenset({2})))
    [(dst, m)] = sends(eff)
    assert (dst, m.members) == (3, (1, 3, 4))


def refused(s: RepairState, m: Message) -> list[Rejected]:
    after, effects = step(s, Received(m))
    assert after == s, "a refused message changed the state"
    assert not [e for e in effects if isinstance(e, (Adopt, Evicted))]
    return [e for e in effects if isinstance(e, Rejected)]


def test_forged_and_misplaced_messages_change_nothing() -> None:
    s, _ = step(start(1, VIEW), Received(pass_msg(ACCEPT, 4, 4, (1, 2, 3, 4), attempt=1)))
    cases = {
        "not a member": pass_msg(RECONCILE, 9, 9, (1, 9)),
        "outside": pass_msg(RECONCILE, 2, 2, (1, 2, 9)),
        "future epoch": pass_msg(RECONCILE, 2, 2, (1, 2), epoch=8),
        "stale epoch": pass_msg(RECONCILE, 2, 2, (1, 2), epoch=6),
        "itself": pass_msg(RECONCILE, 1, 2, (1, 2)),
        "excludes": pass_msg(RECONCILE, 2, 2, (2, 3)),
        "accept does not match": pass_msg(ACCEPT, 3, 4, (1, 3, 4), attempt=1),
        "commit does not match": pass_msg(COMMIT, 3, 4, (1, 3, 4), attempt=1),
    }
    for reason, m in cases.items():
        rejections = refused(s, m)
        assert rejections and all(m is r.message for r in rejections), reason
    assert refused(s, pass_msg(COMMIT, 9, 9, (1, 9)))[0].reason.startswith("names workers")


def test_a_worker_known_dead_is_heard_but_not_readmitted() -> None:
    s, _ = step(start(1, VIEW), Suspect(frozenset({2})))
    s, eff = step(s, Received(pass_msg(RECONCILE, 2, 2, (1, 2, 3, 4))))  # 2 woke up
    assert sends(eff, ACK) == [(2, pass_msg(RECONCILE, 2, 2, (1, 2, 3, 4)).ack(1))]
    assert 2 in s.dead and not sends(eff, RECONCILE)  # its round is void for us: not forwarded
    [(_, ours)] = [(d, m) for d, m in sends(step(s, RetryDue())[1])]
    assert 2 not in ours.members


def test_a_void_round_is_taken_over_with_the_next_generation() -> None:
    s, _ = step(start(3, VIEW), Received(pass_msg(ACCEPT, 2, 1, (1, 2, 3), attempt=1)))
    s, eff = step(s, Suspect(frozenset({1})))  # its initiator died
    [(dst, m)] = sends(eff)
    assert m.ballot == Ballot(1, 3, 0) and m.kind == RECONCILE and dst == 2
    assert s.own is not None and s.own.constraint == Proposal(Ballot(0, 1, 1), (1, 2, 3))


def test_a_commit_without_this_worker_evicts_it() -> None:
    commit = pass_msg(COMMIT, 2, 2, (1, 2, 4), attempt=1)
    s, eff = step(start(3, VIEW), Received(commit))
    evicted = View(epoch=8, members=(1, 2, 4), left=(3,))
    assert Evicted(evicted) in eff and not [e for e in eff if isinstance(e, Adopt)]
    assert s.view == VIEW and s.evicted == evicted
    after, eff = step(s, Received(pass_msg(RECONCILE, 2, 2, (2, 3))))
    assert after == s and any(isinstance(e, Rejected) for e in eff)


def test_a_straggler_gets_the_commit_and_a_late_commit_is_only_acknowledged() -> None:
    commit = pass_msg(COMMIT, 2, 2, (1, 2, 4), attempt=1)
    s, _ = step(start(1, VIEW), Received(commit))
    late_pass = pass_msg(RECONCILE, 4, 4, (1, 2, 4))
    _, eff = step(s, Received(late_pass))
    [(dst, m)] = sends(eff)
    assert dst == 4 and m.kind == COMMIT and m.members == commit.members
    after, eff = step(s, Received(commit))
    assert after == s and sends(eff) == [(2, commit.ack(1))]
    conflicting = pass_msg(COMMIT, 2, 2, (1, 2), attempt=1)
    assert refused(s, conflicting)[0].reason.startswith("commit of")


def test_a_worker_that_missed_a_commit_probes_for_it() -> None:
    s = start(1, VIEW)
    ahead = pass_msg(RECONCILE, 2, 2, (1, 2), epoch=8)
    after, eff = step(s, Received(ahead))
    [(dst, probe)] = sends(eff)
    assert after == s and dst == 2 and probe.kind == ACK and probe.epoch == VIEW.epoch
    adopted, _ = step(start(2, VIEW), Received(pass_msg(COMMIT, 4, 4, (1, 2, 4), attempt=1)))
    _, eff = step(adopted, Received(probe))
    assert [(d, m.kind, m.members) for d, m in sends(eff)] == [(1, COMMIT, (1, 2, 4))]


def test_a_probe_never_acknowledges_a_pass_on_its_way_back_to_the_prober() -> None:
    """The ring-fault stall (session 42): 1 initiates, 3 forwards 1's RECONCILE back to it, the
    message is lost; 1's probe (it waits for a view) reaches 3 before 3's retry.  A probe that
    named RECONCILE with 1's first ballot matched 3's pass exactly, 3 took it as delivered and
    never sent it again: 1's round waited for good."""
    s1, eff = step(start(1, VIEW), Suspect(frozenset({2, 4})))
    [(dst, reconcile)] = sends(eff, RECONCILE)
    assert dst == 3 and reconcile.ballot == Ballot(0, 1, 0)
    s3, eff = step(start(3, VIEW), Received(reconcile))
    [(back_to, forwarded)] = sends(eff, RECONCILE)  # (lost on its way)
    assert back_to == 1
    s1, probes = step(s1, ProbeDue())
    assert [(d, m.kind, m.acked) for d, m in sends(probes)] == [(3, ACK, PROBE)]
    s3, eff = step(s3, Received(sends(probes)[0][1]))
    assert eff == () and awaiting_ack(s3)
    assert sends(step(s3, RetryDue())[1]) == [(1, forwarded)]  # sent again: the round goes on
    s1, eff = step(s1, Received(forwarded))
    assert sends(eff, ACCEPT)  # 1 goes round again as ACCEPT


def test_news_while_waiting_resends_the_pass_so_a_silent_eviction_is_found_out() -> None:
    s, eff = step(start(3, VIEW), Received(pass_msg(RECONCILE, 2, 1, (1, 2, 3, 4))))
    [(dst, forwarded)] = sends(eff, RECONCILE)
    s, _ = step(s, Received(forwarded.ack(dst)))
    assert step(s, RetryDue())[1] == ()
    s, eff = step(s, Suspect(frozenset({2})))  # our collective failed: maybe we were left behind
    assert sends(eff) == [(4, forwarded)]
    moved_on, _ = step(start(4, VIEW), Received(pass_msg(COMMIT, 2, 1, (1, 2, 4), attempt=1)))
    _, eff = step(moved_on, Received(forwarded))  # 4 adopted a view without 3: it says so
    s, eff = step(s, Received(sends(eff)[0][1]))
    assert s.evicted is not None and s.evicted.members == (1, 2, 4)


def test_an_unacknowledged_commit_outlives_the_next_adoption() -> None:
    s, eff = step(start(2, VIEW), Received(pass_msg(COMMIT, 1, 1, (1, 2, 3, 4), attempt=1)))
    [(dst, wave)] = sends(eff, COMMIT)
    assert dst == 3
    later = Message(kind=COMMIT, sender=4, epoch=8, ballot=Ballot(0, 4, 1), members=(2, 3, 4))
    s, _ = step(s, Received(later))  # 3 has not acknowledged epoch 7's commit yet
    assert s.view.epoch == 9
    assert (3, wave) in sends(step(s, RetryDue())[1])


def test_a_forced_view_with_dead_members_is_repaired_at_once() -> None:
    """3 accepted 1's proposal, then everybody else dies: alone, 3 must still choose what 1 may
    have chosen (Paxos), and then drops the dead in the next epoch."""
    s, _ = step(start(3, VIEW), Received(pass_msg(ACCEPT, 2, 1, (1, 2, 3), attempt=1)))
    s, eff = step(s, Suspect(frozenset({1, 2, 4})))
    adopted = [e.view for e in eff if isinstance(e, Adopt)]
    assert [(v.epoch, v.members) for v in adopted] == [(8, (1, 2, 3)), (9, (3,))]
    assert not sends(eff) and s.view.members == (3,)
