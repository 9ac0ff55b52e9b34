"""Ring repair (SPEC §7, Spotnik's RECONCILE/ACCEPT), pure: one worker's state machine.

``step(state, event) -> (state, effects)``.  Events: ``Suspect`` (local detection), ``Received``
(a message), ``RetryDue`` (the driver's timer: re-send what is unacknowledged), ``ProbeDue``
(the driver's probe timer while it waits for a view: ask the others).  Effects:
``Send``, ``Adopt`` (run the new view), ``Evicted`` (the view was chosen without us: rejoin as a
newcomer), ``Rejected`` (a refused message, for the log).  No I/O, no clock, no threads: the
driver (messages over the message plane, timers, failure detection) lives elsewhere.  Data types
are in ``ring_repair_messages.py``; the round machinery (launching, forwarding, committing and
adopting passes, ring routing) is in ``ring_repair_rounds.py``; this module holds the event
handlers.

The protocol.  The ring of view E is its members in ``worker_id`` order.  A worker that learns a
member is dead (typically its successor) and follows no live round *initiates* one: it sends
RECONCILE(members minus the dead) to the next live worker, bypassing the dead.  A receiver drops
every worker it knows dead (and learns those the message dropped), bypasses its own dead
successor and forwards; when a send fails the driver reports ``Suspect`` and the sender re-routes.
Back at the initiator, the members go round again as ACCEPT; a worker that still knows a
proposed member dead objects (turns it back into a RECONCILE without that member).  An ACCEPT that
comes back unchanged is *chosen*: the initiator adopts it and circulates COMMIT; every member
adopts it (epoch E+1, ``left`` = the removed members) and forwards it.  Three ring traversals
when nothing else happens (RECONCILE, ACCEPT, COMMIT), every hop acknowledged (ACK).

Probes.  A worker that waits for a view asks the other live members of its view, now and then
(``ProbeDue``), with an ACK that acknowledges nothing (``acked=PROBE``); one that has moved on
answers with the commit that ended that epoch, so a worker the others evicted, or that missed a
commit, learns it at once.  A probe never counts as the acknowledgement of a pass: an ACK naming
the kind it acknowledges would match a pass of the prober's own round on its way back to it
(the same sender, epoch, ballot and kind), and a matched pass is never sent again -- lost once,
the round waited for good (the ring-fault stall of issue 37, found in session 42).

Concurrent initiators.  Passes carry ballots ``(generation, initiator, attempt)``; a worker
promises the highest ballot it has forwarded and ignores (acknowledges, drops) lower ones, so
within a generation the **lowest initiator id wins**: its passes are never blocked, and every
other round is blocked at the latest at the winner, which follows its own round.  A round whose
initiator is known dead is void; a worker left with a void promise takes over with the next
generation (which outranks the void round, so promises are never broken).

Why three traversals (a deviation from Spotnik's two).  Adopting on the first ACCEPT is unsafe when
a failure hits the repair itself: if the initiator dies right after deciding, a worker that had
forwarded the final RECONCILE may start a round of its own that completes with other members
ahead of the ACCEPT wave -- two views for one epoch.  Here RECONCILE is Paxos' phase 1 (promise,
and report in ``prior`` the highest proposal of another round accepted on the way), ACCEPT is
phase 2, and an initiator that hears of an accepted proposal of another round proposes that
proposal's members (``forced``: never shrunk on the way) instead of its own.  So a chosen view is
the only one any later round can choose; dead members of a forced view are removed by the next
epoch's repair.

Invariants (tests/unit/test_ring_repair_properties.py checks them under loss, duplication and
reordering): with a correct failure detector, all workers that adopt a view for epoch E+1 adopt
the same members, even when more workers die during the repair (with a wrong one: among the views
the split-brain rule below lets run); a worker adopts at most once per epoch and never goes back
(a worker that missed commits may jump to a later view); a refused message changes no state;
without further failures the survivors adopt the previous members minus the dead, in O(N·K)
messages for K revocations among N workers (measured: under 4.2·N·(K+1), acks included).

Assumptions.  Messages are authenticated by the message plane (a sender is who it says) and a
message sent again and again eventually arrives.  The driver reports a dead neighbour sooner or
later (a failed send, the neighbour watch): that is how a pass held by a worker that died is
re-sent.  The failure detector may be wrong: a suspected live worker is dropped from the view and
learns it (``Evicted``) when it next talks to an adopter.  A repair never re-admits anybody
(members only shrink): a frozen worker that wakes up is heard (what it says may carry news) but
stays out, and rejoins as a newcomer by another path.  Safety with a wrong detector needs the
split-brain rule: ``may_adopt_alone(previous, members)`` -- a view formed
without the coordinator's confirmation must hold a strict majority of the previous view's
members; the driver holds back an ``Adopt`` that fails it until the coordinator confirms it (two
disjoint majorities cannot exist, so two sides that suspect each other cannot both go on alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from flotilla.cluster.membership import View
from flotilla.cluster.ring_repair_messages import (
    ACCEPT,
    ACK,
    COMMIT,
    PROBE,
    RECONCILE,
    Ballot,
    Effect,
    Event,
    Message,
    Outbound,
    ProbeDue,
    Received,
    Rejected,
    RepairState,
    RetryDue,
    Send,
    Suspect,
    outside,
)
from flotilla.cluster.ring_repair_rounds import (
    Step,
    adopt,
    alive,
    forward,
    on_return,
    progress,
    send_commit,
    send_pass,
)

__all__ = ["awaiting_ack", "may_adopt_alone", "start", "step"]


def may_adopt_alone(previous: View, proposed: Iterable[int]) -> bool:
    """Split-brain rule: may a view of ``proposed`` members be run without the coordinator's
    confirmation?  Only if it holds a strict majority of ``previous``'s members."""
    kept = set(proposed) & set(previous.members)
    return 2 * len(kept) > len(previous.members)


