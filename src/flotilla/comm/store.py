"""The rendezvous store of the collective plane: torch's ``TCPStore``, hosted by the coordinator
(``StoreHost``) and reached by every worker (``connect_store``).  Groups meet in it under their
namespace (``comm/collective.py``).  ``TCPStore`` itself is not authenticated; a client given the
cluster secret (``connect_store(..., secret=...)``) signs every value it writes and ignores every
value it reads that is not signed (``comm/store_auth.py``, docs/security.md)."""

from __future__ import annotations

import datetime as _dt
import socket
from dataclasses import dataclass

import torch.distributed as dist

from flotilla.comm.store_auth import AuthStore
from flotilla.core.errors import CollectiveError

__all__ = ["StoreAddress", "StoreHost", "connect_store", "private_connection"]


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class StoreAddress:
    host: str
    port: int


class StoreHost:
    """The rendezvous store hosted by the coordinator (torch ``TCPStore``, master side).

    ``TCPStore`` alone listens on every interface; we bind the listening socket ourselves to
    ``host`` (127.0.0.1 by default) and hand it over, so the store is reachable only there.
    The server is not authenticated: its clients sign and verify values (``connect_store``
    with ``secret``), so an outsider can delay a group's creation but not feed it junk.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        sock = socket.create_server((host, port), backlog=128)
        bound_port = sock.getsockname()[1]
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                host,
                bound_port,
                is_master=True,
                wait_for_workers=False,
                timeout=_td(timeout_s),
                use_libuv=True,
                master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns (and closes) the listening descriptor now
        self.address = StoreAddress(host, bound_port)

    def close(self) -> None:
        self._store = None  # the server thread stops when the last reference goes


def connect_store(
    address: StoreAddress, timeout_s: float = 30.0, *, secret: bytes | None = None
) -> dist.Store:
    """A client connection to the coordinator's store; with ``secret``, an
    :class:`~flotilla.comm.store_auth.AuthStore` over it (every value signed and verified)."""
    try:
        inner = dist.TCPStore(
            address.host, address.port, is_master=False, timeout=_td(timeout_s), use_libuv=True
        )
    except Exception as exc:  # torch raises RuntimeError / DistStoreError
        raise CollectiveError(f"cannot reach store {address.host}:{address.port}: {exc}") from exc
    return inner if secret is None else AuthStore(inner, secret, timeout_s=timeout_s)


def private_connection(store: dist.Store) -> dist.Store:
    """A connection of its own to the same store (``TCPStore.clone``; an ``AuthStore`` keeps its
    secret), for work that may be abandoned while it waits: a store client answers one request
    at a time, so a ``get`` left blocked on a shared connection (a group construction given up
    because a member died) would hold every later request of this process behind it until the
    store's timeout.  A store that cannot be cloned is returned as it is."""
    if isinstance(store, AuthStore):
        return AuthStore(private_connection(store.inner), store.secret, timeout_s=store.timeout_s)
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # (a store type without its own connections: HashStore, FileStore)
        return store
