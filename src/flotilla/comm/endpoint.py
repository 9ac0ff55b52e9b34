"""Transport-independent server half of the message plane: what a server does with a received
frame list, and the request/reply/deferred types its handlers see.  The client half (building a
request, accepting a reply, ``seq`` allocation) is in ``endpoint_client``.  Transports (zmq in
``msgplane``, threads in ``inproc``) only move frames; every check lives here, in
``endpoint_client`` and in ``codec``.

Invariants:
- ``ServerCore.handle`` never raises and always returns signed reply frames: the handler's reply,
  or an error reply ``ok=False, body={code, message}`` carrying the request's ``rid``.
- A message that fails any check (size, auth, decoding, header, replay, op, schema) is counted
  per reason and claimed sender (``comm/rejections``: at most one WARNING summary line per reason
  per 5 s per server, with counts) and answered with an error reply; its handler is not called.
- A handler may answer later: it returns ``request.defer()`` (a :class:`Deferred`) and resolves it
  once, from any thread; ``handle`` then returns ``None`` and the transport's ``deliver`` callback
  receives the signed reply frames when the deferred is resolved.  A deferred resolved twice, or
  after its server closed, is ignored (``resolve`` returns False).
- Request header: exactly ``{v, op, sender, seq, ts, rid, body, tensors}``; reply header: exactly
  ``{v, rid, sender, ts, ok, body, tensors}``.  Requests and replies are signed under different
  HMAC domains so neither can be replayed as the other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flotilla.comm import auth, codec
from flotilla.comm.codec import Buffer, Limits
from flotilla.comm.rejections import REJECTIONS, Rejections
from flotilla.comm.schema import (
    MAX_NAME_CHARS,
    REQUEST_FIELDS,
    IntRange,
    Schema,
    check_body,
    check_fields,
    is_int,
    is_name,
    is_rid,
    normalise_schema,
)
from flotilla.core.errors import CommError, ConfigError, MessageRejected, RemoteError
from flotilla.core.log import get_logger

__all__ = [
    "Deferred",
    "Deliver",
    "Handler",
    "Reply",
    "Request",
    "ServerCore",
]

log = get_logger("comm.msgplane")

MAX_ERROR_CHARS = 2000


Deliver = Callable[[list[Buffer]], None]
"""Transport callback that sends one reply's frames back to the peer that asked (thread-safe)."""


