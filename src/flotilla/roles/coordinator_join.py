"""The coordinator's admission of workers (a mixin of :class:`flotilla.roles.coordinator.Coordinator`,
which holds the state named below): ``join`` registers a worker -- its speed, peer endpoint,
liveness listener -- and answers with what it needs to start (configuration, store, files).

A join is idempotent: the worker sends a random ``join_token`` and sends the same join again while
unanswered (``roles/worker.py``); a token seen before, for a worker still JOINED, gets the first
admission's reply (its silence clock restarted), so a lost reply never registers a worker twice;
a worker since declared dead, or an unknown token, is a new admission.  Every handler takes the
coordinator's lock.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from flotilla.cluster import rendezvous as rdv
from flotilla.cluster import rendezvous_events as ev
from flotilla.config import RunConfig
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.roles.metrics_sink import WorkerInfo
from flotilla.roles.peer_link import host_of

__all__ = ["JOIN_TOKEN", "JoinSide"]

JOIN_TOKEN = re.compile(r"[0-9a-f]{16,64}")
log = get_logger("coordinator")


class JoinSide:
    """(See the module doc.)"""

    cfg: RunConfig
    _lock: threading.RLock
    _rdv: Any
    _joins: dict[str, dict[str, Any]]
    _workers: dict[int, WorkerInfo]
    _peers: dict[int, str]
    _watched: dict[int, tuple[str, int]]
    _watch: Any
    _sink: Any
    _lost: Any
    _store: Any
    _live: Any
    _t0_unix: float
    ps_servers: Any
    files: Any
    _now: Callable[[], float]
    _apply: Callable[[ev.Event], ev.Reply]
    _state_of: Callable[[int], rdv.WorkerState]

    def _on_join(self, req: Any) -> dict[str, Any]:
        """Register a worker.  It enters a view only once it is *ready* (its first ``poll_view``,
        sent after it has loaded data and built its model), so survivors never wait for a
        newcomer's set-up inside a rendezvous."""
        body = req.body
        token = body.get("join_token")
        if token is not None and not JOIN_TOKEN.fullmatch(str(token)):
            raise RemoteError("bad_request", "join_token must be 16 to 64 hex digits")
        with self._lock:
            if self._rdv.done or self._rdv.stop:
                raise RemoteError("job_over", "the job has finished; no more joins")
            first = self._joins.pop(token, None) if token is not None else None
            if first is not None and self._state_of(first["worker_id"]) is rdv.WorkerState.JOINED:
                # a join sent again (its reply was lost), the worker still as admitted: the same
                # admission, its silence clock restarted
                self._apply(ev.Heartbeat(first["worker_id"], self._now(), False))
                log.info("join: %s sent again: worker %d", body.get("name"), first["worker_id"])
                self._joins[token] = first
                return first  # (else: a new admission below)
            name = str(body.get("name") or f"x{len(self._workers)}")
            speed = self._speed_for(name, body.get("speed"))
            if not 0.0 < speed <= 1.0:
                raise RemoteError(
                    "bad_speed", f"speed must be in (0, 1] (relative to the fastest device), got {speed}"
                )
            reply = self._apply(ev.Joined(self._now()))
            assert isinstance(reply, ev.Registered)
            wid = reply.worker_id
            self._workers[wid] = WorkerInfo(
                worker_id=wid, name=name, speed=speed, pid=int(body.get("pid", 0))
            )
            self._sink.expect(wid)
            if body.get("peer_address"):
                self._peers[wid] = str(body["peer_address"])
                live_host = host_of(self._peers[wid])
                if body.get("live_port") and live_host is not None and self._watch is not None:
                    self._watched[wid] = (live_host, int(body["live_port"]))
                    self._watch.watch(self._watched)
            self._lost.rejoined(name, wid)  # (a lost member of that name came back)
            if self._sink.top_step > 0:  # (a join once the job trains: a newcomer)
                self._sink.event("joined", f"{name} as worker {wid}")
            log.info("join: %s as worker %d (speed %.2f)", name, wid, speed)
            assert self._store is not None
            reply_body = {
                "worker_id": wid,
                "speed": speed,
                "config": self.cfg.to_dict(),
                "store_host": self._store.address.host,
                "store_port": self._store.address.port,
                "live_port": self._live.port if self._live is not None else 0,
                "t0_unix": self._t0_unix,
                "ps_servers": self.ps_servers,
                "files": self.files,
            }
            if token is not None:
                self._joins[token] = reply_body
            return reply_body

    def _speed_for(self, name: str, requested: Any) -> float:
        if requested is not None:
            return float(requested)
        for spec in self.cfg.cluster.resolved_workers():
            if spec.name == name:
                return float(spec.speed)
        return float(self.cfg.cluster.defaults.speed)
