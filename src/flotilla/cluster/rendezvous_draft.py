"""The rendezvous state machine's working copy (pure): ``Draft`` holds one transition's changes
and the steps every handler shares -- views published and adopted, deaths, the failure round's
settling, the silence check and the lease (``cluster/lease.py``).  ``cluster/rendezvous.py``
holds the handlers and states the rules."""

from __future__ import annotations

from dataclasses import replace

from flotilla.cluster.failure import check_silence, suspects
from flotilla.cluster.lease import coordinator_may_mint
from flotilla.cluster.membership import View, merge_since, successor
from flotilla.cluster.rendezvous_events import PollReply, PollStatus, Reply
from flotilla.cluster.rendezvous_state import (
    EXPECTED,
    GONE,
    IN_PLAY,
    FailureRound,
    Rendezvous,
    Transition,
    WorkerState,
)

__all__ = ["PROVEN_GONE", "Draft"]

PROVEN_GONE = frozenset({WorkerState.LEFT, WorkerState.DONE})  # (exited on purpose: on no side)


class Draft:
    """A private working copy of a ``Rendezvous`` for one transition at ``now_s``."""

    def __init__(self, s: Rendezvous, now_s: float) -> None:
        self.s, self.now_s = s, now_s
        self.workers = dict(s.workers)
        self.views = dict(s.views)
        self.latest, self.adopted, self.initial = s.latest_epoch, s.adopted_epoch, s.initial_epoch
        self.failure = s.failure
        self.last_check_s = s.last_check_s
        self.bases = list(s.bases)
        self.stop, self.done = s.stop, s.done
        self.published: list[View] = []
        self.newly_adopted: list[View] = []
        self.newly_dead: list[int] = []

    def result(self, reply: Reply) -> Transition:
        state = replace(
            self.s,
            workers=self.workers,
            views=self.views,
            latest_epoch=self.latest,
            adopted_epoch=self.adopted,
            initial_epoch=self.initial,
            failure=self.failure,
            last_check_s=self.last_check_s,
            bases=tuple(self.bases),
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

    def heard(self, wid: int, now_s: float) -> None:
        """A message from ``wid``: it is not silent, and its process is not gone."""
        self.touch(wid, now_s)
        if self.workers[wid].proven and self.state_of(wid) not in GONE:
            self.workers[wid] = replace(self.workers[wid], proven=False)

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

    def adopt(self, epoch: int) -> View | None:
        """Adopt ``epoch`` (an older or the adopted one: the adopted view); None: not without the
        lease (``lease_allows``)."""
        if epoch > self.adopted and not self.lease_allows(self.views[epoch].members):
            return None
        if epoch > self.adopted:
            adopted = self.views.get(self.adopted) or View(epoch=0, members=())
            self.views[epoch] = merge_since(adopted, self.views[epoch])
            self.adopted = epoch
            self.newly_adopted.append(self.views[epoch])
            self.bases.append(epoch)
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
            self.initial = self.latest
            self.adopt(self.latest)  # (the first view: no lease to hold yet)

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
        if f.first_report_s is not None and self.holds_lease():
            for m in suspects(self.s.config.policy, opened_s=f.first_report_s, now_s=now_s, pending=pending):
                self.remove(m, WorkerState.SUSPECTED)
                pending.remove(m)
        if pending:
            return
        members = self.members_of(self.latest)
        if members and not self.lease_allows(members):
            return  # (the round stays open: the next settle tries again)
        self.failure = None
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
        if verdict.dead and not self.holds_lease():
            return  # (silence on this side of a cut proves nothing: cluster/lease.py rule 2)
        for w in sorted(verdict.dead):
            self.mark_dead(w)

    # -------------------------------------------------------------- the lease (cluster/lease.py)
    def lease_allows(self, members: tuple[int, ...] | None) -> bool:
        """May a view of ``members`` be adopted now (rule 2; None: may the coordinator act on
        silence at all)?  Checked against every adopted view a ring side may still start from
        (``live_bases``: members adopt a view one by one, and a ring side starts from the view
        it runs).  Always without lease terms, and before the first view."""
        terms = self.s.config.lease
        if terms is None:
            return True
        for epoch in self.live_bases():
            last = self.members_of(epoch)
            renewed = {w: r for w in last if (r := self.workers[w].renewed_s) is not None}
            gone = [w for w in last if self._proven_gone(w)]
            if not coordinator_may_mint(last, renewed, self.now_s, terms, new_members=members, gone=gone):
                return False
        return True

    def live_bases(self) -> list[int]:
        """The adopted epochs a strict majority of whose members may still run them (the rest
        said they run a newer view, or are proven gone for good); the others are dropped."""
        keep = []
        for epoch in self.bases:
            members = self.members_of(epoch)
            moved = [w for w in members if self.workers[w].runs_epoch > epoch or self._gone_for_good(w)]
            if 2 * len(moved) < len(members) or epoch == self.adopted:
                keep.append(epoch)
        self.bases = keep
        return keep

    def _proven_gone(self, wid: int) -> bool:
        return self.workers[wid].proven or self.state_of(wid) in PROVEN_GONE

    def _gone_for_good(self, wid: int) -> bool:
        m = self.workers[wid]
        return m.state in PROVEN_GONE or (m.state is WorkerState.DEAD and m.proven)

    def holds_lease(self) -> bool:
        return self.lease_allows(None)

    def renew(self, wid: int, stamp: float | None, runs: int) -> None:
        """A heartbeat: an echoed lease stamp (rule 1, never later than now on this clock), and
        the epoch its sender runs."""
        m = self.workers[wid]
        fresh = min(stamp, self.now_s) if stamp is not None else None
        renewed = fresh if m.renewed_s is None or (fresh is not None and fresh > m.renewed_s) else m.renewed_s
        self.workers[wid] = replace(m, renewed_s=renewed, runs_epoch=max(m.runs_epoch, runs))

    def prove_dead(self, wid: int) -> None:
        self.workers[wid] = replace(self.workers[wid], proven=True)

    def take_over(self, epoch: int, members: tuple[int, ...]) -> None:
        """Rule 5: a ring view newer than the adopted one becomes the adopted one (its members
        trained in it), under its own epoch where that is free, else the next one (the views this
        side published and never adopted are skipped).  Members of the old view outside it are
        suspected (their next poll brings them back as newcomers); workers that were ready to
        join are put into the view after it."""
        for w in self.members_of(self.adopted):
            if w not in members and self.state_of(w) in IN_PLAY:
                self.set_state(w, WorkerState.SUSPECTED)
        alive = tuple(w for w in members if self.state_of(w) not in GONE)
        for w in alive:
            if self.state_of(w) in (WorkerState.SUSPECTED, WorkerState.READY, WorkerState.JOINED):
                self.set_state(w, WorkerState.TRAINING)
            self.touch(w, self.now_s)  # (the others' heartbeats may come later: not silent yet)
        # (a member known gone is left out: the ring's own epoch would then name two views)
        ring = View(epoch=max(epoch if alive == members else epoch + 1, self.latest + 1), members=alive)
        self.views[ring.epoch] = merge_since(self.views.get(self.adopted) or View(epoch=0, members=()), ring)
        self.latest = self.adopted = ring.epoch
        self.bases.append(ring.epoch)
        self.published.append(self.views[ring.epoch])
        self.newly_adopted.append(self.views[ring.epoch])
        self.failure = None
        for w in self.in_play():
            if w not in alive:
                self.change_members(add=w)

    def handout(self, wid: int, after_epoch: int) -> PollReply:
        view = self.views.get(self.adopted)
        if self.broken() or view is None or view.epoch <= after_epoch or wid not in view:
            return PollReply(PollStatus.WAIT)
        return PollReply(PollStatus.VIEW, view, initial=view.epoch == self.initial)
