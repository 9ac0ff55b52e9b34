"""A worker's link to its ring neighbours: a message-plane server that answers their pings, and
a watch thread that pings its own neighbours (``cluster/peer_watch.py`` decides whom and when to
suspect; this module only sends, receives and keeps time).

Why: a revoked worker is noticed by its peers without relying on a notice from its launcher
(which a vanished machine never sends) or on the coordinator's slow silence rule; a frozen one
(SIGSTOP) too, which no collective ever reports -- its neighbours just wait in the all-reduce.
Within two heartbeat intervals of its last answer, each neighbour calls ``on_suspect(peers,
epoch)``, and again at every check while the peer stays silent and no new view is entered; the
membership then aborts that epoch's group (the survivors blocked in it are released) and reports
the suspicion, which the coordinator corroborates with its own record (its silence there must
reach its own threshold too, which a report a few milliseconds early misses: the next one hits).

A dead process is noticed faster still: each worker also holds a liveness connection to each
watched peer (``comm/liveness.py``; the port comes in the peer's ping answer), which ends the
moment the peer's process dies -- its kernel closes it.  That peer is reported at once, with
``closed`` = True (proof of death, which the coordinator needs no silence of its own to accept).

Threads: the server's, the watch thread (pings, one at a time, each bounded by half an interval)
and the liveness threads.  ``watch`` may be called from any thread; ``on_suspect`` runs on the
watch thread or the liveness watch's, never on both at once.  Every ping is authenticated like any
message-plane request (HMAC with the cluster's secret).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from flotilla.cluster.membership import View
from flotilla.cluster.peer_watch import PeerWatchPolicy, watched
from flotilla.comm.liveness import LivenessListener, LivenessWatch
from flotilla.comm.msgplane import bind_beside, connect, serve
from flotilla.comm.schema import IntRange
from flotilla.comm.store import StoreAddress, StoreHost
from flotilla.core.errors import CommError
from flotilla.core.log import get_logger

__all__ = ["PeerLink", "host_of"]

log = get_logger("peers")

SuspectHandler = Callable[[tuple[int, ...], int, bool], None]  # (suspects, epoch, closed)


def host_of(address: str) -> str | None:
    """The host of a ``tcp://host:port`` address (None for in-process ``mem://`` ones)."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rpartition(":")[0].strip("[]")


