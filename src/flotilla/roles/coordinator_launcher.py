"""The coordinator's side facing the launcher that hosts it (``launch/local.py``): death and exit
notices of worker processes, stop requests, the clock records' final sweep and the status
snapshot for progress displays and the summary.  Death notices also come without a launcher:
each worker gives its liveness listener's port when it joins (``comm/liveness.py``) and the
coordinator holds a connection to it; one that ends without a goodbye is the kernel closing a
dead process's sockets, taken as the launcher's notice would be (``worker_closed``).  A mixin of
:class:`flotilla.roles.coordinator.Coordinator`, which holds the state named below; every method
takes the coordinator's lock, as its message handlers do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from flotilla.cluster import rendezvous as rdv
from flotilla.cluster import rendezvous_events as ev
from flotilla.comm.rejections import rejection_counts
from flotilla.config import RunConfig
from flotilla.core.log import get_logger
from flotilla.roles.members_lost import LostMembers
from flotilla.roles.metrics_sink import MetricsSink, WorkerInfo
from flotilla.sync.spec import Service

__all__ = ["LauncherSide"]

log = get_logger("coordinator")

_GONE_FOR_PS = (rdv.WorkerState.DEAD, rdv.WorkerState.LEFT)  # "gone" in heartbeat replies


class LauncherSide:
    """What the launcher calls on its coordinator (module doc)."""

    cfg: RunConfig
    _lock: threading.RLock
    _workers: dict[int, WorkerInfo]
    _sink: MetricsSink
    _lost: LostMembers
    _finished: set[int]  # workers that reported their own last step
    _rdv: rdv.Rendezvous
    _final: dict[str, Any]
    _t0_unix: float
    _service: Service | None
    _now: Callable[[], float]
    _done_exited: frozenset[int] = frozenset()  # workers whose process ended after they were DONE

    def _apply(self, event: ev.Event) -> ev.Reply:
        raise NotImplementedError

    def _state_of(self, wid: int) -> rdv.WorkerState:
        raise NotImplementedError

    def _ids_named(self, name: str) -> list[int]:
        return [wid for wid, info in self._workers.items() if info.name == name]

    def remove_worker(self, name: str, why: str) -> None:
        """The launcher saw the process of ``name`` die unexpectedly."""
        with self._lock:
            for wid in self._ids_named(name):
                self._death_noticed(wid, why)

    def worker_closed(self, wid: int, graceful: bool) -> None:
        """(Liveness thread.)  The connection to worker ``wid``'s liveness listener ended:
        without a goodbye its process is gone (module doc); a goodbye is a shutdown on purpose,
        whose leave or exit the worker reports itself.  A DONE worker's process that ended either
        way can no longer report the job's result in place of its rank 0 (``end_facts``)."""
        with self._lock:
            if wid not in self._workers:
                return
            state = self._state_of(wid)
            if state is rdv.WorkerState.DONE:
                self._done_exited = self._done_exited | {wid}
            if graceful:
                return
            if state is rdv.WorkerState.DONE and self._service is not None and not self._rdv.done:
                # (it finished, then died before the job's end: what it still served -- AD-PSGD's
                # final replica -- died with it; the strategy's service is told)
                log.warning("worker %d (%s) finished, then its process died", wid, self._workers[wid].name)
                self._service.on_dead(wid)
            elif state not in (rdv.WorkerState.LEFT, rdv.WorkerState.DONE, rdv.WorkerState.DEAD):
                self._death_noticed(wid, "its process is gone (its liveness connection closed)")

    def end_facts(self, wid: int) -> dict[str, Any]:
        """(Under the lock; in the heartbeat reply to ``wid``.)  ``gone``: the workers declared
        dead or gone (PS workers evict them from the shards, docs/ps.md); ``report``: the worker
        that reports the job's result because the one due to is gone (``rdv.reporter``), or None
        -- asked only for a worker that is done (one waiting to hear it); ``standby`` (for a
        worker that is done only): the one finished worker that stays ready to (``rdv.standby``)."""
        gone = [w for w, m in self._rdv.workers.items() if m.state in _GONE_FOR_PS][-64:]
        if self._state_of(wid) is not rdv.WorkerState.DONE:
            return {"gone": gone, "report": None}
        return {
            "gone": gone,
            "report": rdv.reporter(self._rdv, self._done_exited),
            "standby": rdv.standby(self._rdv, self._done_exited),
        }

    def _death_noticed(self, wid: int, why: str) -> None:
        """(Under the lock.)  A worker the job's end made done (``Finished``: every worker still
        training) that never reported its own last step had failed before: it is lost, though
        the notice came after the end (a short job can end before the launcher reaps a crash)."""
        name = self._workers[wid].name
        if self._state_of(wid) is rdv.WorkerState.DONE and wid not in self._finished:
            log.warning("worker %d (%s) had failed before the job's end: %s", wid, name, why)
            self._lost.notice(wid, why)
            if self._lost.note(wid, name, ev.DeathNoticed(wid, self._now()), suspected=False):
                self._sink.event("lost", f"worker {wid} ({name})")
        if self._state_of(wid) in (rdv.WorkerState.LEFT, rdv.WorkerState.DONE):
            self._sink.close_clock(wid, keep=True)  # it had finished: its clocks count
        elif self._state_of(wid) is not rdv.WorkerState.DEAD:
            log.warning("death notice for worker %d (%s): %s", wid, self._workers[wid].name, why)
            self._lost.notice(wid, why)
        self._apply(ev.DeathNoticed(wid, self._now()))

    def mark_left(self, name: str) -> None:
        """The launcher saw the process of ``name`` exit normally (its records are all in)."""
        with self._lock:
            for wid in self._ids_named(name):
                if self._state_of(wid) is rdv.WorkerState.DONE:  # (it cannot report the result any more)
                    self._done_exited = self._done_exited | {wid}
                self._sink.close_clock(wid, keep=True)
                self._note_left(wid, "its process exited (code 0)")
                self._apply(ev.Exited(wid, self._now()))

    def _note_left(self, wid: int, why: str) -> None:  # (a leave before the job was over: summary)
        over = self._rdv.done or self._rdv.stop
        if not over and self._state_of(wid) not in (rdv.WorkerState.DEAD, rdv.WorkerState.DONE):
            self._lost.left(wid, self._workers[wid].name, why)

    def _row_state(self, wid: int) -> str:
        """Its state for the display and the summary: ``dead`` for one the job's end made done
        that had failed before (``_death_noticed``)."""
        state = self._state_of(wid)
        if state is rdv.WorkerState.DONE and wid not in self._finished and self._lost.holds(wid):
            return rdv.WorkerState.DEAD.value
        return state.value

    def settle_clocks(self) -> None:
        """No more records will come (the job is over and its workers exited, or the launcher
        stopped waiting for them): sweep every clock record in, for the summary."""
        with self._lock:
            for wid in self._workers:
                self._sink.close_clock(wid, keep=True)

    def request_stop(self) -> None:
        with self._lock:
            self._apply(ev.StopRequested(self._now()))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            view, clocks = self._rdv.adopted, self._sink.clocks
            return {
                "epoch": self._rdv.adopted_epoch,
                "latest_epoch": self._rdv.latest_epoch,
                "members": list(view.members) if view else [],
                "done": self._rdv.done,
                "stop": self._rdv.stop,
                "final": dict(self._final),
                "error": self._final.get("error"),
                "evals": list(self._sink.evals),
                "elapsed_s": time.time() - self._t0_unix,
                "t0_unix": self._t0_unix,
                "strategy": self.cfg.strategy.kind,
                "workers": [
                    dict(i.row(), state=self._row_state(w), pid=i.pid) for w, i in self._workers.items()
                ],
                "clock_spread": None if clocks is None else clocks.spread,
                "max_clock_spread": None if clocks is None else clocks.max_spread,
                "members_lost": self._lost.to_list(),
                "members_left": self._lost.left_list(),
                "rejections": rejection_counts(),  # this process's, by reason and sender
                **({self.cfg.strategy_spec.kind: self._service.stats()} if self._service is not None else {}),
            }
