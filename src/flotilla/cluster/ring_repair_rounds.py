"""Round machinery of ring repair (``ring_repair.py``), pure: launching, forwarding, returning,
committing and adopting passes, and routing them round the ring.

``ring_repair.py`` decides *which* event happened (a suspicion, an ack, a pass, a commit, a stale
or future message) and calls in here to move a round on; every function is
``(state, ...) -> (state, effects)`` (:data:`Step`) with no I/O, no clock and no threads, and
nothing here imports ``ring_repair.py``.

Invariants (relied on by the handlers and checked by tests/unit/test_ring_repair_properties.py):
- a worker holds at most one outbound pass (``pass_out``) and one outbound commit per epoch;
- a pass is routed to the next live worker of the ring of its members and initiator, restricted
  to the current view (:func:`send_pass` / :func:`send_commit`); with nobody else alive the pass is
  back at once;
- a worker promises (``promised``) every ballot it launches or forwards and records what it
  accepts, one proposal per ballot family; phase 1 reports the highest accepted proposal of
  another round (``prior``), and a returning initiator that heard of one proposes it ``forced``;
- only an ACCEPT that comes back unchanged is committed; :func:`adopt` adopts (or is evicted by) a
  commit at most once per epoch, never goes back, and starts the repair of the new view at once if
  it holds members known dead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from flotilla.cluster.membership import View, merge_since
from flotilla.cluster.ring_repair_messages import (
    ACCEPT,
    COMMIT,
    RECONCILE,
    Adopt,
    Ballot,
    Effect,
    Evicted,
    Message,
    Outbound,
    Proposal,
    RepairState,
    Round,
    Send,
    best,
)

__all__ = ["Step", "adopt", "alive", "forward", "on_return", "progress", "send_commit", "send_pass"]

Step = tuple[RepairState, list[Effect]]
"""A new state and the effects the driver must carry out."""


# ---- rounds --------------------------------------------------------------------------------------


def forward(s: RepairState, m: Message) -> Step:
    """Join ``m``'s round: drop the dead we know (an ACCEPT that loses members becomes a
    RECONCILE: an objection), report our accepted proposal, accept, pass it on."""
    members, kind = m.members, m.kind
    if not m.forced:
        members = alive(s, m.members)
        kind = kind if members == m.members else RECONCILE
    prior = best(m.prior, _accepted_outside(s, m.ballot))
    if kind == ACCEPT:
        s = _accept(s, Proposal(m.ballot, members))
    out = Message(
        kind=kind, sender=s.me, epoch=m.epoch, ballot=m.ballot, members=members, forced=m.forced, prior=prior
    )
    return send_pass(s, out)


def on_return(s: RepairState, m: Message) -> Step:
    """Our pass came back: commit an unchanged ACCEPT, else go round again as ACCEPT."""
    assert s.own is not None
    constraint = best(s.own.constraint, m.prior)
    same = constraint == s.own.constraint
    if m.kind == ACCEPT and same and (m.forced or not s.dead & set(m.members)):
        commit = Message(kind=COMMIT, sender=s.me, epoch=m.epoch, ballot=m.ballot, members=m.members)
        return adopt(s, commit)
    b = s.own.ballot
    s = replace(s, own=Round(ballot=Ballot(b.generation, s.me, b.attempt + 1), constraint=constraint))
    if constraint is not None:
        return _launch(s, ACCEPT, constraint.members, forced=True)
    return _launch(s, ACCEPT, alive(s, m.members), forced=False)


def progress(s: RepairState) -> Step:
    """Initiate a round if we know a member dead and follow no live round."""
    if not s.dead or (s.promised is not None and s.promised.initiator not in s.dead):
        return s, []
    generation = 0 if s.promised is None else s.promised.generation + 1
    ballot = Ballot(generation, s.me, 0)
    s = replace(s, own=Round(ballot=ballot, constraint=_accepted_outside(s, ballot)))
    return _launch(s, RECONCILE, alive(s, s.view.members), forced=False)


# ---- sending -------------------------------------------------------------------------------------


def _launch(s: RepairState, kind: str, members: tuple[int, ...], *, forced: bool) -> Step:
    assert s.own is not None
    b = s.own.ballot
    m = Message(kind=kind, sender=s.me, epoch=s.view.epoch, ballot=b, members=members, forced=forced)
    s = replace(s, promised=b)
    if kind == ACCEPT:
        s = _accept(s, Proposal(b, members))
    return send_pass(s, m)


def send_pass(s: RepairState, m: Message) -> Step:
    dst = _next_hop(s, m.members, m.initiator)
    if dst == s.me:  # nobody else alive on the ring: the pass is back at once
        s = replace(s, pass_out=None)
        return on_return(s, m) if m.initiator == s.me else (s, [])
    return replace(s, pass_out=Outbound(dst=dst, message=m)), [Send(dst, m)]


def send_commit(s: RepairState, m: Message) -> Step:
    """(Re-)send commit ``m`` to the next worker of its ring; one outbound commit per epoch."""
    kept = tuple(o for o in s.commits_out if o.message.epoch != m.epoch)
    dst = _next_hop(s, m.members, m.initiator)
    if dst in (s.me, m.initiator):  # the wave is complete (the initiator adopted first)
        return replace(s, commits_out=kept), []
    m = replace(m, sender=s.me)
    return replace(s, commits_out=(*kept, Outbound(dst=dst, message=m))), [Send(dst, m)]


def adopt(s: RepairState, commit: Message) -> Step:
    """Adopt (or be evicted by) a chosen commit and pass it on; commits of earlier epochs not yet
    acknowledged by a member of the new view keep being re-sent."""
    view = merge_since(s.view, View(epoch=commit.epoch + 1, members=commit.members))
    stay = s.me in commit.members
    s = RepairState(
        me=s.me,
        view=view if stay else s.view,
        dead=s.dead & set(commit.members),
        commits_out=tuple(o for o in s.commits_out if stay and not o.acked and o.dst in commit.members),
        last_commit=commit,
        evicted=None if stay else view,
    )
    s, effects = send_commit(s, commit) if stay or s.me == commit.initiator else (s, [])
    if s.evicted is not None:
        return s, [Evicted(view), *effects]
    s, more = progress(s)  # a forced view may hold members we know dead: repair it at once
    return s, [Adopt(view), *effects, *more]


# ---- helpers -------------------------------------------------------------------------------------


def alive(s: RepairState, members: Iterable[int]) -> tuple[int, ...]:
    return tuple(w for w in members if w not in s.dead)


def _next_hop(s: RepairState, members: tuple[int, ...], initiator: int) -> int:
    """The next worker after us on the ring of ``members`` and the initiator, bypassing the
    dead and those out of our view; ``s.me`` if there is none."""
    ring = sorted((({*members, initiator} - s.dead) & set(s.view.members)) | {s.me})
    return ring[(ring.index(s.me) + 1) % len(ring)]


def _accept(s: RepairState, p: Proposal) -> RepairState:
    kept = tuple(q for q in s.accepted if q.ballot.family != p.ballot.family)
    return replace(s, accepted=(*kept, p))


def _accepted_outside(s: RepairState, ballot: Ballot) -> Proposal | None:
    """Our highest accepted proposal of a round other than ``ballot``'s (phase-1 report)."""
    return best(*(p for p in s.accepted if p.ballot.family != ballot.family))
