"""Membership through the coordinator (``trainer/parts.Membership``): views are minted and
adopted by the coordinator's rendezvous state machine (``cluster/rendezvous.py``); this class
turns the loop's questions into ``poll_view`` / ``get_view`` / ``leave`` requests; its process
groups (one per view, and the per-step ones) come from ``roles/view_groups.py``.

No survivor waits out a timeout: when the coordinator says the current epoch is broken (a member
died; its heartbeat reply carries ``broken``), the heartbeat thread aborts that epoch's group
(and the per-step groups with a collective in flight; one being set up gives up), so a worker
blocked in one of its collectives is released within one wait slice; and a worker whose
collective failed releases its group at once (``Group.fail``), which makes the peers blocked on
it fail too.  A strategy of groups formed per unit (``Regime.GROUPS``) only reports a broken view
and takes the next one between its units (``catch_up``), never waiting for it.

Without the coordinator.  Once its process is proven gone, or it stayed silent past its lease
(``link.coordinator_gone``, ``roles/link.py``), this class switches to *ring mode*: the next view
after a failure is agreed by the survivors themselves
(``roles/ring_driver.py`` runs ``cluster/ring_repair.py`` peer to peer), fed by the neighbour
watch's suspicions, and its group meets in the rendezvous store hosted by the view's lowest
member (``PeerLink.store``).  In ring mode nobody joins; a SIGTERMed worker exits at the next
boundary (its neighbours then repair the ring), and the ``failed`` peers a broken collective
names are not trusted (a live peer that released its group looks the same): only the
neighbour watch accuses.  A silent coordinator that answers again (the heal, ``cluster/lease.py``
rule 5) ends ring mode: it has taken this side's view over where it was newer, and a worker
waiting for a ring view -- or held back by the split-brain rule -- asks it for its next view;
one that the coordinator's side left behind hears ``removed`` and rejoins as a newcomer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flotilla.cluster.membership import View
from flotilla.comm.collective import CollectiveFaults, EpochGroup
from flotilla.comm.group_factory import GroupFactory
from flotilla.comm.store import StoreAddress
from flotilla.core.errors import CollectiveError, CommError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.roles.link import CoordinatorLink
from flotilla.roles.peer_link import PeerLink
from flotilla.roles.ring_driver import RingDriver
from flotilla.roles.view_groups import ViewGroups
from flotilla.trainer.boundary import SwitchAt
from flotilla.trainer.parts import Entry

__all__ = ["EXIT_EVICTED", "CoordinatedMembership"]

EXIT_EVICTED = 5  # the job went on without this worker (it never asked to leave)

log = get_logger("worker")

POLL_INTERVAL_S = 0.02
REMOVED_ASK_S = 2.0  # how long a failed session waits for the coordinator to say it removed the worker
CATCH_UP_INTERVAL_S = 0.25  # catch_up asks for a newer view (not a failure report) at most this often


class CoordinatedMembership:
    def __init__(
        self,
        link: CoordinatorLink,
        worker_id: int,
        store_address: StoreAddress,
        *,
        timeout_s: float,
        backend: str,
        device: Any,
        view_wait_s: float,
        leave: threading.Event | None = None,
        peers: PeerLink | None = None,
        ring: RingDriver | None = None,
        stall_limit_s: float | None = None,
        faults: CollectiveFaults | None = None,
    ) -> None:
        self.link, self.worker_id = link, worker_id
        self._view_wait_s = view_wait_s
        self.evicted = ""  # why the job went on without this worker ("" while it is a member)
        self.view: View | None = None
        self._leave = leave or threading.Event()
        self._leave_epoch = 0
        self._next_catch_up = 0.0
        link.on_broken = self._on_broken
        self._peers = peers  # the neighbour watch: told every view this worker enters
        self._silent_in = 0  # the newest epoch in which the watch found a neighbour silent
        self._ring = ring  # ring repair, once the coordinator is gone
        self._addresses: dict[int, str] = {}  # worker -> its peer server, as the coordinator said
        self._suspected: dict[int, set[int]] = {}  # epoch -> members the watch accused in it
        self._groups = ViewGroups(
            link, worker_id, store_address, timeout_s=timeout_s, backend=backend, device=device,
            peers=peers, addresses=self._addresses, broken=self._epoch_broken,
            ring_mode=lambda: self.ring_mode, stall_limit_s=stall_limit_s, faults=faults,
        )  # fmt: skip
        link.on_gone = self._on_coordinator_gone
        link.running = lambda: self.view
        link.ring_view = self._ring_report
        if ring is not None:
            ring.on_adopt = self._on_ring_adopt

    @property
    def ring_mode(self) -> bool:
        return self._ring is not None and self.link.coordinator_gone

    def _on_coordinator_gone(self) -> None:
        """Liveness thread: from now on the ring repairs itself; accuse whom the watch found."""
        view = self.view
        if self._ring is not None and view is not None:
            self._ring.suspect(frozenset(self._suspected.get(view.epoch, ())))

    def _ring_report(self) -> View | None:
        """What a silenced link reports (the heal): the newest view this side adopted, entered
        or not yet (a view the coordinator took over is the one this worker goes on in)."""
        newest = self._ring.newest() if self._ring is not None else None
        view = self.view
        return newest if newest is not None and (view is None or newest.epoch > view.epoch) else view

    def _on_ring_adopt(self, view: View) -> None:
        """Ring thread: a newer view was adopted; the one running is over."""
        self._on_broken(view.epoch - 1, f"ring repair adopted view {view.epoch}")

    def on_suspect(self, suspects: tuple[int, ...], epoch: int, closed: bool = False) -> None:
        """Peer-watch thread: ring neighbours went silent in ``epoch`` (or, ``closed``, their
        processes are gone).  Release whoever waits in that epoch's collectives here, and tell
        the coordinator (which corroborates silence, accepts a closed connection as proof, and
        breaks the epoch for every member)."""
        self._silent_in = max(self._silent_in, epoch)  # (a group of it being formed gives up)
        self._suspected.setdefault(epoch, set()).update(suspects)
        what = "are gone" if closed else "are silent"
        self._on_broken(epoch, f"epoch {epoch}: peers {list(suspects)} {what}")
        if not self.ring_mode:
            try:
                self.link.report_suspects(suspects, epoch, closed=closed)
                return
            except CommError:
                if not self.ring_mode:
                    raise
        if self._ring is not None and self.view is not None and self.view.epoch == epoch:
            self._ring.suspect(frozenset(suspects))

    # ------------------------------------------------------------------ flags
    @property
    def orphaned(self) -> bool:
        if self.ring_mode and self.leave_requested:
            log.warning("leaving without a coordinator: exiting (the neighbours repair the ring)")
            return True
        return False

    @property
    def stop_requested(self) -> bool:
        return self.link.stop_requested

    @property
    def leave_requested(self) -> bool:
        return self._leave.is_set()

    def _on_broken(self, epoch: int, why: str = "") -> None:
        """Heartbeat thread: the coordinator says ``epoch`` is broken (or the peer watch does)."""
        self._groups.abort_epoch(epoch, why)

    def _epoch_broken(self, epoch: int) -> bool:
        """Declared broken by the coordinator, or a neighbour went silent in it."""
        return self.link.broken_epoch >= epoch or self._silent_in >= epoch

    # ------------------------------------------------------------------ views
    def first_view(self) -> Entry | None:
        return self._poll(after_epoch=0, adopt=False)

    def recover(self, failed: frozenset[int]) -> View | None:
        self.close_group()  # (the peer watch goes on: the next view replaces what it watches)
        after = self.view.epoch if self.view is not None else 0
        while True:  # (the coordinator may go silent, and answer again, while this worker waits)
            if not self.ring_mode:
                try:
                    entry = self._poll(after_epoch=after, adopt=True)
                    return entry.view if entry is not None else None
                except CommError:
                    if not self.ring_mode:
                        raise
            settled, view = self._ring_recover(after)
            if settled:
                return view

    def _ring_recover(self, after: int) -> tuple[bool, View | None]:
        """Wait for ring repair's next view: (True, it) or (True, None: leaving); (False, None):
        the coordinator answers again -- ask it (a ring view adopted meanwhile was reported to
        it, and it took that over where it was newer: ``_ring_report``)."""
        assert self._ring is not None
        deadline = time.monotonic() + self._view_wait_s
        view = self._ring.wait_adopted(
            after, self._view_wait_s, cancelled=lambda: self.leave_requested or not self.ring_mode
        )
        if view is None and self.link.silenced and self._ring.out:
            # (held back, or left out: a silent coordinator may answer again -- the heal)
            log.warning("ring repair: %s; waiting for the coordinator to answer again", self._ring.out)
            while self.ring_mode and not self.leave_requested and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL_S)
        if self.leave_requested:
            return True, None
        if not self.ring_mode:
            return False, None
        if view is None:
            why = self._ring.out or f"no view after {after} within {self._view_wait_s} s"
            raise FlotillaError(f"ring repair: this worker trains no further: {why}")
        self._groups.ring_epochs.add(view.epoch)
        self._enter(view, None)
        return True, view

    def _poll(self, *, after_epoch: int, adopt: bool) -> Entry | None:
        """Wait for an adopted view newer than ``after_epoch`` that contains us."""
        deadline = time.monotonic() + self._view_wait_s
        while time.monotonic() < deadline:
            body = {"worker_id": self.worker_id, "after_epoch": after_epoch, "adopt": adopt}
            try:
                reply = self.link.call("poll_view", body, timeout_s=1.0)
            except CommError:
                if self.link.proven_gone or (self.ring_mode and self.view is not None):
                    raise  # (recover goes on by ring repair)
                if self.link.coordinator_gone:
                    time.sleep(POLL_INTERVAL_S)  # (silent, no view to go on in: wait for it)
                continue  # (a slow coordinator: ask again until the deadline)
            if reply["status"] in ("done", "removed"):
                if reply["status"] == "removed":
                    self._note_evicted("the coordinator removed it from the job (declared dead or gone)")
                return None
            if reply["status"] == "view":
                view = View.from_dict(reply["view"])
                if self.worker_id not in view.members:
                    self._note_evicted(f"view {view.epoch} goes on without it")
                    return None
                self._enter(view, reply)
                return Entry(view, initial=bool(reply.get("initial")))
            time.sleep(POLL_INTERVAL_S)
        raise FlotillaError(f"no view containing worker {self.worker_id} within {self._view_wait_s} s")

    def removed(self) -> bool:
        """Whether the job went on without this worker: already noted, or -- asked once, after a
        session failed -- the coordinator says it removed it (declared dead, gone) or runs a view
        without it.  A failure that follows from that (a parameter server refusing a worker it
        evicted, say) ends the session evicted, not failed (``roles/worker.py``)."""
        if self.evicted:
            return True
        if self.view is None or self.ring_mode or self.leave_requested:
            return False
        body = {"worker_id": self.worker_id, "after_epoch": self.view.epoch, "adopt": False}
        try:
            reply = self.link.call("poll_view", body, timeout_s=REMOVED_ASK_S)
        except CommError:
            return False  # (no answer: not proven; the failure stands)
        if reply["status"] == "removed":
            self._note_evicted("the coordinator removed it from the job (declared dead or gone)")
        elif reply["status"] == "view" and self.worker_id not in View.from_dict(reply["view"]).members:
            self._note_evicted(f"view {reply['view'].get('epoch')} goes on without it")
        return bool(self.evicted)

    def _note_evicted(self, why: str) -> None:
        """This worker is out of the job though it did not ask to leave: say why, once (the
        session ends with ``EXIT_EVICTED``: ``roles/worker.py`` rejoins or exits, ``cluster/rejoin.py``)."""
        if self.leave_requested or self.evicted:
            return
        self.evicted = why
        log.error("worker %d evicted: %s", self.worker_id, why)  # (roles/worker.py: rejoin or exit)

    def catch_up(self) -> View | None:
        """Between two units of a strategy of groups formed per unit (``Regime.GROUPS``): if the
        coordinator says our epoch is broken, report it, and take a newer view once it is
        adopted -- one ``poll_view``, never a wait (the failure round of ``cluster/rendezvous.py``
        counts the report; nobody meets in a view, so nobody waits for a quorum).  The view this
        worker runs now (maybe newer); None: it is out of the job (removed, or the job is over)."""
        view = self.view
        if view is None or self.ring_mode:
            return view
        broken = self.link.broken_epoch >= view.epoch
        newer = self.link.latest_epoch > view.epoch and time.monotonic() >= self._next_catch_up
        if not (broken or newer):
            return view
        # (a newer view may have been adopted without this worker ever hearing its own epoch was
        # broken: the failure round can open and close between two heartbeats)
        self._next_catch_up = time.monotonic() + CATCH_UP_INTERVAL_S
        body = {"worker_id": self.worker_id, "after_epoch": view.epoch, "adopt": broken}
        try:
            reply = self.link.call("poll_view", body, timeout_s=1.0)
        except CommError:
            return view  # (a slow coordinator: report at the next boundary)
        if reply["status"] in ("done", "removed"):
            if reply["status"] == "removed":
                self._note_evicted("the coordinator removed it from the job (declared dead or gone)")
            return None
        if reply["status"] != "view":
            return view
        new = View.from_dict(reply["view"])
        if self.worker_id not in new.members:
            self._note_evicted(f"view {new.epoch} goes on without it")
            return None
        self._enter(new, reply)
        return new

    def announced(self) -> tuple[SwitchAt, ...]:
        """The strategy switches the coordinator announced (``roles/coordinator_switch.py``)."""
        return tuple(SwitchAt(step=s, option=o) for s, o in self.link.switches)

    def pending_epoch(self) -> int:
        assert self.view is not None
        if self.ring_mode:
            return 0  # (nobody joins, and a leave is an exit: see the module doc)
        if self.leave_requested and not self._leave_epoch:
            body = {"worker_id": self.worker_id, "finished": False}  # (mid-job: a leave, not an end)
            self._leave_epoch = int(self.link.call("leave", body)["epoch"])
        latest = max(self.link.latest_epoch, self._leave_epoch)
        return latest if latest > self.view.epoch else 0

    def move_to(self, epoch: int) -> View | None:
        try:
            reply = self.link.call("get_view", {"worker_id": self.worker_id, "epoch": epoch})
        except CommError as exc:
            if self.ring_mode:  # (handled like a broken group: recover by ring repair)
                raise CollectiveError(f"view {epoch}: {exc}") from exc
            raise
        view = View.from_dict(reply["view"])
        if self.worker_id not in view.members:
            self._note_evicted(f"view {view.epoch} goes on without it")
            return None
        self._enter(view, reply)
        return view

    def _enter(self, view: View, reply: dict[str, Any] | None) -> None:
        """Run ``view`` (``reply``: the coordinator's, with the peers' addresses; None: a view
        of ring repair, whose driver already runs it)."""
        self.view = view
        if reply is not None:
            peers = reply.get("peers") or {}
            self._addresses.update({int(k): str(v) for k, v in peers.items() if str(k).isdigit()})
            if self._ring is not None:
                self._ring.enter(view, self._addresses)
        if self._peers is not None:
            self._peers.watch(view, {m: a for m, a in self._addresses.items() if m in view.members})

    def peer_address(self, worker_id: int) -> str | None:
        """``worker_id``'s peer server, as the coordinator announced it (None: not known)."""
        return self._addresses.get(worker_id)

    # ------------------------------------------------------------------ groups
    def group(self, view: View) -> EpochGroup:
        return self._groups.group(view)

    def close_group(self) -> None:
        self._groups.close_group()

    def groups(self) -> GroupFactory:
        return self._groups.factory()

    def close(self) -> None:
        self.close_group()
        if self._ring is not None:
            self._ring.close()
