"""AD-PSGD's end (``sync/adpsgd.py``): a worker's last step makes its replica final
(``mark_finished``: no exchange touches it any more, and the directory hears it finished); the
exported model is the average of the final replicas that are still live, taken by one worker,
the *collector* (``adpsgd_plan.collector``): the job's rank 0, which waits until every other
member finished or died -- or, when it died first, the lowest finished worker whose replica lives.

So a finished worker that is not the job's rank 0 does not leave at once: it serves its replica
and watches the directory until the job is over (``take_over``), and takes over the average --
then reports the job's result itself -- when the one that was to do it died (before its last step,
while it waited, or after the average but before the job's end: the directory then forgets that
average).  One rule on every worker, from the same directory facts: only the lowest live finished
worker averages, so two collectors need two workers each believing the other dead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flotilla.core.log import get_logger
from flotilla.sync import adpsgd_plan as plan
from flotilla.sync.adpsgd_replica import Replica

__all__ = ["Ending"]

log = get_logger("adpsgd")


class Ending(Replica):
    """The end of a replica's training (see the module doc)."""

    def training_done(self) -> bool:
        if self._done or self._units % self.settings.status_every:
            return self._done
        status = self._status()
        if status is not None:
            others = set(self.members) - {self.worker_id} - self._dead - set(self._gone())
            self._done = bool(self._finished) and others <= self._finished
        return self._done

    def mark_finished(self) -> None:
        """The replica is final: the averages committed since the last step are applied, and no
        exchange touches it any more."""
        self._end_eval()
        self._take()
        try:
            self._apply_pending()
            with self._cv:
                self._final = True
                self._slot.closed = True
        finally:
            self._release()
        with self._cv:  # (the exchanges served after its last record: the directory keeps them)
            tail, self._served = self._served, []
        body = {"worker_id": self.worker_id, "tail": tail, "spectator": self._spectator}
        try:
            self._link.call("adpsgd_finish", body, timeout_s=5.0)
        except Exception as exc:
            log.warning("worker %d: could not tell the coordinator it finished: %s", self.worker_id, exc)

    def finalize(self, stop: Callable[[], bool]) -> bool:
        """The job's rank 0: once every other member finished or died (at most ``final_timeout_s``:
        then without the missing ones), average the live final replicas -- unless a lower
        finished worker is live (it averages them: this one waits for the job's end)."""
        return self._collect_when_due(stop, rank0=True)

    def take_over(
        self, stop: Callable[[], bool], chosen: Callable[[], bool], standby: Callable[[], bool] = lambda: True
    ) -> bool:
        """Any other finished worker: wait for the job's end, and average the replicas itself if
        it became the collector (the one before it died); at most twice ``final_timeout_s``.  (Its
        own rule, from the directory: ``chosen``, the coordinator's, is not needed.)"""
        return self._collect_when_due(stop, rank0=False)

    def _collect_when_due(self, stop: Callable[[], bool], *, rank0: bool) -> bool:
        self._end_eval()
        start = self._now()
        self._linger_until = start + 2 * self.settings.final_timeout_s  # (close waits no longer)
        while not stop():
            s = self._status()
            if s is None and not rank0:  # (no coordinator: rank 0 writes the result by its records)
                return False
            lost = self._dead | self._lost_finals
            # (after each status: a joiner this worker had not heard of yet is waited for too)
            others = set(self.members) - {self.worker_id}
            missing = sorted(others - self._finished - lost - set(self._gone()))
            late = self._now() - start > self.settings.final_timeout_s
            mine = plan.collector(self._finished | {self.worker_id}, lost) == self.worker_id
            mine = mine and not self._spectator
            if mine and (not missing or late) and not (s or {}).get("collected"):
                if missing:
                    log.error("adpsgd: workers %s neither finished nor died within %g s: averaged "
                              "without them", missing, self.settings.final_timeout_s)  # fmt: skip
                if not rank0:
                    log.warning("adpsgd: worker %d takes over the final average (the job's rank 0 is gone)",
                                self.worker_id)  # fmt: skip
                self._collect(others)
                return True
            if self._now() - start > 2 * self.settings.final_timeout_s:
                log.error("adpsgd: worker %d: the job did not end within %g s of its last step",
                          self.worker_id, 2 * self.settings.final_timeout_s)  # fmt: skip
                return False
            time.sleep(0.05)
        return False

    def _collect(self, others: set[int]) -> None:
        """Average this replica with the final replicas of the finished others that live."""
        replicas = {self.worker_id: self._flat()}
        for w in sorted(others & self._finished):
            if w in self._lost_finals or w in self._dead:
                log.error("adpsgd: worker %d finished, then its process died: left out of the average", w)
                continue
            flat = self._fetch_final(w)
            if flat is not None:
                replicas[w] = flat
        with self._cv:  # (a joiner may be taking this final replica meanwhile: _on_state)
            self._write(self._average(replicas))
        self._record["adpsgd_consensus"] = sorted(replicas)
        try:
            self._link.call(
                "adpsgd_collected", {"worker_id": self.worker_id, "members": sorted(replicas)}, timeout_s=5.0
            )
        except Exception as exc:
            log.warning("adpsgd: could not report the consensus: %s", exc)
        log.info("adpsgd: the exported model averages the replicas of workers %s", sorted(replicas))

    def _fetch_final(self, w: int) -> torch.Tensor | None:
        flat = self._fetch(w, "adpsgd_final", tries=3)
        if flat is None:
            log.error("adpsgd: worker %d's final replica could not be fetched: left out of the average", w)
        return flat

    def close(self) -> None:
        """A finished worker serves its replica until the consensus has it (or ``final_timeout_s``;
        after ``finalize`` / ``take_over``, no later than they would have waited: twice that from
        their start)."""
        if self._closed:
            return
        self._closed = True
        self._end_eval()
        self._take()  # (an exchange in progress with this worker ends first)
        with self._cv:
            self._slot.closed = True
        self._release()
        if self._final:
            deadline = self._now() + self.settings.final_timeout_s
            if self._linger_until is not None:  # (it waited for the job's end already: not again)
                deadline = min(deadline, self._linger_until)
            while self._now() < deadline:
                s = self._status()
                if s is None or s.get("collected"):
                    break
                time.sleep(0.05)
        with self._cv:
            self._slot.closed = True
        for op in (
            "adpsgd_prepare",
            "adpsgd_commit",
            "adpsgd_abort",
            "adpsgd_final",
            "adpsgd_peek",
            "adpsgd_state",
        ):
            self._peers.unregister(op)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