def start(me: int, view: View) -> RepairState:
    """The state of member ``me`` running ``view``."""
    if me not in view:
        raise ValueError(f"worker {me} is not a member of view {view.epoch}")
    return RepairState(me=me, view=view)


def step(state: RepairState, event: Event) -> tuple[RepairState, tuple[Effect, ...]]:
    """Apply one event; returns the new state and what the driver must do."""
    if isinstance(event, RetryDue):
        return state, tuple(_retry(state))
    if isinstance(event, ProbeDue):
        return state, tuple(_probe(state))
    if isinstance(event, Received) and event.message.kind == ACK:
        return _on_ack(state, event.message)
    if state.evicted is not None:
        if not isinstance(event, Received):
            return state, ()
        return state, tuple(_on_evicted(state, event.message))
    if isinstance(event, Suspect):
        s, effects = _on_suspect(state, event.worker_ids)
    else:
        s, effects = _on_message(state, event.message)
    if s.evicted is None:
        s, more = progress(s)
        effects += more
    return s, tuple(effects)


# ---- events --------------------------------------------------------------------------------------


def awaiting_ack(s: RepairState) -> bool:
    """Is anything sent still unacknowledged (would ``RetryDue`` re-send something)?"""
    return any(o is not None and not o.acked for o in (s.pass_out, *s.commits_out))


def _retry(s: RepairState) -> list[Effect]:
    return [Send(o.dst, o.message) for o in (s.pass_out, *s.commits_out) if o and not o.acked]


def _probe(s: RepairState) -> list[Effect]:
    """Ask the other live members of our view whether they moved on without us (module doc)."""
    if s.evicted is not None:
        return []
    ballot = Ballot(generation=0, initiator=s.me, attempt=0)  # (names no pass: acked=PROBE)
    ask = Message(kind=ACK, sender=s.me, epoch=s.view.epoch, ballot=ballot, acked=PROBE)
    return [Send(w, ask) for w in s.view.members if w != s.me and w not in s.dead]


def _on_ack(s: RepairState, ack: Message) -> tuple[RepairState, tuple[Effect, ...]]:
    """Mark what ``ack`` acknowledges.  An ack of a pass of an epoch we have left (a late one, or
    the probe of a worker that missed our commit) is answered with that commit; a probe of our
    own epoch changes nothing (it acknowledges nothing: module doc)."""
    if ack.epoch < s.view.epoch and ack.acked != COMMIT:
        return s, tuple(_on_stale(s, ack))
    if ack.acked == PROBE:
        return s, ()

    def matches(o: Outbound) -> bool:
        m = o.message
        return (ack.sender, ack.epoch, ack.ballot, ack.acked) == (o.dst, m.epoch, m.ballot, m.kind)

    if s.pass_out and matches(s.pass_out):
        s = replace(s, pass_out=replace(s.pass_out, acked=True))
    commits = tuple(replace(o, acked=True) if matches(o) else o for o in s.commits_out)
    return replace(s, commits_out=commits), ()


def _on_suspect(s: RepairState, ids: Iterable[int]) -> Step:
    """Local detection.  News while our pass has already left (acknowledged) re-sends it: the
    next worker ignores a duplicate, but if it has moved on it answers with its commit, so a
    worker that the others evicted without telling it finds out."""
    before = s.dead
    s, effects = _learn(s, frozenset(ids))
    o = s.pass_out
    if s.dead != before and not effects and o is not None and o.acked and s.view.epoch == o.message.epoch:
        s = replace(s, pass_out=replace(o, acked=False))
        effects = [Send(o.dst, o.message)]
    return s, effects


