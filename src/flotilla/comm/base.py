"""Transport-independent server and client shells of the message plane.

``ServerBase`` owns the serving thread and its lifecycle; ``ClientBase`` owns the ``call`` loop
(lock, deadline, reply matching by request id).  A transport subclass only moves frames:
``_serve_once``/``_send``/``_recv`` and ``_close_transport``.  All checking is in
``flotilla.comm.endpoint`` and ``flotilla.comm.codec``, so every transport rejects alike.

Invariants:
- Handlers may defer their reply (``Request.defer``); the transport sends it when resolved.
- The serving thread survives every bad message and every handler failure; ``close`` is
  idempotent, joins the thread and releases the transport (from the serving thread itself, so a
  socket is only ever used by one thread).
- A client serialises calls with a lock; a reply whose ``rid`` is not the current call's (a late
  reply to a timed-out call) is discarded, never delivered to another call.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flotilla.comm.codec import Buffer, Limits
from flotilla.comm.endpoint import Handler, Reply, ServerCore
from flotilla.comm.endpoint_client import ClientCore, ReplyOutcome
from flotilla.comm.faulty import injector_for
from flotilla.comm.schema import Schema
from flotilla.comm.shaping import Shaping, payload_bytes
from flotilla.comm.shaping import installed as installed_shaping
from flotilla.core.errors import CallTimeout, CommError
from flotilla.core.log import get_logger

__all__ = ["POLL_S", "ClientBase", "ServerBase"]

log = get_logger("comm.msgplane")

POLL_S = 0.05  # how often an idle serving thread checks for close()


class ServerBase(abc.ABC):
    """Serves requests in one background thread; handlers run one at a time in that thread.

    A handler that cannot answer at once (e.g. a pull waiting for other workers) returns
    ``request.defer()`` and resolves that ``Deferred`` later from any thread; the serving thread
    keeps serving other requests meanwhile.
    """

    # How long an idle serving thread waits before it looks at the stop flag again; a transport
    # that ``close`` wakes (``_on_stop``) waits longer, so that an idle server does not wake
    # (and preempt a training thread) 20 times a second.
    idle_poll_s: float = POLL_S

    def __init__(self, secret: bytes, *, limits: Limits, name: str) -> None:
        self._core = ServerCore(secret, limits=limits, name=name)
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def limits(self) -> Limits:
        return self._core.limits

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address clients connect to."""

    def register(
        self,
        op: str,
        handler: Handler,
        schema: Schema | None = None,
        *,
        max_tensors: int | None = None,
    ) -> None:
        """Route ``op`` to ``handler`` (any time, from any thread); ``schema`` checks the body."""
        self._core.register(op, handler, schema, max_tensors=max_tensors)

    def start(self) -> ServerBase:
        """Start serving in a background thread (idempotent); returns self."""
        with self._state_lock:
            if self._closed:
                raise CommError(f"server {self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"flotilla-msg-{self.name}", daemon=True
                )
                self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving and release the transport; idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._stop.set()
        self._on_stop()
        if thread is None:
            self._close_transport()
            return
        if thread is threading.current_thread():
            return  # close() from a handler: the loop ends and closes the transport after it
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning(
                "%s: a handler is still running after %.1f s; the transport closes when it returns",
                self.name,
                timeout_s,
            )

    def __enter__(self) -> ServerBase:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._serve_once(self.idle_poll_s)
                except Exception:
                    log.exception("%s: transport error while serving", self.name)
                    self._stop.wait(POLL_S)
                self._core.rejections.flush()  # (pending counts: one line per reason per 5 s)
        finally:
            self._core.rejections.flush()
            self._close_transport()

    def _on_stop(self) -> None:
        """Hook run by ``close`` right after the stop flag is set (e.g. to wake the thread)."""

    @abc.abstractmethod
    def _serve_once(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for one request; answer it with ``self._core.handle``."""

    @abc.abstractmethod
    def _close_transport(self) -> None:
        """Free sockets/queues (called once, by the serving thread if it ran)."""


class ClientBase(abc.ABC):
    """The ``call`` logic shared by every transport; subclasses only move frames.

    Calls are serialised by a lock (a client may be shared by threads).  A reply whose ``rid`` is
    not the current call's (a late reply to a timed-out call) is discarded.
    """

    def __init__(
        self, address: str, secret: bytes, *, sender: str, limits: Limits, shaping: Shaping | None = None
    ) -> None:
        self._core = ClientCore(secret, sender=sender, limits=limits)
        self._faults = injector_for(sender)  # (a test's message faults: comm/faulty.py)
        self._shaping = shaping  # (emulated links, comm/shaping.py; None: the process's, if any)
        self._address = address
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    @property
    def sender(self) -> str:
        return self._core.sender

    def call(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout_s: float = 10.0,
    ) -> Reply:
        """Send one request and wait for its reply.

        Raises ``CallTimeout`` (no reply within ``timeout_s``), ``RemoteError`` (error reply),
        ``MessageRejected`` (a reply that is unauthentic or malformed, or an oversized request).
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            raise CallTimeout(f"{op!r} to {self._address}: client busy for {timeout_s} s")
        try:
            if self._closed:
                raise CommError(f"client for {self._address} is closed")
            rid, frames = self._core.request(op, body, tensors)
            self._send_request(op, frames, deadline)
            outcome = self._await(rid, deadline)
            if outcome is not None and outcome.error is not None and outcome.error.code == "clock_skew":
                rid, frames = self._core.request(op, body, tensors)  # (stamped with the learned offset)
                self._send_request(op, frames, deadline)
                outcome = self._await(rid, deadline)
            if outcome is not None and self._faults is not None and self._faults.reply_lost(op):
                time.sleep(max(0.0, deadline - time.monotonic()))  # (a test's lost reply)
                outcome = None
        finally:
            self._lock.release()
        if outcome is None:
            raise CallTimeout(f"{op!r} to {self._address}: no reply within {timeout_s} s")
        if outcome.error is not None:
            raise outcome.error
        assert outcome.reply is not None
        return outcome.reply

    def _send_request(self, op: str, frames: list[Buffer], deadline: float) -> None:
        _cross_link(self._shaping, frames, deadline, sending=True)  # (emulated links: it crosses first)
        if self._faults is None:
            self._send(frames, deadline)
        else:
            self._faults.send(op, lambda f: self._send(f, deadline), frames)

    def _await(self, rid: str, deadline: float) -> ReplyOutcome | None:
        while (remaining_s := deadline - time.monotonic()) > 0:
            frames = self._recv(remaining_s)
            if frames is None:
                continue
            outcome = self._core.reply(frames)
            if outcome.rid == rid:
                _cross_link(self._shaping, frames, deadline, sending=False)  # (emulated links)
                return outcome
            if outcome.rid == "" and outcome.error is not None:
                log.warning(
                    "%s: unattributed error reply from %s: %s",
                    self.sender,
                    self._address,
                    outcome.error,
                )
            else:
                log.debug("%s: discarding reply to earlier request %s", self.sender, outcome.rid)
        return None

    def close(self) -> None:
        """Release the transport; idempotent.  Waits for a call in progress to finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_transport()

    def __enter__(self) -> ClientBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _send(self, frames: list[Buffer], deadline: float) -> None:
        """Queue ``frames`` for the server; ``CallTimeout`` if impossible by ``deadline``."""

    @abc.abstractmethod
    def _recv(self, timeout_s: float) -> list[Buffer] | None:
        """One reply's frames, or None if none arrived within ``timeout_s``."""

    @abc.abstractmethod
    def _close_transport(self) -> None:
        """Free sockets/queues (called once, under the call lock)."""


def _cross_link(shaping: Shaping | None, frames: Sequence[Buffer], deadline: float, *, sending: bool) -> None:
    """With emulated links (``comm/shaping.py``; ``shaping`` None: the process's): wait until
    ``frames`` reached the server (``sending``) or came in from it, up to ``deadline``."""
    shaping = shaping if shaping is not None else installed_shaping()
    if shaping is None:
        return
    now, size = time.monotonic(), payload_bytes(frames)
    at = shaping.sent_at(size, now) if sending else shaping.received_at(size, now)
    time.sleep(max(0.0, min(at, deadline) - now))
