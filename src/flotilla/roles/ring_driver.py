"""The runtime of ring repair (``cluster/ring_repair.py``, SPEC §7): the pure state machine driven
peer to peer over the message plane, with no coordinator on the path.

Who uses it: a worker whose coordinator's process is gone (``roles/link.py``:
``coordinator_gone``).  While the coordinator lives, it alone mints views (joins, leaves,
deaths); once it is proven dead nobody else can, so the survivors agree on each next view
among themselves: a member that finds a ring neighbour dead (``Suspect``: the neighbour watch,
``roles/peer_link.py``) starts a RECONCILE round, messages travel worker to worker (op
``ring`` on each worker's peer server, authenticated with the cluster's secret), and every
survivor ends with the same ``Adopt(view)``.

What this module adds to the pure machine:

- transport: one message-plane client per destination, sends on a small thread pool (a dead or
  frozen destination blocks only its own sends), each bounded by ``send_timeout_s`` (short: the
  protocol has its own ACKs, so the transport's reply only tells a send was not lost); a send
  that fails is simply left to the retry timer (the machine re-routes once somebody reports the
  destination dead -- a failed send proves nothing on a loaded machine); one message is queued
  once per destination until its send ends, so lost messages never pile up a queue;
- the retry timer: ``RetryDue`` every ``retry_s`` while something is unacknowledged (it sleeps
  while nothing is: ``awaiting_ack``);
- the split-brain rule (``may_adopt_alone``): with no coordinator to confirm it, an adopted view
  is run only if it holds a strict majority of the previous view's members; one that does not
  is *held*, the worker stops with a line saying so (two sides that suspect each other can then
  never both go on);
- probes: a worker whose group broke but who knows of no death (it was frozen, and woke up)
  asks the members of its view, every ``PROBE_S`` (``ProbeDue``: an ACK stamped with its epoch
  that acknowledges nothing); a member that has moved on answers with the COMMIT that ended that
  epoch, so a worker the others evicted learns it at once instead of waiting for a view that
  will never come;
- authentication beyond the secret: a message's ``sender`` must be the worker whose message-plane
  name sent it (``ring-<worker id>``); anything else, malformed or outside the view is refused,
  logged (rate-limited by :class:`flotilla.comm.rejections.Rejections`, counted in the run
  summary's ``rejections``) and changes no state.

Threads: the peer server's (``Received``), the peer watch's (``Suspect``), the retry timer and
the send pool; the machine's state is guarded by one lock, and effects are acted on in order.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flotilla.cluster.membership import View
from flotilla.cluster.ring_repair import awaiting_ack, may_adopt_alone, start, step
from flotilla.cluster.ring_repair_messages import (
    Adopt,
    Event,
    Evicted,
    Message,
    ProbeDue,
    Received,
    Rejected,
    RepairState,
    RetryDue,
    Send,
    Suspect,
)
from flotilla.comm.msgplane import connect
from flotilla.comm.rejections import REJECTIONS, Rejections
from flotilla.core.errors import CallTimeout, CommError, RemoteError
from flotilla.core.log import get_logger

__all__ = ["RingDriver", "sender_name"]

log = get_logger("ring")

RETRY_S = 0.1
PROBE_S = 1.0
SEND_TIMEOUT_S = 0.3


def sender_name(worker_id: int) -> str:
    """The message-plane sender name of worker ``worker_id``'s ring messages."""
    return f"ring-{worker_id}"


