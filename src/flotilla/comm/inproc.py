"""In-process transport of the message plane: servers are threads fed by queues, found by name
in a process-wide registry (``mem://name``).  Same interface as the zmq transport.

Invariants:
- Only the byte moving differs from zmq: a message is encoded, signed, verified and decoded by the
  same ``endpoint``/``codec`` code, so every rejection and error reply behaves identically.
- Frames are copied once in each direction (as a wire would), into writable buffers: a handler
  never aliases the sender's tensors, and decoded tensors are writable.
- A deferred reply (``Request.defer``) is copied and handed to the asking client from whichever
  thread resolves it; one resolved after the server closed is dropped, as a wire would lose it.
- A name is bound by at most one open server; ``close`` releases it at once, so a new server may
  bind the same name (a "restart") and existing clients reach it on their next call.  A message
  to a name with no server is dropped and the call times out, as with an unreachable zmq peer.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence

from flotilla.comm.base import ClientBase, ServerBase
from flotilla.comm.codec import Buffer, Limits
from flotilla.core.errors import CommError, ConfigError
from flotilla.core.log import get_logger

__all__ = ["InprocClient", "InprocServer", "exchange_raw"]

log = get_logger("comm.inproc")

_registry: dict[str, InprocServer] = {}
_registry_lock = threading.Lock()
_auto_names = itertools.count(1)
_client_ids = itertools.count(1)

ReplyTo = Callable[[list[Buffer]], None]
_Item = tuple[list[Buffer], ReplyTo, str]  # frames, where to reply, peer name


def _parse(address: str, *, allow_auto: bool) -> str:
    if not address.startswith("mem://"):
        raise ConfigError(f"address: expected mem://name, got {address!r}")
    name = address[len("mem://") :]
    if name in ("", "*", "0") and allow_auto:
        return f"auto-{next(_auto_names)}"
    if not name or "/" in name:
        raise ConfigError(f"address: mem:// name must be non-empty without '/', got {address!r}")
    return name


def _wire_copy(frames: Sequence[Buffer]) -> list[Buffer]:
    return [bytearray(f) for f in frames]


def _lookup(name: str) -> InprocServer | None:
    with _registry_lock:
        return _registry.get(name)


class InprocServer(ServerBase):
    """A server thread reading a queue; ``bind`` is ``mem://name`` (``mem://`` picks a name)."""

    def __init__(
        self,
        secret: bytes,
        bind: str = "mem://",
        *,
        limits: Limits = Limits(),
        name: str = "server",
    ) -> None:
        super().__init__(secret, limits=limits, name=name)
        self._key = _parse(bind, allow_auto=True)
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        with _registry_lock:
            if self._key in _registry:
                raise CommError(f"server {name}: mem://{self._key} is already bound")
            _registry[self._key] = self

    @property
    def address(self) -> str:
        return f"mem://{self._key}"

    def deliver(self, frames: Sequence[Buffer], reply_to: ReplyTo, peer: str) -> None:
        """Queue a copy of ``frames``; ``reply_to`` later receives a copy of the reply frames."""
        self._queue.put((_wire_copy(frames), reply_to, peer))

    def _serve_once(self, timeout_s: float) -> None:
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return
        if item is None:
            return
        frames, reply_to, peer = item

        def deliver(reply: list[Buffer]) -> None:
            if not self._stop.is_set():
                reply_to(_wire_copy(reply))

        reply = self._core.handle(frames, peer=peer, deliver=deliver)
        if reply is not None:
            reply_to(_wire_copy(reply))

    def _on_stop(self) -> None:
        with _registry_lock:
            if _registry.get(self._key) is self:
                del _registry[self._key]
        self._queue.put(None)

    def _close_transport(self) -> None:
        self._on_stop()


class InprocClient(ClientBase):
    """A client of the in-process server named by ``address``; see ``ClientBase.call``."""

    def __init__(self, address: str, secret: bytes, *, sender: str, limits: Limits = Limits()) -> None:
        super().__init__(address, secret, sender=sender, limits=limits)
        self._key = _parse(address, allow_auto=False)
        self._replies: queue.SimpleQueue[list[Buffer]] = queue.SimpleQueue()
        self._peer = f"inproc:{sender}#{next(_client_ids)}"

    def _send(self, frames: list[Buffer], deadline: float) -> None:
        server = _lookup(self._key)
        if server is None:
            log.debug("%s: no server at %s; message dropped", self.sender, self.address)
            return
        server.deliver(frames, self._replies.put, self._peer)

    def _recv(self, timeout_s: float) -> list[Buffer] | None:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _close_transport(self) -> None:
        pass


def exchange_raw(address: str, frames: Sequence[Buffer], *, timeout_s: float) -> list[Buffer] | None:
    """Hand raw ``frames`` to the server at ``address`` and return its raw reply frames (None on
    timeout or no server).  For tests and fault injection: bypasses the client entirely."""
    server = _lookup(_parse(address, allow_auto=False))
    if server is None:
        return None
    replies: queue.SimpleQueue[list[Buffer]] = queue.SimpleQueue()
    server.deliver(frames, replies.put, "inproc:raw")
    try:
        return replies.get(timeout=timeout_s)
    except queue.Empty:
        return None