def _learn(s: RepairState, ids: frozenset[int]) -> Step:
    """Add members to ``dead`` and re-route whatever was on its way to one of them."""
    new = (ids & set(s.view.members)) - {s.me} - s.dead
    if not new:
        return s, []
    s = replace(s, dead=s.dead | new)
    effects: list[Effect] = []
    for o in s.commits_out:
        if o.dst in new:
            s, more = send_commit(s, o.message)
            effects += more
    if s.pass_out and s.pass_out.dst in new:
        m = s.pass_out.message
        s = replace(s, pass_out=None)
        if m.initiator in s.dead:  # a void round: nothing to re-route
            return s, effects
        if not m.forced:
            kept = alive(s, m.members)
            m = replace(m, kind=RECONCILE if kept != m.members else m.kind, members=kept)
        s, more = send_pass(s, m)
        effects += more
    return s, effects


def _on_message(s: RepairState, m: Message) -> Step:
    if m.sender == s.me:
        return s, [Rejected("a message from this worker itself", m)]
    if m.epoch > s.view.epoch:
        return _on_future(s, m)
    if m.epoch < s.view.epoch:
        return s, _on_stale(s, m)
    problem = outside(m, s.view)  # a sender we think dead is heard (it stays out of the view)
    if problem:
        return s, [Rejected(problem, m)]
    return _on_commit(s, m) if m.kind == COMMIT else _on_pass(s, m)


def _on_stale(s: RepairState, m: Message) -> list[Effect]:
    """A message of an epoch we have left: acknowledge a commit (we adopted it, or a later one),
    answer anything else with the commit that ended our previous epoch (the sender adopts it,
    or learns it was evicted)."""
    last = s.last_commit
    if m.kind == COMMIT:
        if last and m.epoch == last.epoch and m.members != last.members:
            return [Rejected(f"commit of {m.members} conflicts with the adopted {last.members}", m)]
        return [Send(m.sender, m.ack(s.me))]
    if last is None or s.evicted is not None:
        return [Rejected(f"stale epoch {m.epoch} (this worker runs {s.view.epoch})", m)]
    return [Send(m.sender, replace(last, sender=s.me))]


def _on_evicted(s: RepairState, m: Message) -> list[Effect]:
    """Acknowledge a commit; answer a pass with the commit that evicted us (its sender may be
    out of that view too)."""
    if m.kind == COMMIT:
        return [Send(m.sender, m.ack(s.me))]
    answer = [Send(m.sender, replace(s.last_commit, sender=s.me))] if s.last_commit else []
    return [*answer, Rejected("evicted: rejoin as a newcomer", m)]


def _on_future(s: RepairState, m: Message) -> Step:
    """A message of an epoch we never ran: we missed a commit.  A commit is adopted at once (it
    may skip views: members only shrink), or evicts us; a pass is answered with a probe (an ack
    stamped with our epoch) that makes the sender send us its commit."""
    if m.kind == COMMIT:
        strangers = set(m.members) - set(s.view.members)
        return adopt(s, m) if not strangers else (s, [Rejected(f"commit names strangers {strangers}", m)])
    probe = Message(kind=ACK, sender=s.me, epoch=s.view.epoch, ballot=m.ballot, acked=m.kind)
    why = f"future epoch {m.epoch} (this worker runs {s.view.epoch})"
    return s, [Send(m.sender, probe), Rejected(why, m)]


def _on_commit(s: RepairState, m: Message) -> Step:
    mine = [p for p in s.accepted if p.ballot == m.ballot]
    if mine and mine[0].members != m.members:
        return s, [Rejected(f"commit does not match the proposal {mine[0].members} it names", m)]
    s, effects = adopt(s, m)
    return s, [Send(m.sender, m.ack(s.me)), *effects]


def _on_pass(s: RepairState, m: Message) -> Step:
    me, b = s.me, m.ballot
    if me not in m.members and b.initiator != me:
        return s, [Rejected("the proposal excludes this worker", m)]
    mine = [p for p in s.accepted if p.ballot == b]
    if m.kind == ACCEPT and mine and mine[0].members != m.members:
        return s, [Rejected(f"accept does not match the proposal {mine[0].members} it names", m)]
    effects: list[Effect] = [Send(m.sender, m.ack(me))]
    if not m.forced:  # intersect: learn whom the sender's side knows dead
        s, more = _learn(s, frozenset(s.view.members) - set(m.members))
        effects += more
        if s.view.epoch != m.epoch or s.evicted:  # re-routing our own pass finished it
            return s, effects
    if b.initiator in s.dead:  # a void round: the takeover happens in progress
        return s, effects
    if b.initiator == me:
        if s.own is not None and b == s.own.ballot:
            s, more = on_return(s, m)
            effects += more
        return s, effects
    if not b.outranks(s.promised):  # a duplicate, or a round that lost to the one we follow
        return s, effects
    s, more = forward(replace(s, promised=b, own=None), m)
    return s, effects + more