class PeerLink:
    def __init__(
        self,
        secret: bytes,
        *,
        beside: str,
        name: str,
    ) -> None:
        """A server bound beside ``beside`` (the coordinator's address: the interface that reaches
        it), answering at once; the watch starts with :meth:`start`."""
        self._secret, self._name = secret, name
        self.worker_id = -1
        self.policy = PeerWatchPolicy(interval_s=0.25)
        self._on_suspect: SuspectHandler | None = None
        self._server = serve(secret, bind_beside(beside), name=f"peers-{name}")
        self._server.register(
            "peer_ping", self._on_ping, {"worker_id": IntRange(0, 2**31 - 1), "epoch": IntRange(0, 2**53)}
        )
        self._server.register("peer_info", self._on_info, {})
        self._server.start()  # (ops may be added later: the ring driver adds its own)
        host = host_of(self.address)
        # the rendezvous store of the views ring repair forms while this worker is their lowest
        # member (roles/ring_driver.py): hosted from the start, so its address is known
        self.store = StoreHost(host, 0) if host is not None else None
        self._listener = LivenessListener(host) if host is not None else None
        self._live: LivenessWatch | None = None
        self._live_ports: dict[int, tuple[str, int]] = {}  # peer -> its liveness listener
        self._report_lock = threading.Lock()  # one report at a time (two threads report)
        self._lock = threading.Lock()
        self._epoch = 0
        self._targets: dict[int, str] = {}  # watched peer -> its address, for the current epoch
        self._clients: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return str(self._server.address)

    @property
    def live_port(self) -> int:
        """The port of this worker's liveness listener (0: none, in-process addresses)."""
        return self._listener.port if self._listener is not None else 0

    def _on_ping(self, req: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "epoch": self._epoch, "live_port": self.live_port}

    def _on_info(self, req: Any) -> dict[str, Any]:
        return {"store_port": self.store.address.port if self.store is not None else 0}

    @property
    def server(self) -> Any:
        return self._server

    def store_of(self, address: str, timeout_s: float = 5.0) -> StoreAddress:
        """The rendezvous store hosted by the worker whose peer server is at ``address``."""
        host = host_of(address)
        client = connect(address, self._secret, sender=f"{self._name}/info")
        try:
            port = int(client.call("peer_info", {}, timeout_s=timeout_s).body["store_port"])
        finally:
            client.close()
        if host is None or port <= 0:
            raise CommError(f"the worker at {address} hosts no store")
        return StoreAddress(host, port)

    def _report(self, suspects: tuple[int, ...], epoch: int, closed: bool) -> None:
        with self._report_lock:
            try:
                if self._on_suspect is not None:
                    self._on_suspect(suspects, epoch, closed)
            except CommError as exc:  # (the coordinator unreachable: its lease decides what follows)
                log.warning("peer watch: reporting %s failed: %s", suspects, exc)
            except Exception:
                log.exception("peer watch: reporting %s failed", suspects)

    def _on_closed(self, peer: int, graceful: bool) -> None:
        """Liveness thread: ``peer``'s process is gone (its connection ended), or is shutting
        down on purpose (``graceful``: left to the heartbeats, which stop when it exits)."""
        if graceful:
            return
        with self._lock:
            epoch, watched_now = self._epoch, peer in self._targets
        if watched_now:
            log.warning("epoch %d: peer %d's process is gone (its connection closed)", epoch, peer)
            self._report((peer,), epoch, True)

    def _note_live_port(self, peer: int, address: str, reply: Any) -> None:
        """A ping answer names the peer's liveness port: connect to it (once per address)."""
        host, port = host_of(address), int(reply.body.get("live_port") or 0)
        if host is None or port <= 0 or self._live_ports.get(peer) == (host, port):
            return
        self._live_ports[peer] = (host, port)
        if self._live is None:
            self._live = LivenessWatch(self._on_closed, name=f"{self._name}/peers")
        self._live.watch(self._live_ports)

    def start(self, worker_id: int, policy: PeerWatchPolicy, on_suspect: SuspectHandler) -> None:
        self.worker_id, self.policy, self._on_suspect = worker_id, policy, on_suspect
        self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
        self._thread.start()

    def watch(self, view: View, addresses: Mapping[int, str]) -> None:
        """Watch this worker's ring neighbours in ``view`` (those whose address is known)."""
        targets = {p: addresses[p] for p in watched(view.members, self.worker_id) if p in addresses}
        with self._lock:
            self._epoch, self._targets = view.epoch, targets

    def unwatch(self) -> None:
        """Stop watching."""
        with self._lock:
            self._targets = {}

    def _client(self, address: str) -> Any:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = connect(address, self._secret, sender=f"{self._name}/watch")
        return client

    def _watch(self) -> None:
        heard: dict[int, float] = {}
        watching: tuple[int, dict[int, str]] = (0, {})
        reported: tuple[int, ...] = ()
        last_check: float | None = None
        while not self._stop.wait(self.policy.period_s):
            woke = time.monotonic()
            with self._lock:
                epoch, targets = self._epoch, dict(self._targets)
            if (epoch, targets) != watching:  # a new view: every peer's clock starts now
                watching, heard, last_check, reported = (epoch, targets), {}, None, ()
                self._live_ports = {p: a for p, a in self._live_ports.items() if p in targets}
                if self._live is not None:
                    self._live.watch(self._live_ports)
            for peer in targets:
                heard.setdefault(peer, woke)
            for peer, address in targets.items():
                try:
                    body = {"worker_id": self.worker_id, "epoch": epoch}
                    reply = self._client(address).call("peer_ping", body, timeout_s=self.policy.period_s)
                    heard[peer] = time.monotonic()
                    self._note_live_port(peer, address, reply)
                except CommError:
                    pass
            now = time.monotonic()
            # a stall is the watcher not running (a late wake-up), not the time its pings waited
            since = None if last_check is None else last_check + (now - woke)
            verdict = self.policy.silent(last_heard_s=heard, now_s=now, last_check_s=since)
            last_check = now
            if verdict.stalled:
                heard = dict.fromkeys(heard, now)
                continue
            if verdict.suspects:
                suspects = tuple(sorted(verdict.suspects))
                if suspects != reported:  # (reported again at every check until a new view)
                    log.warning("epoch %d: peers %s silent for %.2f s", epoch, suspects, self.policy.limit_s)
                    reported = suspects
                self._report(suspects, epoch, False)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._live is not None:
            self._live.close()
        if self._listener is not None:
            self._listener.close()
        if self.store is not None:
            self.store.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._server.close()
