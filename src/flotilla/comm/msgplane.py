"""The message plane over ZeroMQ: a ROUTER server thread and DEALER clients, plus ``connect`` /
``serve``, which pick the zmq (``tcp://host:port``) or in-process (``mem://name``) transport.

Invariants:
- Frames are moved as-is: every check (size, HMAC, msgpack, header, replay, op, schema) is done by
  ``flotilla.comm.endpoint``/``codec``, identically for every transport, and every rejected
  message is answered with a signed error reply; its handler is not called.
- One zmq context per server and per client: ``close`` leaves no socket and no zmq I/O thread
  behind.  Clients close with linger 0; a server with a bounded linger (``CLOSE_LINGER_MS``), so
  the replies it sent last (a handler that closes its server, then answers; replies drained from
  an emulated link) are flushed by zmq's I/O thread, not discarded with the socket.  (pyzmq's
  zero-copy send keeps one process-wide helper thread of its own, started by the first large send.)
- Deferred replies (``Request.defer``): a reply resolved later, from any thread, is queued in the
  server's outbox and the serving thread is woken through a pipe; only the serving thread ever
  touches the ROUTER socket.  Replies queued after ``close`` are dropped.
- Clients use DEALER, not REQ, so a timed-out call leaves the socket usable; late replies are
  discarded by request id.  zmq reconnects by itself, so a client survives a server restart at
  the same address.  A client made with ``fail_on_disconnect`` (calls to a peer that may die:
  AD-PSGD's exchanges) watches its connection through a zmq monitor socket: a call waiting for
  its reply when the connection drops -- the server's process died, the kernel closed its
  sockets -- fails at once with :class:`PeerDisconnected` (a ``CommError``), as a timeout would,
  instead of waiting out its deadline; a drop between calls does not fail the next one.
- Size caps: ``ZMQ_MAXMSGSIZE`` limits every *frame* so zmq drops a giant frame before allocating
  it; zmq then closes that connection *without a reply* (the client's call times out and zmq
  reconnects).  Under that hard cap every rejection gets an error reply.  zmq assembles a
  multipart message before delivering it, so total bytes and frame count are checked after
  receipt (without copying: frames stay zero-copy ``zmq.Frame`` buffers, and parts beyond
  ``max_frames`` are dropped as they are read).
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from flotilla.comm.addresses import local_toward, split_host_port
from flotilla.comm.base import ClientBase, ServerBase
from flotilla.comm.codec import Buffer, Limits
from flotilla.comm.endpoint import Deferred, Reply, Request
from flotilla.comm.shaping import ServerLink, Shaping
from flotilla.comm.shaping import installed as installed_shaping
from flotilla.core.errors import CallTimeout, CommError, ConfigError, PeerDisconnected
from flotilla.core.log import get_logger

__all__ = [
    "ClientBase",
    "Deferred",
    "Limits",
    "MessageClient",
    "MessageServer",
    "PeerDisconnected",
    "Reply",
    "Request",
    "ServerBase",
    "bind_beside",
    "connect",
    "serve",
]

log = get_logger("comm.msgplane")


def _frame_cap(limits: Limits) -> int:
    # Per-frame cap for ZMQ_MAXMSGSIZE: no legal frame is larger than the whole-message limit;
    # the header slack keeps the cap clear of off-by-a-little encodings.
    return limits.max_message_bytes + limits.max_header_bytes


def _bind_endpoint(bind: str) -> str:
    if not bind.startswith("tcp://") or ":" not in bind[6:]:
        raise ConfigError(f"bind: expected tcp://host:port, got {bind!r}")
    host, _, port = bind[6:].rpartition(":")
    return f"tcp://{host}:{'*' if port == '0' else port}"


def _recv_capped(sock: zmq.Socket, max_parts: int) -> list[zmq.Frame]:
    """One multipart message without copying; parts beyond ``max_parts`` are read and dropped."""
    parts = [sock.recv(zmq.NOBLOCK, copy=False)]
    more = parts[0].more
    while more:
        frame = sock.recv(copy=False)
        more = frame.more
        if len(parts) < max_parts:
            parts.append(frame)
    return parts


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _peer(identity: zmq.Frame) -> str:
    try:
        return f"{identity.get('Peer-Address')}/{identity.bytes.hex()}"
    except zmq.ZMQError:
        return identity.bytes.hex()


# How long a closing server's socket keeps flushing the replies it sent last (a peer that reads
# takes them at once; one that does not read holds the close this long at most).
CLOSE_LINGER_MS = 1000


class MessageServer(ServerBase):
    """A zmq ROUTER bound at construction (so ``address`` is known), served by ``start()``."""

    idle_poll_s = 1.0  # close() wakes the serving thread through the wake pipe

    def __init__(
        self,
        secret: bytes,
        bind: str = "tcp://127.0.0.1:0",
        *,
        limits: Limits = Limits(),
        name: str = "server",
        shaping: Shaping | None = None,
    ) -> None:
        """``shaping``: emulated links (``comm/shaping.py``; None: the process's, if any)."""
        super().__init__(secret, limits=limits, name=name)
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            # Hard cap: zmq drops a larger frame before allocating it and closes that connection
            # WITHOUT a reply (the caller times out).  Below it, every rejection gets an error
            # reply from ServerCore.handle.
            self._sock.setsockopt(zmq.MAXMSGSIZE, _frame_cap(limits))
            self._sock.bind(_bind_endpoint(bind))
        except zmq.ZMQError as exc:
            self._close_transport()
            raise CommError(f"server {name}: cannot bind {bind}: {exc}") from None
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Deferred replies: any thread appends to the outbox and writes a byte to the wake pipe.
        self._outbox: collections.deque[list[Buffer]] = collections.deque()
        self._wake_lock = threading.Lock()  # guards the pipe's write end against close
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # (emulated links: given, or the process's -- installed later too: a worker's peer server
        # exists before the worker knows its job's config)
        self._shaping_given = shaping is not None
        self._link = ServerLink(shaping) if shaping is not None else None

    @property
    def address(self) -> str:
        return self._address

    def _serve_once(self, timeout_s: float) -> None:
        if self._link is None and not self._shaping_given and (shaping := installed_shaping()) is not None:
            self._link = ServerLink(shaping)
        link = self._link
        if link is not None:  # (emulated links: wake for the next message due in or out)
            timeout_s = min(timeout_s, max(0.0, link.next_due() - time.monotonic()))
        events = dict(self._poller.poll(math.ceil(timeout_s * 1000)))
        if self._wake_r in events:
            _drain(self._wake_r)
        if self._sock in events:
            parts = _recv_capped(self._sock, self.limits.max_frames + 2)
            if link is None:
                self._handle(parts)
            else:
                link.arrived(parts)
        if link is not None:
            for parts in link.due_in():
                self._handle(parts)
        while self._outbox:
            self._send_reply(self._outbox.popleft())
        if link is not None:
            for message in link.due_out():
                self._sock.send_multipart(message, copy=False)

    def _handle(self, parts: list[zmq.Frame]) -> None:
        identity, frames = parts[0], [p.buffer for p in parts[1:]]
        deliver = self._deliverer(identity)
        reply = self._core.handle(frames, peer=_peer(identity), deliver=deliver)
        if reply is not None:
            self._send_reply([identity, *reply])

    def _send_reply(self, message: list[Any]) -> None:
        if self._link is None or not self._link.departs(message):
            self._sock.send_multipart(message, copy=False)

    def _deliverer(self, identity: zmq.Frame) -> Callable[[list[Buffer]], None]:
        def deliver(frames: list[Buffer]) -> None:
            if not self._stop.is_set():
                self._outbox.append([identity, *frames])  # type: ignore[list-item]
                self._wake()

        return deliver

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\x01")
            except OSError:
                pass  # the pipe is full: a wake-up is already pending

    def _on_stop(self) -> None:
        self._wake()

    def _close_transport(self) -> None:
        link = getattr(self, "_link", None)
        if link is not None:  # (replies still on an emulated link: sent now, not lost)
            for message in link.drain_out():
                try:
                    self._sock.send_multipart(message, copy=False, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        self._sock.close(linger=CLOSE_LINGER_MS)
        self._ctx.term()
        if hasattr(self, "_wake_lock"):
            self._outbox.clear()
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1


class MessageClient(ClientBase):
    """A zmq DEALER connected to one server; see ``ClientBase.call`` (``fail_on_disconnect``:
    module doc)."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        sender: str,
        limits: Limits = Limits(),
        shaping: Shaping | None = None,
        fail_on_disconnect: bool = False,
    ) -> None:
        super().__init__(address, secret, sender=sender, limits=limits, shaping=shaping)
        if not address.startswith("tcp://"):
            raise ConfigError(f"address: expected tcp://host:port, got {address!r}")
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, _frame_cap(limits))
            if fail_on_disconnect:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._poller = zmq.Poller()
                self._poller.register(self._sock, zmq.POLLIN)
                self._poller.register(self._monitor, zmq.POLLIN)
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._close_transport()
            raise CommError(f"client {sender}: cannot connect to {address}: {exc}") from None

    def _dropped(self, wait_ms: int) -> bool:
        """Whether the monitor reports a dropped connection within ``wait_ms`` (its events read)."""
        assert self._monitor is not None
        dropped = False
        while self._monitor.poll(wait_ms, zmq.POLLIN):
            dropped = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED or dropped
            wait_ms = 0
        return dropped

    def _send(self, frames: list[Buffer], deadline: float) -> None:
        if self._monitor is not None:
            self._dropped(0)  # (a drop between calls is not this call's: forgotten)
        remaining_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
        self._sock.setsockopt(zmq.SNDTIMEO, remaining_ms)
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise CallTimeout(f"{self._address}: send queue full until the deadline") from None
        except zmq.ZMQError as exc:
            raise CommError(f"{self._address}: send failed: {exc}") from None

    def _recv(self, timeout_s: float) -> list[Buffer] | None:
        wait_ms = max(1, math.ceil(timeout_s * 1000))
        try:
            if self._monitor is not None:
                ready = dict(self._poller.poll(wait_ms))
                if self._sock not in ready:
                    if self._monitor in ready and self._dropped(0):
                        raise PeerDisconnected(f"{self._address}: the connection dropped (its process gone?)")
                    return None
            elif not self._sock.poll(wait_ms, zmq.POLLIN):
                return None
            parts = _recv_capped(self._sock, self._core.limits.max_frames + 1)
        except zmq.ZMQError as exc:
            raise CommError(f"{self._address}: receive failed: {exc}") from None
        return [p.buffer for p in parts]

    def _close_transport(self) -> None:
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def _scheme(address: str) -> str:
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in ("tcp", "mem"):
        raise ConfigError(f"address: expected tcp://host:port or mem://name, got {address!r}")
    return scheme


def bind_beside(address: str, *, plane: str = "message plane", port: int = 0) -> str:
    """A ``bind`` address for a server of this process that the host of ``address`` can reach:
    the local interface this machine uses to reach that host (or this process's explicit
    address, ``comm/addresses.set_local_host``), ``port`` (0: any free one; ``mem://`` gives a
    fresh in-process name).  The address chosen is logged once, naming ``plane``."""
    if _scheme(address) == "mem":
        return f"mem://peer-{os.getpid()}-{time.monotonic_ns()}"
    host, remote_port = split_host_port(address)
    local = local_toward(host, remote_port, plane=plane)
    return f"tcp://[{local}]:{port}" if ":" in local else f"tcp://{local}:{port}"


def connect(
    address: str, secret: bytes, *, sender: str, limits: Limits = Limits(), fail_on_disconnect: bool = False
) -> ClientBase:
    """A client for ``address``: zmq for ``tcp://``, in-process for ``mem://`` (``fail_on_disconnect``:
    module doc; an in-process server does not die alone)."""
    if _scheme(address) == "tcp":
        return MessageClient(
            address, secret, sender=sender, limits=limits, fail_on_disconnect=fail_on_disconnect
        )
    from flotilla.comm.inproc import InprocClient

    return InprocClient(address, secret, sender=sender, limits=limits)


def serve(secret: bytes, bind: str, *, limits: Limits = Limits(), name: str = "server") -> ServerBase:
    """A bound, not yet started server for ``bind``: register handlers, then ``start()`` it
    (entering it as a context manager starts it too)."""
    if _scheme(bind) == "tcp":
        return MessageServer(secret, bind, limits=limits, name=name)
    from flotilla.comm.inproc import InprocServer

    return InprocServer(secret, bind, limits=limits, name=name)
