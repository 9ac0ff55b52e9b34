"""A strategy's peer plane (``sync.spec.PeerPlane``) on a worker: ops on the worker's peer server
(``roles/peer_link.py``, the server its neighbours ping), the members' peer addresses as the
coordinator announced them with each view, and clients to them.

An op is registered on the server once, as a dispatcher to the op's current handler: a strategy
built again (a switch back) replaces the handler, a closed one unregisters it, and the server then
answers the op with an ``unavailable`` error instead of calling a closed strategy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flotilla.comm.msgplane import connect
from flotilla.core.errors import ConfigError, RemoteError

__all__ = ["StrategyPeers"]

RESERVED = ("peer_", "ring_")  # the worker's own ops (the watch, ring repair)


class StrategyPeers:
    def __init__(
        self, server: Any, address_of: Callable[[int], str | None], secret: bytes, name: str
    ) -> None:
        self._server, self._address_of, self._secret = server, address_of, secret
        self._sender = f"{name}/strategy"
        self._handlers: dict[str, Callable[[Any], Any] | None] = {}
        self._lock = threading.Lock()

    def register(
        self,
        op: str,
        handler: Callable[[Any], Any],
        schema: dict[str, Any] | None = None,
        *,
        max_tensors: int | None = None,
    ) -> None:
        if op.startswith(RESERVED):
            raise ConfigError(f"peer op {op!r}: the prefixes {RESERVED} are the worker's own")
        with self._lock:
            first = op not in self._handlers
            self._handlers[op] = handler
        if first:
            self._server.register(
                op, lambda req, op=op: self._dispatch(op, req), schema, max_tensors=max_tensors
            )

    def unregister(self, op: str) -> None:
        with self._lock:
            if op in self._handlers:
                self._handlers[op] = None

    def _dispatch(self, op: str, req: Any) -> Any:
        handler = self._handlers.get(op)
        if handler is None:
            raise RemoteError("unavailable", f"{op}: no strategy on this worker answers it now")
        return handler(req)

    def address_of(self, worker_id: int) -> str | None:
        return self._address_of(worker_id)

    def connect(self, address: str) -> Any:
        """A client for a peer worker: a call to one whose process died fails at once
        (``comm/msgplane.py``: ``fail_on_disconnect``), not at its deadline."""
        return connect(address, self._secret, sender=self._sender, fail_on_disconnect=True)
