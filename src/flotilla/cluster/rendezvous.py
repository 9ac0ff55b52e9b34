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

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.failure import check_silence, suspects
from flotilla.cluster.membership import View, merge_since, successor
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
    "step",
]


def initial_state(config: RendezvousConfig) -> Rendezvous:
    return Rendezvous(config=config)


def step(state: Rendezvous, event: ev.Event) -> Transition:
    """Apply one event (pure: ``state`` is not modified)."""
    draft = _Draft(state)
    handler: Callable[[_Draft, Any], ev.Reply] = _HANDLERS[type(event)]
    reply = handler(draft, event)
    return draft.result(reply)


# ---------------------------------------------------------------------- the machine
class _Draft:
    """A private working copy of a ``Rendezvous`` for one transition."""

    def __init__(self, s: Rendezvous) -> None:
        self.s = s
        self.workers = dict(s.workers)
        self.views = dict(s.views)
        self.latest, self.adopted, self.initial = s.latest_epoch, s.adopted_epoch, s.initial_epoch
        self.failure = s.failure
        self.last_check_s = s.last_check_s
        self.stop, self.done = s.stop, s.done
        self.published: list[View] = []
        self.newly_adopted: list[View] = []
        self.newly_dead: list[int] = []

    def result(self, reply: ev.Reply) -> Transition:
        state = replace(
            self.s,
            workers=self.workers,
            views=self.views,
            latest_epoch=self.latest,
            adopted_epoch=self.adopted,
            initial_epoch=self.initial,
            failure=self.failure,
            last_check_s=self.last_check_s,
            stop=self.stop,
            done=self.done,
        )
        return Transition(
            state, reply, tuple(self.published), tuple(self.newly_adopted), tuple(self.newly_dead)
        )

    # -------------------------------------------------------------- helpers
    def state_of(self, wid: int) -> WorkerState:
        return self.workers[wid].state

    def set_state(self, wid: int, st: WorkerState) -> None:
        self.workers[wid] = replace(self.workers[wid], state=st)

    def touch(self, wid: int, now_s: float) -> None:
        self.workers[wid] = replace(self.workers[wid], last_seen_s=now_s)

    def members_of(self, epoch: int) -> tuple[int, ...]:
        view = self.views.get(epoch)
        return view.members if view is not None else ()

    def in_play(self) -> tuple[int, ...]:
        return tuple(sorted(w for w, m in self.workers.items() if m.state in IN_PLAY))

    def new_view(self, members: tuple[int, ...]) -> View:
        prev = self.views.get(self.latest) or View(epoch=0, members=())
        view = successor(prev, members)
        self.views[view.epoch] = view
        self.latest = view.epoch
        self.published.append(view)
        return view

    def change_members(self, *, add: int | None = None, drop: int | None = None) -> None:
        members = set(self.members_of(self.latest))
        if add is not None:
            members.add(add)
        if drop is not None:
            members.discard(drop)
        if tuple(sorted(members)) != self.members_of(self.latest):
            self.new_view(tuple(sorted(members)))

    def adopt(self, epoch: int) -> View:
        if epoch > self.adopted:
            adopted = self.views.get(self.adopted) or View(epoch=0, members=())
            self.views[epoch] = merge_since(adopted, self.views[epoch])
            self.adopted = epoch
            self.newly_adopted.append(self.views[epoch])
        return self.views[epoch]

    # -------------------------------------------------------------- transitions
    def mark_ready(self, wid: int) -> None:
        if self.state_of(wid) not in (WorkerState.JOINED, WorkerState.SUSPECTED):
            return
        self.set_state(wid, WorkerState.READY)
        if self.adopted > 0:
            self.change_members(add=wid)
        elif len(self.in_play()) >= self.s.config.min_workers:
            self.new_view(self.in_play())
            self.initial = self.adopt(self.latest).epoch

    def mark_dead(self, wid: int) -> None:
        if self.state_of(wid) in GONE:
            return
        self.set_state(wid, WorkerState.DEAD)
        self.newly_dead.append(wid)
        if self.adopted > 0:
            self.change_members(drop=wid)

    def remove(self, wid: int, st: WorkerState) -> None:
        self.set_state(wid, st)
        self.change_members(drop=wid)

    def broken(self) -> bool:
        """Is the adopted epoch broken (a failure reported, or a member known dead)?"""
        members = self.members_of(self.adopted)
        return self.failure is not None or any(self.state_of(w) is WorkerState.DEAD for w in members)

    def report(self, wid: int, now_s: float) -> None:
        f = self.failure or FailureRound(epoch=self.adopted)
        first = f.first_report_s if f.first_report_s is not None else now_s
        self.failure = replace(f, reported=f.reported | {wid}, first_report_s=first)

    def settle(self, now_s: float) -> None:
        """Suspect the members of a broken epoch that were quiet too long; form the next view
        once every member of the broken epoch is accounted for."""
        f = self.failure
        if f is None:
            self._replace_a_lost_view()
            return
        pending = [
            m
            for m in self.members_of(f.epoch)
            if m not in f.reported and self.state_of(m) in IN_PLAY | {WorkerState.JOINED}
        ]
        if f.first_report_s is not None:
            for m in suspects(self.s.config.policy, opened_s=f.first_report_s, now_s=now_s, pending=pending):
                self.remove(m, WorkerState.SUSPECTED)
                pending.remove(m)
        if pending:
            return
        self.failure = None
        members = self.members_of(self.latest)
        if not members:
            return  # everybody is gone
        if self.latest == self.adopted:  # nothing changed (a timeout): a fresh epoch to meet in
            self.new_view(members)
        self.adopt(self.latest)

    def _replace_a_lost_view(self) -> None:
        """Every member of the adopted view died (or was suspected) with nobody left to report
        the failure: the newest view (the workers ready now, if any) is adopted as it stands --
        its members find no live replica of the state, and say so at once, instead of waiting
        for a view that nobody would ever form."""
        members = self.members_of(self.adopted)
        lost = (WorkerState.DEAD, WorkerState.SUSPECTED)
        if not members or not all(self.state_of(m) in lost for m in members):
            return
        if self.latest != self.adopted and self.members_of(self.latest):
            self.adopt(self.latest)

    def check_silence(self, now_s: float) -> None:
        expected = {w: m.last_seen_s for w, m in self.workers.items() if m.state in EXPECTED}
        verdict = check_silence(
            self.s.config.policy, last_check_s=self.last_check_s, now_s=now_s, last_seen_s=expected
        )
        self.last_check_s = now_s
        if verdict.stalled:  # we were not running: nobody is to blame
            for w in expected:
                self.touch(w, now_s)
        for w in sorted(verdict.dead):
            self.mark_dead(w)

    def handout(self, wid: int, after_epoch: int) -> ev.PollReply:
        view = self.views.get(self.adopted)
        if self.broken() or view is None or view.epoch <= after_epoch or wid not in view:
            return ev.PollReply(ev.PollStatus.WAIT)
        return ev.PollReply(ev.PollStatus.VIEW, view, initial=view.epoch == self.initial)