class RingDriver:
    """One worker's ring repair.  ``register(server)`` adds op ``ring`` to its peer server;
    ``enter(view, addresses)`` starts the repair of a view; ``suspect`` feeds detection;
    ``wait_adopted`` blocks until a newer view is adopted (or we are out)."""

    def __init__(
        self, me: int, secret: bytes, *, retry_s: float = RETRY_S, send_timeout_s: float = SEND_TIMEOUT_S
    ) -> None:
        self.me, self._secret = me, secret
        self._retry_s, self._send_timeout_s = retry_s, send_timeout_s
        self._cv = threading.Condition()
        self._state: RepairState | None = None
        self._addresses: dict[int, str] = {}
        self._adopted: list[View] = []  # views adopted and allowed to run, oldest first
        self._out: str = ""  # why this worker can run no further view ('' while it can)
        self._clients: dict[int, tuple[threading.Lock, Any]] = {}
        self._queued: set[tuple[int, str]] = set()  # (destination, message) queued or in flight
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ring-send")
        self._stop = threading.Event()
        self._armed = threading.Event()  # set while something sent awaits its ACK
        self._rejections = Rejections(parent=REJECTIONS, logger=log, what="ring message")
        self.on_adopt: Callable[[View], None] | None = None  # (on the thread that adopted)
        self._timer = threading.Thread(target=self._retry_loop, name="ring-retry", daemon=True)
        self._timer.start()

    def register(self, server: Any) -> None:
        server.register("ring", self._on_request, {"message": dict})

    # ------------------------------------------------------------------ inputs
    def enter(self, view: View, addresses: Mapping[int, str]) -> None:
        """Run ``view`` (minted by the coordinator, or adopted here) with these peer addresses."""
        with self._cv:
            self._addresses.update({int(k): str(v) for k, v in addresses.items()})
            self._out = ""  # (a coordinator's view with this worker in it: in again, after a heal)
            if self._state is None or self._state.view != view:  # (epochs alone may repeat)
                self._state = start(self.me, view)
            self._adopted = [v for v in self._adopted if v.epoch > view.epoch]

    def suspect(self, worker_ids: frozenset[int]) -> None:
        if worker_ids:
            self._feed(Suspect(frozenset(worker_ids)))

    def probe(self) -> None:
        """Ask the other members of our view whether they moved on without us (module doc)."""
        with self._cv:
            if not self._out:
                self._feed(ProbeDue())

    def _on_request(self, req: Any) -> dict[str, Any]:
        try:
            message = Message.from_dict(req.body["message"])
        except (ValueError, TypeError, KeyError) as exc:
            self._rejections.record("malformed", str(req.sender), str(exc), where="ring repair")
            raise RemoteError("bad_request", f"malformed ring message: {exc}") from None
        if req.sender != sender_name(message.sender):
            self._rejections.record(
                "impersonation", str(req.sender), f"claims worker {message.sender}", where="ring repair"
            )
            raise RemoteError("bad_request", "the message's sender is not who sent it")
        self._feed(Received(message))
        return {"ok": True}

    def _retry_loop(self) -> None:
        while not self._stop.is_set():
            self._armed.wait()
            if self._stop.wait(self._retry_s):
                return
            self._feed(RetryDue())

    # ------------------------------------------------------------------ the machine
    def _feed(self, event: Event) -> None:
        with self._cv:
            if self._state is None:
                return
            before = self._state.view
            self._state, effects = step(self._state, event)
            for effect in effects:
                if isinstance(effect, Send):
                    self._send(effect.dst, effect.message)
                elif isinstance(effect, Adopt):
                    self._on_adopt(before, effect.view)
                    before = effect.view
                elif isinstance(effect, Evicted):
                    self._out = f"view {effect.view.epoch} {list(effect.view.members)} was chosen without us"
                    log.warning("ring repair: %s", self._out)
                    self._cv.notify_all()
                elif isinstance(effect, Rejected):
                    who = sender_name(event.message.sender) if isinstance(event, Received) else "?"
                    self._rejections.record("refused", who, effect.reason, where="ring repair")
            if awaiting_ack(self._state):
                self._armed.set()
            else:
                self._armed.clear()

    def _on_adopt(self, previous: View, view: View) -> None:
        if not may_adopt_alone(previous, view.members):
            self._out = (
                f"view {view.epoch} {list(view.members)} holds no majority of view {previous.epoch} "
                f"{list(previous.members)} and no coordinator can confirm it: this side stops "
                "(split-brain rule)"
            )
            log.error("ring repair: %s", self._out)
        else:
            log.warning(
                "ring repair: adopted view %d %s (left: %s)", view.epoch, list(view.members), list(view.left)
            )
            self._adopted.append(view)
            if self.on_adopt is not None:
                self.on_adopt(view)
        self._cv.notify_all()

    def _send(self, dst: int, message: Message) -> None:
        """(Under ``_cv``.)  Queue one send; the same message to the same destination is queued
        once until that send ends: the retry timer re-emits every unacknowledged message every
        ``retry_s``, and a destination whose sends wait out their timeout (lost requests or
        replies) must not collect a queue that grows faster than it drains."""
        address = self._addresses.get(dst)
        if address is None or self._stop.is_set():
            return
        body = message.to_dict()
        key = (dst, json.dumps(body, sort_keys=True))
        if key in self._queued:
            return
        self._queued.add(key)
        self._pool.submit(self._send_queued, key, dst, address, body)

    def _send_queued(self, key: tuple[int, str], dst: int, address: str, body: dict[str, Any]) -> None:
        try:
            self._send_now(dst, address, body)
        finally:
            with self._cv:
                self._queued.discard(key)

    def _send_now(self, dst: int, address: str, body: dict[str, Any]) -> None:
        with self._cv:
            entry = self._clients.get(dst)
            if entry is None:
                entry = self._clients[dst] = (threading.Lock(), None)
        lock, _ = entry
        stale = None
        with lock:  # one request at a time per destination: its seq numbers arrive in order
            client = self._clients[dst][1]
            try:
                if client is None:
                    client = connect(address, self._secret, sender=sender_name(self.me))
                    self._clients[dst] = (lock, client)
                client.call("ring", {"message": body}, timeout_s=self._send_timeout_s)
            except CallTimeout as exc:  # (kept: a late reply is told from the next by its request id)
                log.debug("ring send to %d got no reply: %s", dst, exc)
            except RemoteError as exc:  # (answered: the transport is fine)
                log.debug("ring send to %d refused: %s", dst, exc)
            except CommError as exc:
                log.debug("ring send to %d failed: %s", dst, exc)
                stale, self._clients[dst] = client, (lock, None)
        if stale is not None:  # (closed outside the lock: closing never holds this destination up)
            stale.close()

    # ------------------------------------------------------------------ outputs
    def wait_adopted(self, after_epoch: int, timeout_s: float, cancelled: Callable[[], bool]) -> View | None:
        """The first adopted view newer than ``after_epoch`` (None: this worker is out of every
        further view -- evicted, or held back by the split-brain rule -- or ``cancelled``)."""
        deadline = time.monotonic() + timeout_s
        next_probe = time.monotonic() + self._retry_s * 3  # (a repair in flight needs no probe)
        with self._cv:
            while True:
                newer = [v for v in self._adopted if v.epoch > after_epoch]
                if newer:
                    return newer[-1]
                if self._out or cancelled():
                    return None
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    return None
                if now >= next_probe:
                    self.probe()
                    next_probe = now + PROBE_S
                self._cv.wait(min(left, 0.1))

    @property
    def out(self) -> str:
        return self._out

    def newest(self) -> View | None:
        """The newest view adopted here and allowed to run (None: none since the last ``enter``)."""
        with self._cv:
            return self._adopted[-1] if self._adopted else None

    def close(self) -> None:
        self._stop.set()
        self._armed.set()
        self._timer.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._cv:
            clients = [c for _, c in self._clients.values() if c is not None]
        for client in clients:
            try:
                client.close()
            except Exception:
                pass
