"""AD-PSGD's joining (``sync/adpsgd.py``): a worker that joined the running job takes a live
peer's replica and optimizer state before its first step (``adpsgd_state``, served by
``sync/adpsgd_replica.py``), or learns that the model is lost (``StateLost``).  Between the
replica (what peers call) and the worker's own side (its steps and exchanges).
"""

from __future__ import annotations

import time

from flotilla.core.errors import CommError
from flotilla.core.log import get_logger
from flotilla.sync.adpsgd_end import Ending
from flotilla.sync.plan import StateLost
from flotilla.sync.state import import_state

__all__ = ["Joining"]

log = get_logger("adpsgd")


class Joining(Ending):
    """A replica that may have joined the running job (``_joined``; see the module doc)."""

    _joined: bool  # (set by the worker's side: it joined the running job, holds no state yet)
    _joined_at: int

    def start(self) -> None:
        """A worker that joined the running job takes a live peer's replica and optimizer state
        (and starts at that peer's step); until then it takes no average.  A peer busy in an
        exchange is asked again; when no live peer holds a replica (each is gone or itself
        joining), the model is lost for it: ``StateLost`` (the loop then resumes from the job's
        newest checkpoint, if it has one, else this worker stops with that error)."""
        if not self._joined or self._ready:
            return
        deadline = self._now() + self.settings.final_timeout_s
        while True:
            self._status()
            donors = sorted(
                set(self.members) - {self.worker_id} - self._dead - set(self._gone()) - self._finished
            )
            answers: list[str] = []
            for w in donors:  # (in id order; the first that lends is the one)
                answers.append(self._borrow(w))
                if answers[-1] == "ok":
                    break
            if "ok" in answers:
                break
            if "busy" not in answers and self._spectate():
                break
            if "busy" not in answers:  # (no live holder: none, or every one joining too)
                raise StateLost(
                    f"worker {self.worker_id} joined, but no live peer holds a replica (peers {donors} "
                    "are gone or joining themselves): every worker that had the model is gone"
                )
            if self._now() > deadline:
                raise StateLost(
                    f"worker {self.worker_id} joined, but no peer lent its replica within "
                    f"{self.settings.final_timeout_s:g} s (final_timeout_s): each was busy"
                )
            time.sleep(0.02)
        with self._cv:
            self._ready = True

    def _spectate(self) -> bool:
        """No live peer trains any more (each finished: the job is ending) -- take a finished
        peer's final state and step, train no further (``training_done`` at once) and stay out of
        the final average (``spectator``: it holds no replica of its own); False when none lends
        one.  Before, it resumed from the newest checkpoint and that old state, trained a few
        steps, was averaged into the exported model like a replica."""
        lost = self._dead | self._lost_finals | set(self._gone())
        for w in sorted(self._finished - lost - {self.worker_id}):
            if self._borrow(w) == "ok":
                self._spectator = self._done = True
                log.warning("worker %d joined as the job ends (every peer finished): it takes no part in the "
                            "final average", self.worker_id)  # fmt: skip
                return True
        return False

    def _borrow(self, w: int) -> str:
        """Ask peer ``w`` for its replica: "ok" (taken), "busy" (ask again) or "none"."""
        address = self._peers.address_of(w)
        if address is None:
            return "none"
        try:
            reply = self._client(address).call("adpsgd_state", {}, timeout_s=self.settings.exchange_timeout_s)
            status = reply.body.get("status")
            if status != "ok":
                return "busy" if status == "busy" else "none"
            import_state(self.model, self.optimizer, reply.body["meta"], list(reply.tensors))
        except (CommError, KeyError, TypeError, ValueError, IndexError) as exc:
            log.warning("worker %d: the state of peer %d could not be taken: %s", self.worker_id, w, exc)
            return "none"
        self._joined_at = int(reply.body.get("step", 0))
        log.info("worker %d joined with peer %d's replica at step %d", self.worker_id, w, self._joined_at)
        return "ok"

    def joined_at(self) -> int:
        return self._joined_at