class Deferred:
    """A reply promised by a handler that returned it; resolve it exactly once, from any thread.

    ``resolve`` sends a successful reply (a ``Reply``, a dict or None, as a handler returns),
    ``fail`` an error reply with ``code``/``message`` (what a handler raising ``RemoteError`` sends).
    Both return True if this call sent the reply, False if the deferred was already resolved.
    """

    __slots__ = ("_core", "_deliver", "_done", "_lock", "op", "rid")

    def __init__(self, core: ServerCore, rid: str, op: str, deliver: Deliver) -> None:
        self._core = core
        self._deliver = deliver
        self._lock = threading.Lock()
        self._done = False
        self.rid = rid
        self.op = op

    @property
    def done(self) -> bool:
        return self._done

    def _claim(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True

    def resolve(self, result: Reply | dict[str, Any] | None = None) -> bool:
        if not self._claim():
            return False
        self._send(self._core._reply_frames(self.rid, self.op, result))
        return True

    def fail(self, code: str, message: str) -> bool:
        if not self._claim():
            return False
        self._send(self._core._error(self.rid, code, message))
        return True

    def _send(self, frames: list[Buffer]) -> None:
        try:
            self._deliver(frames)
        except Exception:
            log.exception("%s: could not deliver a deferred reply to %r", self._core.name, self.op)


@dataclass(frozen=True, slots=True)
class Request:
    """A validated, authenticated request as a handler sees it."""

    op: str
    body: dict[str, Any]
    tensors: list[torch.Tensor]
    sender: str
    _deferrer: Callable[[], Deferred] | None = field(default=None, repr=False, compare=False)

    def defer(self) -> Deferred:
        """Promise the reply for later: return the result from the handler, resolve it later.

        Raises ``CommError`` on a transport without deferred replies, or if called twice.
        """
        if self._deferrer is None:
            raise CommError(f"op {self.op!r}: this transport cannot defer replies")
        return self._deferrer()


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful reply: a msgpack-able body and raw tensors."""

    body: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)


Handler = Callable[[Request], "Reply | dict[str, Any] | Deferred | None"]


# ----------------------------------------------------------------------------- server side
@dataclass(frozen=True, slots=True)
class _Route:
    handler: Handler
    schema: dict[str, tuple[type | IntRange, ...]] | None
    max_tensors: int | None


class ServerCore:
    """Validation, replay state, routing and reply encoding of one server.  ``handle`` is called
    by one thread at a time (the transport's serving thread); ``register`` from any thread."""

    def __init__(self, secret: bytes, *, limits: Limits, name: str) -> None:
        self._secret = auth.check_secret(secret)
        if not is_name(name):
            raise ConfigError(f"name: must be a non-empty str of <= {MAX_NAME_CHARS} chars")
        self.limits = limits
        self.name = name
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()
        self._guard = auth.ReplayGuard(limits.replay_window_s)
        self.rejections = Rejections(parent=REJECTIONS)  # (rate-limited WARNING summaries)

    def register(
        self,
        op: str,
        handler: Handler,
        schema: Schema | None = None,
        *,
        max_tensors: int | None = None,
    ) -> None:
        if not is_name(op):
            raise ConfigError(f"op: must be a str of 1..{MAX_NAME_CHARS} chars, got {op!r}")
        if not callable(handler):
            raise ConfigError(f"handler for {op!r}: must be callable")
        if max_tensors is not None and (not is_int(max_tensors) or max_tensors < 0):
            raise ConfigError(f"max_tensors: must be None or an int >= 0, got {max_tensors!r}")
        route = _Route(handler, normalise_schema(schema), max_tensors)
        with self._routes_lock:
            if op in self._routes:
                raise ConfigError(f"op {op!r} is already registered on {self.name}")
            self._routes[op] = route

    def handle(
        self, frames: Sequence[Buffer], peer: str, deliver: Deliver | None = None
    ) -> list[Buffer] | None:
        """Reply frames for one received frame list (never raises), or None if the handler
        deferred its reply (possible only when the transport passes ``deliver``)."""
        try:
            try:
                request, route, rid = self._admit(frames, deliver)
            except MessageRejected as exc:
                return self._reject(exc, frames, peer)
            return self._dispatch(request, route, rid)
        except Exception as exc:  # a bug here must not kill the serving thread
            log.exception("%s: unexpected failure handling a message from %s", self.name, peer)
            rid = _peek_rid(frames, self.limits)
            return self._error(rid, "internal", f"{type(exc).__name__}: {exc}")

    def _admit(self, frames: Sequence[Buffer], deliver: Deliver | None) -> tuple[Request, _Route, str]:
        header, tensors = codec.decode(
            frames, secret=self._secret, domain=auth.DOMAIN_REQUEST, limits=self.limits
        )
        check_fields(header, REQUEST_FIELDS)
        self._guard.accept(header["sender"], header["seq"], float(header["ts"]))
        op = header["op"]
        route = self._routes.get(op)
        if route is None:
            raise MessageRejected("unknown_op", f"no handler for op {op!r} on {self.name}")
        if route.schema is not None:
            check_body(header["body"], route.schema)
        if route.max_tensors is not None and len(tensors) > route.max_tensors:
            raise MessageRejected(
                "schema", f"{len(tensors)} tensors > max_tensors {route.max_tensors} for {op!r}"
            )
        rid = header["rid"]
        deferrer = None if deliver is None else _one_deferred(self, rid, op, deliver)
        return Request(op, header["body"], tensors, header["sender"], deferrer), route, rid

    def _reject(self, exc: MessageRejected, frames: Sequence[Buffer], peer: str) -> list[Buffer]:
        claimed = codec.peek_header(frames, self.limits)
        sender = claimed.get("sender") if is_name(claimed.get("sender")) else "?"
        op = claimed.get("op") if is_name(claimed.get("op")) else "?"
        self.rejections.record(
            exc.code,
            str(sender) if sender != "?" else f"peer {peer}",
            f"peer={peer} claimed sender={sender!r} op={op!r}: {exc.message}",
            where=self.name,
        )
        rid = claimed.get("rid")
        return self._error(rid if isinstance(rid, str) and is_rid(rid) else "", exc.code, exc.message)

    def _dispatch(self, request: Request, route: _Route, rid: str) -> list[Buffer] | None:
        try:
            result = route.handler(request)
        except RemoteError as exc:
            log.debug("%s: handler for %r answered error %s", self.name, request.op, exc.code)
            return self._error(rid, str(exc.code), str(exc.message))
        except Exception as exc:
            log.exception("%s: handler for %r raised", self.name, request.op)
            return self._error(rid, "internal", f"{type(exc).__name__}: {exc}")
        if isinstance(result, Deferred):
            if result.rid != rid:
                log.error("%s: handler for %r returned another request's deferred", self.name, request.op)
                return self._error(rid, "internal", "handler returned a foreign deferred reply")
            return None
        return self._reply_frames(rid, request.op, result)

    def _reply_frames(self, rid: str, op: str, result: Any) -> list[Buffer]:
        try:
            reply = _as_reply(result)
            return self._encode(rid, True, reply.body, reply.tensors)
        except Exception as exc:
            log.exception("%s: handler for %r returned an unsendable reply", self.name, op)
            return self._error(rid, "internal", f"unsendable reply: {type(exc).__name__}: {exc}")

    def _error(self, rid: str, code: str, message: str) -> list[Buffer]:
        body = {"code": code[:MAX_NAME_CHARS], "message": message[:MAX_ERROR_CHARS]}
        return self._encode(rid, False, body, [])

    def _encode(
        self, rid: str, ok: bool, body: dict[str, Any], tensors: Sequence[torch.Tensor]
    ) -> list[Buffer]:
        header = {  # rid, ok, sender first: see codec.peek_header
            "v": codec.WIRE_VERSION,
            "rid": rid,
            "ok": ok,
            "sender": self.name,
            "ts": time.time(),
            "body": body,
        }
        return codec.encode(
            header, tensors, secret=self._secret, domain=auth.DOMAIN_REPLY, limits=self.limits
        )


def _one_deferred(core: ServerCore, rid: str, op: str, deliver: Deliver) -> Callable[[], Deferred]:
    made: list[Deferred] = []

    def make() -> Deferred:
        if made:
            raise CommError(f"op {op!r}: defer() may be called once per request")
        made.append(Deferred(core, rid, op, deliver))
        return made[0]

    return make


def _peek_rid(frames: Sequence[Buffer], limits: Limits) -> str:
    rid = codec.peek_header(frames, limits).get("rid")
    return rid if isinstance(rid, str) and is_rid(rid) else ""


def _as_reply(result: Any) -> Reply:
    if isinstance(result, Reply):
        return result
    if result is None:
        return Reply({})
    if isinstance(result, Mapping):
        return Reply(dict(result))
    raise TypeError(f"handler must return a Reply, a dict or None, not {type(result).__name__}")
