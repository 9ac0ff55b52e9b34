"""A worker's link to the coordinator: requests, plus a heartbeat thread that ships metrics.

The heartbeat runs off the training thread: every ``interval_s`` it sends the queued metrics
records and learns the newest membership epoch, the stop flag and whether the current epoch is
broken (a member died: ``on_broken`` lets the worker abort that epoch's collectives at once).
Each reply carries a lease stamp (the coordinator's clock); the next heartbeat echoes the newest
one received -- the worker's lease renewal (``cluster/lease.py`` rule 1).

Without the coordinator (``coordinator_gone``: training goes on without it, every request to it
fails at once, the membership repairs the ring peer to peer, ``roles/ring_driver.py``), for one
of two reasons:

- **Proven gone**: the liveness connection to its process ended without a goodbye
  (``comm/liveness.py``).  Final: the records it would have received are appended to
  ``spool_path`` (JSON lines, in the run's output directory) instead.
- **Silent** (``silenced``): no reply for ``lease_s + margin_s`` (rule 3: a frozen coordinator,
  or a network cut; ``lease_s`` is ``cluster.heartbeat_timeout_s``).  Its lease has lapsed by
  then, so it mints no view this worker could miss.  The heartbeats go on without renewing
  anything: they carry the newest view its ring adopted (``ring_view``) and the records, which
  wait in the link.  The first reply is the heal: the coordinator has taken that view over where
  it was newer (rule 5), and the link is back.  A worker whose ring cannot go on alone (no
  majority) waits for that, up to its view wait.  Silence is judged after a heartbeat fails (its
  call waits up to ``max(1 s, 8 intervals)``), so ring mode may start up to that much later than
  the lease and margin -- later is safe.  Records still waiting when the worker exits are
  appended to ``spool_path``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.cluster.lease import LeaseTerms, coordinator_gone
from flotilla.cluster.membership import View
from flotilla.comm.liveness import LivenessWatch
from flotilla.comm.msgplane import Limits, connect
from flotilla.core.errors import CallTimeout, CommError
from flotilla.core.log import get_logger

log = get_logger("link")

HEARTBEAT_S = 0.25  # the link's heartbeat interval (and the lease's margin: cluster/lease.py)
SUSPECT_TRY_S = 1.0  # a suspect report unanswered this long is sent again (it is idempotent)
MAX_RECORDS_PER_BEAT = 2000  # ~1 MiB of msgpack: far below the coordinator's header limit
LINK_LIMITS = Limits(max_message_bytes=16 * 2**20, max_header_bytes=4 * 2**20)


class RecordBatches:
    """Records queued for the coordinator (or a pipeline's host), sent in numbered batches of at
    most ``max_records``: a batch not acknowledged is sent again as is, its number making it
    idempotent (the receiver ingests each number once).  :meth:`add` from any thread; the sender
    calls :meth:`batch` and :meth:`acked` (or :meth:`drain`) under its own send lock."""

    def __init__(self, max_records: int = MAX_RECORDS_PER_BEAT) -> None:
        self.max_records = max_records
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._seq = 0
        self._unacked: tuple[int, list[dict[str, Any]]] | None = None

    def add(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._records.append(rec)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._records) or self._unacked is not None

    def batch(self) -> tuple[int, list[dict[str, Any]]]:
        """The batch to send: the unacknowledged one again, else the next one, numbered."""
        if self._unacked is None:
            with self._lock:
                records = self._records[: self.max_records]
                self._records = self._records[self.max_records :]
            self._seq += 1
            self._unacked = (self._seq, records)
        return self._unacked

    def acked(self) -> None:
        self._unacked = None

    def drain(self) -> list[dict[str, Any]]:
        """Everything not acknowledged, in order, and forgotten (to be kept elsewhere)."""
        with self._lock:
            out = (self._unacked[1] if self._unacked is not None else []) + self._records
            self._records, self._unacked = [], None
        return out


def describe_coordinator(address: str, secret: bytes, *, wait_s: float = 120.0) -> dict[str, Any]:
    """What the coordinator at ``address`` runs (``describe``: ``strategy``; ``role: stage`` when a
    joining worker runs a pipeline stage), waiting up to ``wait_s`` for it to answer (a scheduler
    may start the workers first); CommError naming the address when it never does."""
    # (a sender of its own: the server orders each sender's messages, and many processes ask)
    client = connect(
        address, secret, sender=f"describe-{os.getpid()}-{secrets.token_hex(4)}", limits=LINK_LIMITS
    )
    deadline, said = time.monotonic() + wait_s, False
    try:
        while True:
            try:
                return dict(client.call("describe", {}, timeout_s=2.0).body)
            except CallTimeout:
                if time.monotonic() >= deadline:
                    raise CommError(
                        f"the coordinator at {address} did not answer within {wait_s:g} s: is it "
                        "running, and can this host reach that address and port? (docs/multihost.md)"
                    ) from None
                if not said:
                    log.info("waiting for the coordinator at %s", address)
                    said = True
    finally:
        client.close()


class CoordinatorLink:
    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        sender: str,
        interval_s: float = HEARTBEAT_S,
    ) -> None:
        self._address, self._secret, self._sender = address, secret, sender
        self._client = connect(address, secret, sender=sender, limits=LINK_LIMITS)
        self._watch_client: Any = None  # the peer watch's (roles/peer_link.py), on first use
        self._hb_client = connect(address, secret, sender=sender + "/hb", limits=LINK_LIMITS)
        self._interval_s = interval_s
        self._batches = RecordBatches()  # (at-most-once ingestion by batch number)
        self._send_lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self.worker_id: int | None = None
        self.latest_epoch = 0
        self.gone: frozenset[int] = frozenset()  # workers the coordinator declared dead or gone
        self.reporter: int | None = None  # who reports the job's result: its rank 0 is gone
        self.standby: int | None = None  # the finished worker that stays ready to (once this one is done)
        self.switches: tuple[tuple[int, int], ...] = ()  # announced (step, option) strategy switches
        self.broken_epoch = 0  # the newest epoch the coordinator said is broken
        self.on_broken: Callable[[int], None] | None = None  # called from the heartbeat thread
        self.stop_requested = False
        self.proven_gone = False  # its process is gone (module doc)
        self.silenced = False  # silent past its lease (module doc): it may answer again
        self.on_gone: Callable[[], None] | None = None  # (the liveness or the heartbeat thread)
        self.running: Callable[[], View | None] = lambda: None  # the view this worker runs
        self.ring_view: Callable[[], View | None] = lambda: None  # what a silenced link reports
        self._gone_lock = threading.Lock()  # (one False -> True transition: one on_gone)
        self.lease: LeaseTerms | None = None
        self._stamp: float | None = None  # the newest lease stamp received (echoed: a renewal)
        self._last_reply = time.monotonic()
        self.spool_path: Path | None = None
        self.spool_fields: dict[str, Any] = {}  # added to each spooled record (what the sink adds)
        self._live: LivenessWatch | None = None

    def watch_coordinator(self, live_port: int) -> None:
        """Hold a liveness connection to the coordinator (its port from the join reply)."""
        host = self._address[len("tcp://") :].rpartition(":")[0].strip("[]")
        if live_port > 0 and self._address.startswith("tcp://"):
            self._live = LivenessWatch(self._on_coordinator_closed, name=f"{self._sender}/coordinator")
            self._live.watch({0: (host, live_port)})

    @property
    def coordinator_gone(self) -> bool:
        """Training goes on without the coordinator (module doc): proven gone, or silent."""
        return self.proven_gone or self.silenced

    def _on_coordinator_closed(self, _peer: int, graceful: bool) -> None:
        if graceful:
            return  # (it shut down on purpose: the job is over, or the heartbeats will say)
        log.error("the coordinator's process is gone: training goes on without it")
        with self._gone_lock:
            was_gone = self.coordinator_gone
            self.proven_gone = True
        if self.on_gone is not None and not was_gone:
            self.on_gone()

    def call(self, op: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
        if self.coordinator_gone:
            raise CommError(f"{op}: the coordinator is gone")
        return self._client.call(op, body or {}, timeout_s=timeout_s).body

    def report_suspects(
        self, suspects: tuple[int, ...], epoch: int, *, closed: bool = False, timeout_s: float = 5.0
    ) -> None:
        """From the peer watch's threads (one at a time; its own connection): ring neighbours
        went silent (``closed``: their processes are gone).  A report is idempotent, so one that
        gets no answer within ``SUSPECT_TRY_S`` is sent again, until ``timeout_s`` in all (a
        lost request must not hold the survivors' recovery for the whole timeout)."""
        if self.coordinator_gone:
            raise CommError("suspect: the coordinator is gone")
        if self._watch_client is None:
            self._watch_client = connect(self._address, self._secret, sender=self._sender + "/watch")
        body = {"worker_id": self.worker_id, "epoch": epoch, "suspects": list(suspects), "closed": closed}
        deadline = time.monotonic() + timeout_s
        while True:
            try_s = max(0.05, min(SUSPECT_TRY_S, deadline - time.monotonic()))
            try:
                reply = self._watch_client.call("suspect", body, timeout_s=try_s).body
                break
            except CallTimeout:
                if time.monotonic() >= deadline or self.coordinator_gone:
                    raise
        self._note_broken(int(reply.get("broken", 0)))

    @property
    def secret(self) -> bytes:
        """The cluster secret (the rendezvous store's values are signed with it too)."""
        return self._secret

    def start_heartbeat(self, worker_id: int, lease: LeaseTerms | None = None) -> None:
        """``lease``: the coordinator's lease terms (None: this link never goes on without a
        coordinator that is merely silent)."""
        self.worker_id, self.lease = worker_id, lease
        self._last_reply = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def record(self, rec: dict[str, Any]) -> None:
        self._batches.add(rec)

    def note_standby(self, standby: Any) -> None:
        """The coordinator's word on which finished worker stays ready to report the job's result
        (a reply to this worker once it is done: its leave's, its heartbeats')."""
        self.standby = standby if type(standby) is int else None

    def flush(self, timeout_s: float = 5.0, *, patience_s: float = 30.0) -> None:
        """Send everything queued now (used before exiting), in batches.  A batch that gets no
        answer is sent again as is (its batch number makes it idempotent: the coordinator
        ingests it once) for up to ``patience_s``, then ``CallTimeout``.  Nothing queued: nothing is
        sent (a worker that never reached its coordinator exits at once)."""
        deadline = time.monotonic() + patience_s
        while True:
            with self._send_lock:  # (the heartbeat thread may have a batch in flight)
                if not self._batches.pending():
                    return
            try:
                self._send_once(timeout_s)
            except CallTimeout as exc:
                if self.silenced:  # (it did not answer for a lease: keep them beside the records)
                    self._spool()
                    return
                if time.monotonic() >= deadline:
                    raise
                log.warning("records not acknowledged (%s): sending them again", exc)

    def _send_once(self, timeout_s: float) -> None:
        if self.proven_gone:
            self._spool()
            return
        with self._send_lock:
            seq, batch = self._batches.batch()  # (an unacknowledged one is re-sent as is)
            running = self.running()
            body: dict[str, Any] = {
                "worker_id": self.worker_id, "batch": seq, "records": batch, "lease": None, "ring": None,
                "runs": running.epoch if running is not None else 0,
            }  # fmt: skip
            silenced = self.silenced
            if silenced:  # (no renewal: the view it went on in, for the coordinator to take over)
                view = self.ring_view()
                body["ring"] = {"epoch": view.epoch, "members": list(view.members)} if view else {}
            elif self._stamp is not None:
                body["lease"] = self._stamp
            reply = self._hb_client.call("heartbeat", body, timeout_s=timeout_s).body
            self._batches.acked()
            self._last_reply = time.monotonic()
            stamp = reply.get("lease_t")
            if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and math.isfinite(stamp):
                self._stamp = float(stamp)
        if silenced:
            self._back()
        self.latest_epoch = max(self.latest_epoch, int(reply["epoch"]))
        self.stop_requested = self.stop_requested or bool(reply["stop"])
        self.gone = frozenset(int(w) for w in reply.get("gone", ())[:64])
        report = reply.get("report")
        self.reporter = report if type(report) is int else None
        if "standby" in reply:  # (only in a reply to a worker that is done: rendezvous.standby)
            self.note_standby(reply["standby"])
        self.switches = _switches(reply.get("switches", ())) or self.switches
        self._note_broken(int(reply.get("broken", 0)))

    def _spool(self) -> None:
        """The coordinator is gone: append what it would have received to ``spool_path``."""
        with self._send_lock:
            batch = self._batches.drain()
            if self.spool_path is None or not batch:
                return
            with open(self.spool_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({**r, **self.spool_fields}) + "\n" for r in batch)

    def _note_broken(self, broken: int) -> None:
        if broken > self.broken_epoch:
            self.broken_epoch = broken
            if self.on_broken is not None:
                self.on_broken(broken)

    def _beat(self) -> None:
        while not self._stop_evt.wait(self._interval_s):
            try:
                self._send_once(timeout_s=max(1.0, self._interval_s * 8))
            except CommError as exc:
                if self.proven_gone:
                    continue  # (spooled on the next beat)
                lease = self.lease
                if lease is not None and not self.silenced:
                    if coordinator_gone(self._last_reply, time.monotonic(), lease):
                        self._silence(exc)

    def _silence(self, exc: Exception) -> None:
        """No reply for ``lease_s + margin_s``: its lease lapsed (module doc)."""
        assert self.lease is not None
        silent_s = time.monotonic() - self._last_reply
        log.error(
            "the coordinator has not answered for %.1f s (%s): its lease (%g s) has lapsed, training "
            "goes on without it until it answers again",
            silent_s, exc, self.lease.lease_s,
        )  # fmt: skip
        with self._gone_lock:
            self._stamp = None  # (renewed nothing from here on: a stamp before it is stale)
            was_gone = self.coordinator_gone
            self.silenced = True
        if self.on_gone is not None and not was_gone:
            self.on_gone()

    def _back(self) -> None:
        """The first reply after the silence: the heal (the coordinator has taken the view
        this heartbeat reported over, where it was newer)."""
        with self._gone_lock:
            if not self.silenced or self.proven_gone:
                return
            self.silenced = False
        log.warning("the coordinator answers again: back with it")

    def close(self) -> None:
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._live is not None:
            self._live.close()
        self._client.close()
        self._hb_client.close()
        if self._watch_client is not None:
            self._watch_client.close()


def _switches(raw: Any) -> tuple[tuple[int, int], ...]:
    """The announced switches of a heartbeat reply, ``[[step, option], ...]``: every item a pair of
    ints (not bools, floats or strings), a step >= 0 and an option >= 1, at most 64 (the
    coordinator announces at most ``MAX_SWITCHES``); anything else is logged and ignored whole."""

    def pair(item: Any) -> bool:
        return (
            isinstance(item, (list, tuple)) and len(item) == 2 and all(type(v) is int for v in item)
            and item[0] >= 0 and item[1] >= 1
        )  # fmt: skip

    if not isinstance(raw, (list, tuple)) or len(raw) > 64 or not all(pair(i) for i in raw):
        log.warning("heartbeat reply: switches %.200r ignored (not a list of [step, option] ints)", raw)
        return ()
    return tuple((int(s), int(o)) for s, o in raw)
