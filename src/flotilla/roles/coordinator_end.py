"""The job's end as workers tell it to the coordinator (a mixin of
:class:`flotilla.roles.coordinator.Coordinator`, which holds the state named below): ``finish``
-- the job's result, from the worker that reports it (its view's rank 0 at its last step, or one
that took over: ``rendezvous.reporter``) -- and ``fail_job`` -- a worker stops the whole job (a
non-finite value every member agreed on, or its task raised under ``job.on_error: stop``: the
first report by a worker that saw it itself is the job's error line).  Neither is taken after the
job's result, nor from a worker the job is rid of (dead, or left).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flotilla.cluster import rendezvous as rdv
from flotilla.cluster import rendezvous_events as ev
from flotilla.core.log import get_logger
from flotilla.roles.metrics_sink import WorkerInfo

__all__ = ["EndSide"]

log = get_logger("coordinator")


class EndSide:
    """(See the module doc.)"""

    _lock: threading.RLock
    _workers: dict[int, WorkerInfo]
    _rdv: Any
    _finished: set[int]
    _final: dict[str, Any]
    _now: Callable[[], float]
    _apply: Callable[[ev.Event], ev.Reply]
    _state_of: Callable[[int], rdv.WorkerState]

    def _on_finish(self, req: Any) -> dict[str, Any]:
        with self._lock:
            self._finished.add(int(req.body.get("worker_id", -1)))
            self._final = dict(req.body.get("result", {}))
            self._apply(ev.Finished(self._now()))
            return {"ok": True}

    def _on_fail_job(self, req: Any) -> dict[str, Any]:
        """A worker stops the whole job (module doc): the job stops, and the first report by a
        worker that saw the cause itself becomes the job's error line."""
        b = req.body
        with self._lock:
            wid = int(b["worker_id"])
            gone = (rdv.WorkerState.DEAD, rdv.WorkerState.LEFT)
            if self._rdv.done or wid not in self._workers or self._state_of(wid) in gone:
                return {"ok": False}  # (after the job's result, or from a worker the job is rid of)
            known = self._final.get("error")
            if known is None or (b["own"] and not self._final.get("error_own")):
                self._final.update(error=str(b["reason"])[:500], error_own=bool(b["own"]), steps=b["step"])
                log.error("job stopped by worker %d: %s", int(b["worker_id"]), self._final["error"])
            if b.get("model_file"):  # rank 0 exported the last finite weights
                self._final["model_file"] = str(b["model_file"])
            self._apply(ev.StopRequested(self._now()))
            return {"ok": True}
