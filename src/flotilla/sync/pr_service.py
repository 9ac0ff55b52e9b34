"""The partial-reduce controller, the strategy's service on the coordinator (``StrategySpec.service``
of ``sync/partial_reduce.py``): message-plane handlers around the pure
:class:`~flotilla.sync.pr_plan.GroupController` (SPEC §5).

- ``pr_ready`` {worker_id, seq, version, step, fresh}: the first call of a ``seq`` puts the worker
  in the ready queue; later calls with the same ``seq`` poll.  Reply ``wait``, ``group`` (group_id,
  members, versions, weights, namespace, and ``step``: the most steps a holder in it has done),
  ``solo`` (nothing to average with), ``done`` (the others finished: this worker's training is
  over, ``GroupController.done_for``), ``stop`` (the job ends) or ``lost`` (a newcomer no live
  worker can fill).  A worker the controller does not count live is admitted
  (``GroupController.admit``) when the coordinator counts it live and it was never declared dead:
  ``fresh``, a worker that joined the running job and holds no model, as a newcomer; otherwise
  (it joined while another strategy ran, or left partial reduce for one and came back: an
  adaptive switch) as a holder of its own model.
  A ``seq`` other than the last one or the next one is a replay: refused, logged, nothing changes.
- ``pr_done`` {worker_id, group_id, ok}: a member's outcome of the group's all-reduce, then polls
  of the group's state: ``wait`` (open), ``committed`` or ``aborted``.  A report on a group the
  sender is not a member of is refused and logged.
- ``pr_leave`` {worker_id, finished}: the worker is out of the queue (open groups it had not
  reduced are aborted); ``finished``: it trained its last step, counted as finished
  (``GroupController.finish``: a partner left alone is then done); otherwise it left mid-run (a
  strategy switch, SIGTERM) and is dropped like a dead worker.  :meth:`on_dead` drops a worker
  the coordinator declared dead.

Every handler takes the runtime's own lock (the coordinator's launcher thread reports deaths).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.sync.pr_plan import ControllerConfig, ControllerError, GroupController, GroupState
from flotilla.sync.spec import ServiceFacts

__all__ = ["PRController"]

log = get_logger("pr_controller")

_STATUS = {GroupState.OPEN: "wait", GroupState.COMMITTED: "committed", GroupState.ABORTED: "aborted"}


class PRController:
    def __init__(
        self,
        config: ControllerConfig,
        num_workers: int,
        *,
        now: Callable[[], float] = time.monotonic,
        stopped: Callable[[], bool] = lambda: False,
        live: Callable[[], tuple[int, ...]] | None = None,
    ) -> None:
        self.config, self.num_workers = config, num_workers
        self._now, self._stopped, self._live = now, stopped, live
        self._lock = threading.Lock()
        self._ctrl: GroupController | None = None  # built when the first worker is ready
        self._seq: dict[int, int] = {}
        self._steps: dict[int, int] = {}  # worker -> the steps it had done at its last ready
        self._dead: set[int] = set()  # declared dead by the coordinator: never admitted again
        self._t0: float | None = None

    @classmethod
    def of_facts(cls, config: ControllerConfig, facts: ServiceFacts) -> PRController:
        """The controller of a run, hosted by its coordinator (the spec's ``service``)."""
        snapshot = facts.snapshot
        live = (lambda: snapshot().live) if snapshot is not None else None
        return cls(config, facts.num_workers, now=facts.now, stopped=facts.stopped, live=live)

    def handlers(self) -> dict[str, tuple[Callable[[Any], dict[str, Any]], dict[str, Any]]]:
        return {
            "pr_ready": (
                self._on_ready,
                {"worker_id": int, "seq": int, "version": int, "step": int, "fresh": bool},
            ),
            "pr_done": (self._on_done, {"worker_id": int, "group_id": int, "ok": bool}),
            "pr_leave": (self._on_leave, {"worker_id": int, "finished": (bool, None)}),
        }

    def _controller(self, newcomer: int | None = None) -> GroupController:
        if self._ctrl is None:
            # the workers live when the first one is ready (a job that switches into partial
            # reduce after workers joined: the coordinator's live set), else the first N ids
            # (worker ids are given out from 0 in join order); a newcomer asking first is not
            # one of them (it is admitted as what it is)
            live = [w for w in (self._live() if self._live is not None else ()) if w != newcomer]
            self._ctrl = GroupController(self.config, live or range(self.num_workers))
            self._t0 = self._now()
        return self._ctrl

    def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """The handler of ``op`` called directly (in-process tests)."""

        class _Req:
            def __init__(self, b: dict[str, Any]) -> None:
                self.body = b

        return self.handlers()[op][0](_Req(body))

    def _on_ready(self, req: Any) -> dict[str, Any]:
        b = req.body
        wid, seq, now = int(b["worker_id"]), int(b["seq"]), self._now()
        with self._lock:
            fresh = b.get("fresh") is True
            ctrl = self._controller(newcomer=wid if fresh else None)
            if wid not in ctrl.live and wid not in self._dead and self._counted_live(wid):
                self._refuse_if(lambda: ctrl.admit(wid, holder=not fresh), "pr_ready", wid)
                self._seq.pop(wid, None)  # (a new strategy instance: its seqs start again)
                what = "a newcomer" if fresh else "a holder of its own model"
                log.info("partial reduce: worker %d admitted as %s", wid, what)
            last = self._seq.get(wid, 0)
            if seq == last + 1:
                self._refuse_if(lambda: ctrl.ready(wid, int(b["version"]), now), "pr_ready", wid)
                self._seq[wid] = seq
                if isinstance(b.get("step"), int) and b["step"] >= 0:
                    self._steps[wid] = int(b["step"])
            elif seq != last:
                log.warning("refused pr_ready from worker %d: seq %d replayed (last %d)", wid, seq, last)
                raise RemoteError("replayed", f"pr_ready seq {seq}: expected {last} or {last + 1}")
            if ctrl.lost_for(wid):
                return {"status": "lost"}
            if self._stopped() and ctrl.assignment_for(wid) is None:
                ctrl.withdraw(wid)  # (the job ends: no group for it, and it may ask again)
                return {"status": "stop"}
            ctrl.form(now)
            a = ctrl.assignment_for(wid)
            if a is None:
                return {"status": "wait" if wid in ctrl.live else "stop"}
            if a.solo:
                return {"status": "done" if ctrl.done_for(wid) else "solo"}
            return {
                "status": "group",
                "group_id": a.group_id,
                "members": list(a.members),
                "versions": list(a.versions),
                "weights": list(a.weights),
                "namespace": a.namespace,
                "bridging": a.bridging,
                "step": max((self._steps.get(m, 0) for m in a.members), default=0),
            }

    def _counted_live(self, wid: int) -> bool:
        """Whether the coordinator counts ``wid`` among the live workers (a newcomer it admitted)."""
        return self._live is not None and wid in self._live()

    def _on_done(self, req: Any) -> dict[str, Any]:
        b = req.body
        wid, gid = int(b["worker_id"]), int(b["group_id"])
        with self._lock:
            ctrl = self._controller()
            state = self._refuse_if(lambda: ctrl.report(wid, gid, bool(b["ok"])), "pr_done", wid)
            return {"status": _STATUS[state]}

    def _on_leave(self, req: Any) -> dict[str, Any]:
        wid = int(req.body["worker_id"])
        with self._lock:
            ctrl = self._controller()
            if wid in ctrl.live:
                finished = req.body.get("finished") is not False  # (None: an older worker's leave)
                aborted = ctrl.finish(wid) if finished else ctrl.drop(wid)
                what = "finished" if finished else "left mid-run"
                log.info("partial reduce: worker %d %s; groups aborted: %s", wid, what, aborted)
                ctrl.form(self._now())
        return {"ok": True}

    def on_dead(self, worker_id: int, why: str = "dead") -> None:
        with self._lock:
            self._dead.add(worker_id)
            ctrl = self._controller()
            if worker_id in ctrl.live:
                aborted = ctrl.drop(worker_id)
                log.info("partial reduce: worker %d %s; groups aborted: %s", worker_id, why, aborted)
                ctrl.form(self._now())

    @staticmethod
    def _refuse_if(fn: Callable[[], Any], op: str, wid: int) -> Any:
        try:
            return fn()
        except ControllerError as exc:
            log.warning("refused %s from worker %d: %s", op, wid, exc)
            raise RemoteError("refused", str(exc)) from None

    def stats(self) -> dict[str, Any]:
        """Groups, groups per second, mean group size, per-worker version lag (summary, display)."""
        with self._lock:
            c = self._ctrl
            if c is None or self._t0 is None:
                return {
                    "groups": 0,
                    "aborted": 0,
                    "groups_per_s": 0.0,
                    "mean_group_size": 0.0,
                    "version_lag": {},
                }
            elapsed = max(self._now() - self._t0, 1e-9)
            return {
                "groups": c.committed,
                "aborted": c.aborted,
                "groups_per_s": round(c.committed / elapsed, 3),
                "mean_group_size": round(c.mean_group_size, 3),
                "version_lag": {str(w): lag for w, lag in c.version_lag().items()},
                "rounds": c.rounds_completed,
            }
