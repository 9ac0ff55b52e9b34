"""AD-PSGD's replica (``sync/adpsgd.py``): its weights as one flat vector, its one-exchange slot
(``adpsgd_plan.Slot``) and what peers call on its peer server (prepare, commit, abort, peek, the
final replica, the state a joiner takes), the directory's status and the fetch of a peer's
replica.  Split from the worker's own side by concern: these run on the peer server's thread (the
end of training: ``sync/adpsgd_end.py``); the state they share is declared here and set by
:class:`~flotilla.sync.adpsgd.ADPSGD`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from flotilla.comm.endpoint import Reply
from flotilla.core.errors import CommError, RemoteError
from flotilla.core.log import get_logger
from flotilla.sync import adpsgd_plan as plan
from flotilla.sync.base import SyncStrategy
from flotilla.sync.state import all_finite, export_state

__all__ = ["Replica"]

log = get_logger("adpsgd")


class Replica(SyncStrategy):
    """The replica's state and the calls on it (see the module doc); abstract: ``ADPSGD``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: Any
    worker_id: int
    members: tuple[int, ...]
    version: int
    _peers: Any
    _link: Any
    _gone: Callable[[], frozenset[int]]
    _now: Callable[[], float]
    _state: list[torch.Tensor]
    _numel: int
    _slot: plan.Slot
    _cv: threading.Condition
    _pending: torch.Tensor | None
    _prepared: torch.Tensor | None
    _prepared_versions: tuple[int, int]
    _served: list[list[Any]]
    _finished: set[int]
    _dead: set[int]
    _lost_finals: set[int]
    _clients: dict[str, Any]
    _seq: int
    _step: int
    _units: int
    _done: bool
    _final: bool
    _linger_until: float | None
    _spectator: bool
    _closed: bool
    _ready: bool
    _record: dict[str, Any]
    _own_saved: torch.Tensor | None
    _params_version: int

    def _end_eval(self) -> None:
        """Put back this worker's own replica after an evaluation of the average."""
        if self._own_saved is not None:
            self._write(self._own_saved)
            self._own_saved = None
            self._release()

    def _take(self) -> None:
        """Hold this worker's slot (waiting while a peer's exchange with it is open)."""
        with self._cv:
            while True:
                self._expire()
                if self._slot.take(self._now()):
                    return
                h = self._slot.holder
                wait = h.deadline - self._now() if isinstance(h, plan.Prepared) else 0.05
                self._cv.wait(max(0.001, min(wait, 0.05)))

    def _expire(self) -> None:
        """(Under the lock.) Abort the prepared exchange whose active died (the coordinator
        declared it dead: at once) or stalled (its deadline passed)."""
        expired = self._slot.expire(self._now(), self._gone() | self._dead)
        if expired is not None:
            self._prepared = None
            self._note_served(expired, "aborted")

    def _release(self) -> None:
        with self._cv:
            self._slot.release()
            self._cv.notify_all()

    def _apply_pending(self) -> None:
        with self._cv:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._write(pending)
        self._params_version = self.version

    def _client(self, address: str) -> Any:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = self._peers.connect(address)
        return client

    # ------------------------------------------------------------------ the passive side (server thread)
    def _on_prepare(self, req: Any) -> Any:
        b = req.body
        xid, active = str(b["xid"]), int(b["active"])
        theirs = req.tensors[0] if len(req.tensors) == 1 else None
        if theirs is None or theirs.dtype != torch.float32 or theirs.numel() != self._numel:
            raise RemoteError(
                "bad_request", f"adpsgd_prepare: one float32 tensor of {self._numel} values expected"
            )
        if not all_finite([theirs]):
            raise RemoteError("bad_request", "adpsgd_prepare: non-finite weights")
        with self._cv:
            if not self._ready:
                return {"status": "starting"}
            self._expire()
            status = self._slot.prepare(xid, active, self._now(), self.settings.exchange_timeout_s)
            if status != "prepared":
                return {"status": status}
            mine = self._pending if self._pending is not None else self._flat()
            avg = (mine + theirs.reshape(-1)) * 0.5
            self._prepared = avg
            self._prepared_versions = (self.version, int(b["version"]))
            version = self.version
        return Reply({"status": "prepared", "version": version}, [avg])

    def _on_commit(self, req: Any) -> dict[str, Any]:
        xid = str(req.body["xid"])
        with self._cv:
            h = self._slot.holder
            outcome = self._slot.commit(xid)
            if isinstance(h, plan.Prepared) and h.xid == xid and outcome == "committed":
                self._pending, self._prepared = self._prepared, None
                self._note_served(h, "committed")
                self.version += 1
                self._cv.notify_all()
        return {"status": outcome}

    def _on_abort(self, req: Any) -> dict[str, Any]:
        xid = str(req.body["xid"])
        with self._cv:
            h = self._slot.holder
            outcome = self._slot.abort(xid)
            if isinstance(h, plan.Prepared) and h.xid == xid and outcome == "aborted":
                self._prepared = None
                self._note_served(h, "aborted")
                self._cv.notify_all()
        return {"status": outcome}

    def _on_peek(self, req: Any) -> Any:
        """This replica's current weights (for rank 0's evaluation of the average); ``busy``
        while the worker's own step changes them."""
        with self._cv:
            if self._slot.holder == "self" or self._own_saved is not None or not self._ready:
                return {"status": "busy"}
            flat = self._pending if self._pending is not None else self._flat()
        return Reply({"status": "ok"}, [flat])

    def _on_state(self, req: Any) -> Any:
        """This replica and its optimizer's state, for a joiner (the slot held meanwhile, so no
        step or average changes them)."""
        with self._cv:
            if not self._ready:
                return {"status": "starting"}  # (a joiner itself: it holds no replica yet)
            if self._final and not self._spectator:  # (nothing changes it but the final average,
                meta, tensors = export_state(self.model, self.optimizer, {})  # which holds the lock)
                clones = [t.detach().clone() for t in tensors]
                return Reply({"status": "ok", "meta": meta, "step": self._step}, clones)
            self._seq += 1
            hold = f"state:{self.worker_id}:{self._seq}"
            if self._slot.prepare(hold, -1, self._now(), self.settings.exchange_timeout_s) != "prepared":
                return {"status": "busy"}
        try:  # (the parameters, which its optimizer's state belongs to; not an average waiting)
            meta, tensors = export_state(self.model, self.optimizer, {})
            step = self._step
        finally:
            with self._cv:
                self._slot.abort(hold)
                self._cv.notify_all()
        return Reply({"status": "ok", "meta": meta, "step": step}, [t.detach().clone() for t in tensors])

    def _on_final(self, req: Any) -> Any:
        with self._cv:
            if not self._final:
                return {"status": "training"}
            flat = self._flat()
        return Reply({"status": "final"}, [flat])

    def _note_served(self, h: plan.Prepared | None, outcome: str) -> None:
        """(Under the lock.) ``[xid, active, outcome, our version, the active's version]``."""
        if isinstance(h, plan.Prepared):
            self._served.append([h.xid, h.active, outcome, *self._prepared_versions])

    # ------------------------------------------------------------------ the directory, peers' replicas
    def _status(self) -> dict[str, Any] | None:
        try:
            s = self._link.call("adpsgd_status", {}, timeout_s=5.0)
        except Exception as exc:  # (the coordinator may be gone: train on with what we know)
            log.debug("adpsgd_status: %s", exc)
            return None
        self._finished |= {int(w) for w in s.get("finished", ())}
        if s.get("live"):  # (the coordinator's live workers: joiners become peers, the dead leave)
            # (a union: a finished worker leaves the live list but its replica is in the result)
            self.members = tuple(sorted({int(w) for w in s["live"]} | set(self.members)))
        self._dead |= {int(w) for w in s.get("dead", ())}
        self._lost_finals |= {int(w) for w in s.get("gone", ())}
        self._dead |= {int(w) for w in s.get("spectators", ())}  # (no replica of theirs is in the result)
        return s

    def _fetch(self, w: int, op: str, *, tries: int) -> torch.Tensor | None:
        """Worker ``w``'s replica by ``op`` (``adpsgd_final``, ``adpsgd_peek``); None: not had."""
        address = self._peers.address_of(w)
        for _ in range(tries):
            if address is None:
                return None
            try:
                reply = self._client(address).call(op, {}, timeout_s=self.settings.exchange_timeout_s)
            except CommError as exc:
                log.warning("adpsgd: worker %d's replica (%s): %s", w, op, exc)
                self._status()
                if w in self._dead or w in self._lost_finals:
                    return None
                continue
            status = reply.body.get("status")
            if status == "busy":
                time.sleep(0.005)
                continue
            t = reply.tensors[0] if len(reply.tensors) == 1 else None
            if (
                status in ("final", "ok")
                and t is not None
                and t.dtype == torch.float32
                and t.numel() == self._numel
            ):
                return t.reshape(-1)
            return None
        return None

    # ------------------------------------------------------------------ flat state
    def _flat(self) -> torch.Tensor:
        """The replica as one float32 vector in host memory (what an exchange sends and averages;
        a CUDA replica is staged through it, :meth:`_write` copies the result back)."""
        return torch.cat([t.detach().reshape(-1).float() for t in self._state]).cpu()

    def _average(self, replicas: dict[int, torch.Tensor]) -> torch.Tensor:
        """The mean of ``replicas`` (worker id -> flat weights), summed in float64 in worker-id
        order: the same bits whichever worker computes it."""
        total = torch.zeros(self._numel, dtype=torch.float64)
        for w in sorted(replicas):
            total += replicas[w].double()
        return (total / len(replicas)).float()

    def _write(self, flat: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for t in self._state:
                n = t.numel()
                t.copy_(flat[at : at + n].view_as(t).to(t.dtype))
                at += n
