"""An authenticated view of the rendezvous store: every value is signed with the cluster secret.

torch's ``TCPStore`` has no authentication: any process that reaches its port may read, write
and delete keys.  :class:`AuthStore` wraps a store (it is a ``torch.distributed.Store``, so
``PrefixStore`` and gloo's rendezvous use it like any other) so that what a group *reads* comes
from a holder of the secret:

Invariants:
- ``set`` stores ``MAGIC | tag | value`` where ``tag`` is HMAC-SHA256 (``comm/auth.sign``, store
  domain) over the full key and the value: a signed value cannot be moved to another key (another
  epoch's namespace, another rank) nor altered.
- ``get`` returns only a value whose tag verifies.  A value without a valid tag (planted junk, a
  forgery, a value moved from another key) is treated as *absent*: it is counted and logged
  (``comm/rejections``, reason ``store_auth``) and ``get`` waits for the rightful writer to
  overwrite it, up to the store's timeout, then raises ``CollectiveError``.  Junk therefore never
  reaches gloo's parser (which raised ``ValueError: basic_string::_M_create`` on it).
- ``check`` is True only when every key holds a verified value.
- What it does NOT do (docs/security.md): values are not encrypted (an outsider who reaches the
  store's port can read the gloo addresses), an outsider can still delete or overwrite keys, which
  delays or fails a group's creation (a failed collective: the step is discarded and the view
  recovers), and ``add`` counters are not supported (nothing in flotilla uses them).
"""

from __future__ import annotations

import datetime as _dt
import time
from typing import Any

import torch.distributed as dist

from flotilla.comm import auth
from flotilla.comm.rejections import REJECTIONS, Rejections
from flotilla.core.errors import CollectiveError

__all__ = ["DOMAIN_STORE", "MAGIC", "AuthStore", "seal", "unseal"]

DOMAIN_STORE = b"flotilla/store/v1\x00"
MAGIC = b"FLS1"
_HEAD = len(MAGIC) + auth.TAG_BYTES
_RETRY_S = 0.02
_STORE_REJECTIONS = Rejections(parent=REJECTIONS, what="store value")


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


def seal(secret: bytes, key: str, value: bytes) -> bytes:
    """The stored form of ``value`` under ``key``: magic, tag, value."""
    return MAGIC + auth.sign(secret, DOMAIN_STORE, [_key_bytes(key), value]) + value


def unseal(secret: bytes, key: str, stored: bytes) -> bytes | None:
    """The value sealed under ``key`` in ``stored``, or None if it is not authentic."""
    if len(stored) < _HEAD or stored[: len(MAGIC)] != MAGIC:
        return None
    value = stored[_HEAD:]
    ok = auth.verify(secret, DOMAIN_STORE, [_key_bytes(key), value], stored[len(MAGIC) : _HEAD])
    return value if ok else None


class AuthStore(dist.Store):
    """``inner`` (e.g. a ``TCPStore`` client) with signed values (module doc).  ``host``/``port``
    name the inner TCP store, so the collective plane still binds the interface that reaches it."""

    def __init__(self, inner: Any, secret: bytes, *, timeout_s: float = 30.0) -> None:
        super().__init__()
        self._inner = inner
        self._secret = auth.check_secret(secret)
        self._timeout_s = timeout_s
        if hasattr(inner, "host") and hasattr(inner, "port"):
            self.host, self.port = inner.host, inner.port

    @property
    def inner(self) -> Any:
        return self._inner

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, seal(self._secret, key, data))

    def _verified(self, key: str, stored: bytes) -> bytes | None:
        value = unseal(self._secret, key, stored)
        if value is None:
            _STORE_REJECTIONS.record(
                "store_auth",
                "store",
                f"unsigned or forged value under {key[:80]!r}",
                where="rendezvous store",
            )
        return value

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                stored = bytes(self._inner.get(key))
            except Exception as exc:
                raise CollectiveError(f"store get {key[:80]!r} failed: {exc}") from None
            value = self._verified(key, stored)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise CollectiveError(f"store key {key[:80]!r} holds no authentic value")
            time.sleep(_RETRY_S)  # (the rightful writer's set replaces the junk)

    def check(self, keys: list[str]) -> bool:
        if not self._inner.check(keys):
            return False
        for key in keys:
            try:
                stored = bytes(self._inner.get(key))
            except Exception:
                return False
            if self._verified(key, stored) is None:
                return False
        return True

    def wait(self, keys: list[str], timeout: _dt.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: _dt.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._inner.set_timeout(timeout)
