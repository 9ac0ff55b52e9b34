"""Liveness connections between ring neighbours: a process's death closes its sockets.

When a process dies -- SIGKILL, a crash, an out-of-memory kill -- its kernel closes every socket
it held, and each peer connected to it reads end-of-file (or a reset) at once.  That is far
faster evidence than a missed heartbeat, and far surer: a live process, even one that is frozen
(SIGSTOP) or starved, keeps its connections open.  So each worker listens
(:class:`LivenessListener`: accepts, holds every connection open, reads nothing it keeps) and
connects to the listeners of the peers it watches (:class:`LivenessWatch`): a connection that
ends says its peer's process is gone -- unless the peer said goodbye first (``BYE``, sent by
:meth:`LivenessListener.close`: a process shutting down on purpose), which is reported as
``graceful``.

A connection can also end while its peer lives: a network that resets it (a middlebox dropping
an idle flow, a link flap; ``comm/faulty.py``'s ``liveness_reset`` injects it).  So a connection
that ends without a goodbye is **confirmed** before it is reported: the watch dials the peer's
listener once more (within ``poll_s``); a dead process's listener is closed with it and refuses
at once, so a death is still reported in one round trip, while a live peer -- even a frozen one,
whose kernel still accepts -- answers, and the new connection is held instead (counted in
:attr:`LivenessWatch.reconnected`).  A dial that neither connects nor is refused (the peer's host
unreachable) proves nothing either way and reports the end, as before.

What it cannot tell: a machine that vanishes from the network (power, partition) closes nothing;
its peers learn it from missed heartbeats (``roles/peer_link.py``).  A connection carries no data
and needs no secret: what it reports (an end-of-file on a connection this process opened to an
address a peer gave it over the authenticated message plane) cannot be forged from outside but by
closing that peer's socket, which takes being that peer.

Threads: one per listener (accepts and reads) and one per watch (``selectors``); both are daemon
threads woken at least every ``poll_s`` to notice ``close``.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections.abc import Callable, Mapping

from flotilla.comm.faulty import reset_draw
from flotilla.core.log import get_logger

__all__ = ["LivenessListener", "LivenessWatch"]

log = get_logger("liveness")

POLL_S = 0.5
BYE = b"bye"


class LivenessListener:
    """A listening socket on ``host`` (any free port) holding every connection open."""

    def __init__(self, host: str, *, poll_s: float = POLL_S) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, 0), family=family, backlog=64)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._poll_s = poll_s
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness-listen", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(self._poll_s):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._sock:
                    try:
                        conn, _addr = sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(4096)  # nothing is ever sent: this is the peer hanging up
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._sel.unregister(sock)
                    sock.close()
        for key in list(self._sel.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is not self._sock:
                try:
                    sock.send(BYE)  # (a shutdown on purpose, not a death)
                except OSError:
                    pass
            sock.close()
        self._sel.close()

    def close(self) -> None:
        """Say goodbye on every connection and stop listening."""
        self._stop.set()
        self._thread.join(timeout=2 * self._poll_s + 1)


ClosedHandler = Callable[[int, bool], None]


class LivenessWatch:
    """Connections to watched peers' listeners; ``on_closed(peer, graceful)`` (on this watch's
    thread) once per connection that ends (``graceful``: after the peer's goodbye; otherwise
    once the peer's listener did not answer again: module doc) or that cannot be opened (nothing
    listens there any more: not graceful).  ``name``: this watch's, for its injected faults."""

    def __init__(self, on_closed: ClosedHandler, *, poll_s: float = POLL_S, name: str = "watch") -> None:
        self._on_closed, self._poll_s = on_closed, poll_s
        self._reset = reset_draw(name)  # (None: no injected resets)
        self.resets = 0  # connections the injected faults reset
        self.reconnected = 0  # connections that ended without a goodbye while their peer's listener answered
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wanted: dict[int, tuple[str, int]] = {}
        self._conns: dict[int, tuple[tuple[str, int], socket.socket]] = {}
        self._dead: dict[int, tuple[str, int]] = {}  # reported: never reported twice
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-watch", daemon=True)
        self._thread.start()

    def watch(self, targets: Mapping[int, tuple[str, int]]) -> None:
        """Hold connections to exactly ``targets`` (peer -> listener host and port)."""
        with self._lock:
            self._wanted = dict(targets)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _sync(self) -> list[tuple[int, bool]]:
        """Open and close connections to match the wanted set; the peers found dead."""
        with self._lock:
            wanted = dict(self._wanted)
        for peer, (address, sock) in list(self._conns.items()):
            if wanted.get(peer) != address:
                self._sel.unregister(sock)
                sock.close()
                del self._conns[peer]
        dead: list[tuple[int, bool]] = []
        for peer, address in wanted.items():
            if peer in self._conns or self._dead.get(peer) == address:
                continue
            try:
                sock = socket.create_connection(address, timeout=self._poll_s)
            except OSError as exc:
                if isinstance(exc, ConnectionRefusedError):
                    self._dead[peer] = address  # its listener is gone: so is its process
                    dead.append((peer, False))
                continue  # (a timeout proves nothing: the heartbeats decide)
            self._hold(peer, address, sock)
        return dead

    def _hold(self, peer: int, address: tuple[str, int], sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, peer)
        self._conns[peer] = (address, sock)

    def _ended(self, peer: int) -> tuple[int, bool] | None:
        """``peer``'s connection ended without a goodbye: held again when its listener answers
        (None), else its death ``(peer, False)`` (module doc)."""
        address, sock = self._conns.pop(peer)
        self._sel.unregister(sock)
        sock.close()
        try:
            again = socket.create_connection(address, timeout=self._poll_s)
        except OSError:
            self._dead[peer] = address
            return (peer, False)
        self.reconnected += 1
        log.info("liveness: peer %d's connection ended without a goodbye, but its listener answers", peer)
        self._hold(peer, address, again)
        return None

    def _inject_resets(self) -> list[tuple[int, bool]]:
        """The injected network resets of this poll (``comm/faulty.py``), each handled as an end."""
        dead: list[tuple[int, bool]] = []
        if self._reset is None:
            return dead
        for peer, (_address, sock) in list(self._conns.items()):
            if not self._reset():
                continue
            self.resets += 1
            try:  # (a reset, not a goodbye: the listener's side reads an error)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            end = self._ended(peer)
            if end is not None:
                dead.append(end)
        return dead

    def _run(self) -> None:
        while not self._stop.is_set():
            dead = self._sync() + self._inject_resets()
            for key, _ in self._sel.select(self._poll_s):
                if key.fileobj is self._wake_r:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                graceful = False
                try:
                    data = sock.recv(4096)
                    if data and not data.startswith(BYE):
                        continue  # (a listener sends nothing else; ignore it if one does)
                    graceful = bool(data)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    pass
                peer = int(key.data)
                if not graceful:
                    end = self._ended(peer)
                    if end is not None:
                        dead.append(end)
                    continue
                address, _ = self._conns.pop(peer)
                self._sel.unregister(sock)
                sock.close()
                self._dead[peer] = address
                dead.append((peer, graceful))
            for peer, graceful in dead:
                try:
                    self._on_closed(peer, graceful)
                except Exception:
                    log.exception("liveness: reporting peer %d failed", peer)
        for _address, sock in self._conns.values():
            sock.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2 * self._poll_s + 1)
