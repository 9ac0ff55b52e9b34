"""The coordinator's view of the job's progress for its other parts (a mixin of
:class:`flotilla.roles.coordinator.Coordinator`, which holds the state named below): the live
workers' steps and rates for the switch announcer (``_progress``), the snapshot a strategy's
service reads (``_snapshot``), the step every worker in play has passed, which releases the
trackers' per-step means (``_slowest_live_step``), and markers from outside the coordinator (the
launcher's revocations: ``note_event``).  Every public method takes the coordinator's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flotilla.cluster.rendezvous_state import IN_PLAY
from flotilla.cluster.switch_announce import Progress
from flotilla.roles.metrics_sink import MetricsSink, WorkerInfo
from flotilla.sync.spec import JobSnapshot

__all__ = ["ProgressSide"]


class ProgressSide:
    """(See the module doc.)"""

    _lock: threading.RLock
    _workers: dict[int, WorkerInfo]
    _rdv: Any
    _sink: MetricsSink
    _now: Callable[[], float]
    _lost_at: list[float]

    def note_event(self, kind: str, text: str, step: int | None = None) -> None:
        """A marker for the trackers from another part of the run (the launcher's revocations, at
        the step it saw when it acted; None: the furthest step reported here)."""
        with self._lock:
            self._sink.event(kind, text, step)

    def _slowest_live_step(self) -> int | None:
        """The step every worker in play has passed (the trackers' per-step means): 0 while one
        of them has not reported yet, None when none is in play."""
        steps = []
        for wid, info in self._workers.items():
            if self._rdv.workers[wid].state in IN_PLAY:
                if info.last_record_step is None:
                    return 0
                steps.append(info.step)
        return min(steps) if steps else None

    def _progress(self) -> dict[int, Progress]:
        """The live workers' last reported steps and rates (a switch is announced beyond them)."""
        with self._lock:
            live = [w for w, m in self._rdv.workers.items() if m.state in IN_PLAY]
            return {w: Progress(self._workers[w].step, self._workers[w].steps_per_s) for w in live}

    def _snapshot(self) -> JobSnapshot:
        """The job's progress now, for a strategy's service (``sync.spec.JobSnapshot``)."""
        with self._lock:
            live = tuple(sorted(w for w, m in self._rdv.workers.items() if m.state in IN_PLAY))
            return JobSnapshot(
                now_s=self._now(),
                live=live,
                steps={w: self._workers[w].step for w in live},
                compute_s={w: self._workers[w].own_s for w in live if self._workers[w].own_s > 0},
                lost_at_s=tuple(self._lost_at),
            )