def _unknown(wid: int) -> ev.Refused:
    return ev.Refused("unknown_worker", f"worker {wid} never joined")


def _on_joined(d: _Draft, e: ev.Joined) -> ev.Reply:
    if d.done or d.stop:
        return ev.Refused("job_over", "the job has finished; no more joins")
    wid = len(d.workers)
    d.workers[wid] = Member(worker_id=wid, state=WorkerState.JOINED, last_seen_s=e.now_s)
    return ev.Registered(wid)


def _on_polled(d: _Draft, e: ev.Polled) -> ev.Reply:
    wid = e.worker_id
    if wid not in d.workers:
        return _unknown(wid)
    d.touch(wid, e.now_s)
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


def _on_view_requested(d: _Draft, e: ev.ViewRequested) -> ev.Reply:
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
    return ev.ViewReply(d.adopt(epoch))


def _on_leave(d: _Draft, e: ev.LeaveRequested) -> ev.Reply:
    if e.worker_id in d.workers and e.finished:
        if d.state_of(e.worker_id) in EXPECTED:  # (the job's end may have made it DONE already)
            d.remove(e.worker_id, WorkerState.DONE)
            d.settle(e.now_s)
    elif e.worker_id in d.workers and d.state_of(e.worker_id) is not WorkerState.DEAD:
        d.remove(e.worker_id, WorkerState.LEFT)
        d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_death(d: _Draft, e: ev.DeathNoticed) -> ev.Reply:
    if e.worker_id in d.workers:
        d.mark_dead(e.worker_id)
        d.settle(e.now_s)
    return None


def _on_suspected(d: _Draft, e: ev.Suspected) -> ev.Reply:
    """Peers' suspicion, corroborated by the suspect's silence here (``ev.Suspected``)."""
    if e.reporter not in d.workers:
        return _unknown(e.reporter)
    d.touch(e.reporter, e.now_s)
    adopted = d.members_of(d.adopted)
    for wid in sorted(set(e.suspects) - {e.reporter}):
        m = d.workers.get(wid)
        if m is None or m.state not in IN_PLAY:
            continue
        if not e.closed and e.now_s - m.last_seen_s <= e.silence_s:
            continue
        if wid in adopted and e.reporter in adopted:
            d.report(e.reporter, e.now_s)  # the epoch is broken: its members are released
        d.remove(wid, WorkerState.SUSPECTED)  # out of the views; its next poll makes it a newcomer
    d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_exited(d: _Draft, e: ev.Exited) -> ev.Reply:
    if e.worker_id in d.workers and d.state_of(e.worker_id) in EXPECTED:
        d.remove(e.worker_id, WorkerState.LEFT)
        d.settle(e.now_s)
    return None


def _on_heartbeat(d: _Draft, e: ev.Heartbeat) -> ev.Reply:
    if e.worker_id not in d.workers:
        return _unknown(e.worker_id)
    d.touch(e.worker_id, e.now_s)
    if e.trained and d.state_of(e.worker_id) in (WorkerState.JOINED, WorkerState.READY):
        d.set_state(e.worker_id, WorkerState.TRAINING)
    d.check_silence(e.now_s)
    d.settle(e.now_s)
    return ev.EpochReply(d.latest)


def _on_tick(d: _Draft, e: ev.Tick) -> ev.Reply:
    d.settle(e.now_s)
    return None


def _on_finished(d: _Draft, e: ev.Finished) -> ev.Reply:
    d.done = True
    for w, m in list(d.workers.items()):
        if m.state is WorkerState.TRAINING:
            d.set_state(w, WorkerState.DONE)
    return None


def _on_stop(d: _Draft, e: ev.StopRequested) -> ev.Reply:
    d.stop = True
    return None


_HANDLERS: Mapping[type, Callable[[_Draft, Any], ev.Reply]] = {
    ev.Joined: _on_joined,
    ev.Polled: _on_polled,
    ev.ViewRequested: _on_view_requested,
    ev.LeaveRequested: _on_leave,
    ev.DeathNoticed: _on_death,
    ev.Suspected: _on_suspected,
    ev.Exited: _on_exited,
    ev.Heartbeat: _on_heartbeat,
    ev.Tick: _on_tick,
    ev.Finished: _on_finished,
    ev.StopRequested: _on_stop,
}
