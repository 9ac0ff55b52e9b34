"""AD-PSGD's service on the coordinator (``StrategySpec.service`` of ``sync/adpsgd.py``): who
finished, who died, and whether the final consensus has collected the replicas.  The exchanges
themselves go worker to worker; this only answers the questions every worker must answer alike.

- ``adpsgd_finish`` {worker_id, tail, spectator}: the worker trained its last step; its replica is
  final (it serves it for the consensus and takes no average any more); ``tail``: the exchanges it
  served after its last record (kept for the summary: the records plus these are every exchange);
  ``spectator``: it joined as the job ended (``sync/adpsgd_join.py``): no replica of its own, out
  of the consensus (``spectators`` in the status).
- ``adpsgd_status`` {}: ``live`` (the coordinator's live workers: joiners become peers),
  ``finished``, ``dead`` (declared dead by the coordinator before it finished), ``gone`` (it
  finished, then its process died before the consensus fetched its replica: left out of it) and
  ``collected`` (the consensus is done: finished workers may close).
- ``adpsgd_collected`` {worker_id, members}: the collector (the job's rank 0, or the finished
  worker that took over from it: ``sync/adpsgd_end.py``) averaged the replicas of ``members``;
  logged.  Should the collector die before the job's end, that average is forgotten (``collected``
  false again, the collector ``gone``): the next live finished worker takes over.
"""

from __future__ import annotations

import threading
from typing import Any

from flotilla.comm.schema import IntRange
from flotilla.core.log import get_logger
from flotilla.sync.spec import ServiceFacts

__all__ = ["PeerDirectory"]

log = get_logger("adpsgd")

WORKER = IntRange(0, 2**31 - 1)


class PeerDirectory:
    def __init__(self, num_workers: int, snapshot: Any = None) -> None:
        self.num_workers, self._snapshot = num_workers, snapshot
        self._lock = threading.Lock()
        self.finished: set[int] = set()
        self.dead: set[int] = set()
        self.gone: set[int] = set()  # finished, then died before the consensus collected its replica
        self.spectators: set[int] = set()  # joined as the job ended: no replica in the consensus
        self.collected: tuple[int, ...] | None = None
        self.collector: int | None = None  # who reported ``collected``
        # per worker, the exchanges it served after its last record (``adpsgd_served`` entries)
        self.tails: dict[int, list[Any]] = {}

    @classmethod
    def of_facts(cls, facts: ServiceFacts) -> PeerDirectory:
        return cls(facts.num_workers, facts.snapshot)

    def handlers(self) -> dict[str, tuple[Any, dict[str, Any]]]:
        return {
            "adpsgd_finish": (
                self._on_finish,
                {"worker_id": WORKER, "tail": (list, None), "spectator": (bool, None)},
            ),
            "adpsgd_status": (self._on_status, {}),
            "adpsgd_collected": (self._on_collected, {"worker_id": WORKER, "members": list}),
        }

    def _on_finish(self, req: Any) -> dict[str, Any]:
        wid = int(req.body["worker_id"])
        tail = req.body.get("tail") or []
        with self._lock:
            if req.body.get("spectator"):
                self.spectators.add(wid)
            elif wid not in self.dead:
                self.finished.add(wid)
                self.tails[wid] = list(tail)[:10_000]
        return {"ok": True}

    def _on_status(self, req: Any) -> dict[str, Any]:
        live = list(self._snapshot().live) if self._snapshot is not None else []
        with self._lock:
            return {
                "live": live,
                "finished": sorted(self.finished),
                "dead": sorted(self.dead),
                "gone": sorted(self.gone),
                "spectators": sorted(self.spectators),
                "collected": self.collected is not None,
            }

    def _on_collected(self, req: Any) -> dict[str, Any]:
        members = tuple(int(m) for m in req.body["members"] if isinstance(m, int) and not isinstance(m, bool))
        with self._lock:
            self.collected, self.collector = members, int(req.body["worker_id"])
        log.info("adpsgd: the final model is the average of the replicas of workers %s (by worker %d)",
                 list(members), self.collector)  # fmt: skip
        return {"ok": True}

    def on_dead(self, worker_id: int) -> None:
        with self._lock:
            if worker_id not in self.finished:
                self.dead.add(worker_id)
            elif self.collected is None:  # (its final replica died with it: the consensus skips it)
                self.gone.add(worker_id)
            elif worker_id == self.collector:  # (before the job's end: its average died with it)
                log.warning("adpsgd: worker %d died after averaging the final replicas: another takes over",
                            worker_id)  # fmt: skip
                self.gone.add(worker_id)
                self.collected = self.collector = None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "finished": len(self.finished),
                "dead": len(self.dead),
                "finished_then_died": sorted(self.gone),
                "consensus_of": list(self.collected) if self.collected is not None else None,
                "served_after_last_record": {str(w): t for w, t in self.tails.items() if t},
            }
