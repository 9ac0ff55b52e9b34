"""The coordinator's membership/rendezvous state machine (pure).

``step(state, event) -> Transition``: the new state, the views it published (minted) or adopted,
the workers it declared dead and the reply to the event's sender.  Time comes in with the events
(``now_s``); this module never reads a clock and does no I/O.  The coordinator role
(``roles/coordinator.py``) only translates messages into events and replies into messages.

Vocabulary.  A view is *published* when minted (it becomes the *latest*; training workers learn
its epoch from heartbeats and vote to move to it at a step boundary) and *adopted* when the
workers are told to meet in it (``get_view`` after a vote, ``poll_view`` while waiting or
recovering).  Worker states are ``WorkerState``; a worker is *gone* once LEFT, DEAD or DONE.

The recovery rule (a failure round).  A *failure report* is a poll with ``adopt`` from a member
of the adopted view E whose group broke (``after_epoch >= E.epoch``); a death of a member of E
(notice from the launcher, or heartbeat silence, ``failure.py``) also breaks E.  From then on E is
broken: nobody is told to meet in it any more, and every member of E that polls or asks for a
view counts as having reported.  The next view is formed, and adopted, **only when every member
of E has reported, is gone, or is suspected** -- suspected meaning it has been alive but quiet
for ``report_grace_s`` since the first report (it is dropped from the view and may come back as
a newcomer: its next poll makes it ready again).  The new view is the latest one (which never
holds a dead member), or a fresh epoch with the same members if nothing changed (a timeout, not
a death).  So survivors that report before the launcher's death notice wait for it (or for the
grace) instead of being sent into a rendezvous that waits for the dead worker.

Invariants (tests/unit/test_rendezvous.py checks them on random interleavings)
- epochs of published views strictly increase; the adopted epoch never decreases;
- the latest view never contains a worker known dead;
- ``broken_epoch`` names the adopted epoch exactly while it is broken;
- no view a worker is told to meet in (poll reply or ``get_view`` reply) contains a worker known
  dead at that moment, and no view is handed out while a failure round is open;
- members of the first view are the ready workers; a worker enters a view only once ready.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.rendezvous_draft import Draft
from flotilla.cluster.rendezvous_state import (
    EXPECTED,
    GONE,
    IN_PLAY,
    FailureRound,
    Member,
    Rendezvous,
    RendezvousConfig,
    Transition,
    WorkerState,
    broken_epoch,
)

__all__ = [
    "FailureRound",
    "Member",
    "Rendezvous",
    "RendezvousConfig",
    "Transition",
    "WorkerState",
    "broken_epoch",
    "initial_state",
    "reporter",
    "standby",
    "step",
]


def initial_state(config: RendezvousConfig) -> Rendezvous:
    return Rendezvous(config=config)


def reporter(state: Rendezvous, exited: AbstractSet[int]) -> int | None:
    """Who reports the job's result in place of the worker that was to (its view's rank 0 at
    its last step) when that one is gone: once the job neither finished nor stopped and no worker
    is expected to talk any more (none joining, training or suspected), the lowest worker that
    finished its part (DONE) and whose process still runs (not in ``exited``); else None."""
    if state.done or state.stop or any(m.state in EXPECTED for m in state.workers.values()):
        return None
    done = (w for w, m in state.workers.items() if m.state is WorkerState.DONE and w not in exited)
    return min(done, default=None)


def standby(state: Rendezvous, exited: AbstractSet[int]) -> int | None:
    """The one finished worker that stays, ready to report the job's result (:func:`reporter`)
    should the worker due to report it die first, where finished workers otherwise leave at once
    (the parameter server: the final weights are the servers', any worker can report them): once
    at most one worker is still expected to talk (the one due to report: it never says it is
    done), the DONE worker whose process still runs that finished last (ties: the higher id) --
    so every worker that finishes while others still train leaves, and one stands by only from
    the last other worker's finish to the job's end; None before that, and once the job finished
    or stopped."""
    if state.done or state.stop or sum(m.state in EXPECTED for m in state.workers.values()) > 1:
        return None
    done = [
        (m.done_s if m.done_s is not None else -math.inf, w)
        for w, m in state.workers.items()
        if m.state is WorkerState.DONE and w not in exited
    ]
    return max(done)[1] if done else None


def step(state: Rendezvous, event: ev.Event) -> Transition:
    """Apply one event (pure: ``state`` is not modified)."""
    draft = Draft(state, event.now_s)
    handler: Callable[[Draft, Any], ev.Reply] = _HANDLERS[type(event)]
    reply = handler(draft, event)
    return draft.result(reply)


def _unknown(wid: int) -> ev.Refused:
    return ev.Refused("unknown_worker", f"worker {wid} never joined")


def _on_joined(d: Draft, e: ev.Joined) -> ev.Reply:
    if d.done or d.stop:
        return ev.Refused("job_over", "the job has finished; no more joins")
    wid = len(d.workers)
    d.workers[wid] = Member(worker_id=wid, state=WorkerState.JOINED, last_seen_s=e.now_s)
    return ev.Registered(wid)


def _on_polled(d: Draft, e: ev.Polled) -> ev.Reply:
    wid = e.worker_id
    if wid not in d.workers:
        return _unknown(wid)
    d.heard(wid, e.now_s)
    if d.done or d.stop:
        return ev.PollReply(ev.PollStatus.DONE)
    if d.state_of(wid) in (WorkerState.LEFT, WorkerState.DEAD):
        return ev.PollReply(ev.PollStatus.REMOVED)
    d.mark_ready(wid)
    adopted = d.views.get(d.adopted)
    broken_report = e.adopt and adopted is not None and e.after_epoch >= adopted.epoch
    if adopted is not None and wid in adopted and (broken_report or d.broken()):
        d.report(wid, e.now_s)
    d.settle(e.now_s)
    return d.handout(wid, e.after_epoch)


def _on_view_requested(d: Draft, e: ev.ViewRequested) -> ev.Reply:
    if e.epoch not in d.views:
        return ev.Refused("unknown_epoch", f"no view {e.epoch}; latest is {d.latest}")
    if d.broken():
        if e.worker_id in d.members_of(d.adopted):
            d.report(e.worker_id, e.now_s)
        d.settle(e.now_s)
        if d.broken():
            return ev.Refused("view_broken", f"epoch {d.adopted} lost a member; poll for the next view")
    epoch = max(e.epoch, d.adopted)  # superseded: meet in the adopted view instead
    dead = {w for w, m in d.workers.items() if m.state is WorkerState.DEAD}
    if dead & set(d.members_of(epoch)):  # (only a view never adopted) the latest holds no dead
        epoch = d.latest
    view = d.adopt(epoch)
    if view is None:
        return ev.Refused("no_lease", f"view {epoch}: too few members of view {d.adopted} renew the lease")
    return ev.ViewReply(view)


def _on_leave(d: Draft, e: ev.LeaveRequested) -> ev.Reply:
    if e.worker_id in d.workers and e.finished:
        if d.state_of(e.worker_id) in EXPECTED:  # (the job's end may have made it DONE already)
            d.remove(e.worker_id, WorkerState.DONE)
            d.workers[e.worker_id] = replace(d.workers[e.worker_id], done_s=e.now_s)
            d.settle(e.now_s)
    elif e.worker_id in d.workers and d.state_of(e.worker_id) is not WorkerState.DEAD:
        d.remove(e.worker_id, WorkerState.LEFT)
        d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_death(d: Draft, e: ev.DeathNoticed) -> ev.Reply:
    if e.worker_id in d.workers:
        d.prove_dead(e.worker_id)
        d.mark_dead(e.worker_id)
        d.settle(e.now_s)
    return None


def _on_suspected(d: Draft, e: ev.Suspected) -> ev.Reply:
    """Peers' suspicion, corroborated by the suspect's silence here (``ev.Suspected``)."""
    if e.reporter not in d.workers:
        return _unknown(e.reporter)
    d.heard(e.reporter, e.now_s)
    adopted = d.members_of(d.adopted)
    for wid in sorted(set(e.suspects) - {e.reporter}):
        m = d.workers.get(wid)
        if m is None or m.state not in IN_PLAY:
            continue
        if e.closed:
            d.prove_dead(wid)
        elif e.now_s - m.last_seen_s <= e.silence_s:
            continue
        elif not d.holds_lease():  # (silence on this side of a cut proves nothing: lease.py)
            if wid in adopted and e.reporter in adopted:
                d.report(e.reporter, e.now_s)  # (its epoch is broken all the same)
            continue
        if wid in adopted and e.reporter in adopted:
            d.report(e.reporter, e.now_s)  # the epoch is broken: its members are released
        d.remove(wid, WorkerState.SUSPECTED)  # out of the views; its next poll makes it a newcomer
    d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_exited(d: Draft, e: ev.Exited) -> ev.Reply:
    if e.worker_id in d.workers and d.state_of(e.worker_id) in EXPECTED:
        d.remove(e.worker_id, WorkerState.LEFT)
        d.settle(e.now_s)
    return None


def _on_heartbeat(d: Draft, e: ev.Heartbeat) -> ev.Reply:
    if e.worker_id not in d.workers:
        return _unknown(e.worker_id)
    d.heard(e.worker_id, e.now_s)
    if d.state_of(e.worker_id) not in GONE:
        d.renew(e.worker_id, e.stamp, e.runs)
    if e.trained and d.state_of(e.worker_id) in (WorkerState.JOINED, WorkerState.READY):
        d.set_state(e.worker_id, WorkerState.TRAINING)
    d.check_silence(e.now_s)
    d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_ring_returned(d: Draft, e: ev.RingReturned) -> ev.Reply:
    """The heal (``cluster/lease.py`` rule 5): a worker that went on in ring mode reaches the
    coordinator again.  A ring view newer than the adopted one is taken over; a member the
    adopted view does not hold is suspected (its next poll makes it a newcomer); one declared
    gone hears so at its next poll.  It renews nothing: its next heartbeats will."""
    wid = e.worker_id
    if wid not in d.workers:
        return _unknown(wid)
    d.heard(wid, e.now_s)
    if e.trained and d.state_of(wid) in (WorkerState.JOINED, WorkerState.READY):
        d.set_state(wid, WorkerState.TRAINING)
    d.check_silence(e.now_s)
    members = tuple(sorted(set(e.members)))
    known = wid in members and all(m in d.workers for m in members)
    if not (d.done or d.stop) and d.state_of(wid) not in GONE:
        if e.epoch > d.adopted and known:
            d.take_over(e.epoch, members)
        elif wid not in d.members_of(d.adopted) and d.state_of(wid) in IN_PLAY:
            d.remove(wid, WorkerState.SUSPECTED)
    d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_tick(d: Draft, e: ev.Tick) -> ev.Reply:
    d.settle(e.now_s)
    return None


def _on_finished(d: Draft, e: ev.Finished) -> ev.Reply:
    d.done = True
    for w, m in list(d.workers.items()):
        if m.state is WorkerState.TRAINING:
            d.set_state(w, WorkerState.DONE)
    return None


def _on_stop(d: Draft, e: ev.StopRequested) -> ev.Reply:
    d.stop = True
    return None


_HANDLERS: Mapping[type, Callable[[Draft, Any], ev.Reply]] = {
    ev.Joined: _on_joined,
    ev.Polled: _on_polled,
    ev.ViewRequested: _on_view_requested,
    ev.LeaveRequested: _on_leave,
    ev.DeathNoticed: _on_death,
    ev.Suspected: _on_suspected,
    ev.Exited: _on_exited,
    ev.Heartbeat: _on_heartbeat,
    ev.RingReturned: _on_ring_returned,
    ev.Tick: _on_tick,
    ev.Finished: _on_finished,
    ev.StopRequested: _on_stop,
}
