"""Transport-independent client half of the message plane: building a signed request and
checking a signed reply (the server half is ``endpoint``).  Transports only move frames.

Invariants:
- Request header: exactly ``{v, op, sender, seq, ts, rid, body, tensors}``, signed under the
  request HMAC domain; replies are accepted only if signed under the reply domain and their header
  is exactly ``{v, rid, sender, ts, ok, body, tensors}``, so neither can be replayed as the other.
- ``ClientCore.reply`` raises ``MessageRejected`` for anything unauthentic or malformed; an error
  reply (``ok=False``) must carry a str ``code`` and ``message`` and no tensors, and becomes a
  ``RemoteError`` in the outcome, never an exception.
- ``seq`` is allocated process-wide per sender name, strictly increasing and seeded from the wall
  clock in nanoseconds, so a restarted process keeps passing its peers' replay guards.  Two
  processes must not use the same sender name at the same time.
- A ``clock_skew`` error reply (this host's clock is outside a receiver's window, ``comm/auth``)
  sets ``offset_s`` to the receiver's clock (the signed reply's ``ts``) minus ours; later
  requests are stamped with it (``ts`` and the ``seq`` seed), and ``ClientBase.call`` retries.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.comm import auth, codec
from flotilla.comm.codec import Buffer, Limits
from flotilla.comm.endpoint import Reply
from flotilla.comm.schema import MAX_NAME_CHARS, REPLY_FIELDS, check_fields, is_name
from flotilla.core.errors import ConfigError, MessageRejected, RemoteError
from flotilla.core.log import get_logger

__all__ = ["ClientCore", "ReplyOutcome", "next_seq"]

log = get_logger("comm")


# ----------------------------------------------------------------------------- sequence numbers
_seq_lock = threading.Lock()
_last_seq: dict[str, int] = {}


def next_seq(sender: str, offset_ns: int = 0) -> int:
    """Process-wide, per-sender, strictly increasing; seeded from the wall clock (ns) plus the
    offset to the receiver's clock the client learned (``ClientCore``)."""
    with _seq_lock:
        seq = max(_last_seq.get(sender, 0) + 1, time.time_ns() + offset_ns)
        _last_seq[sender] = seq
        return seq


# ----------------------------------------------------------------------------- client side
@dataclass(frozen=True, slots=True)
class ReplyOutcome:
    rid: str
    reply: Reply | None
    error: RemoteError | None


class ClientCore:
    """Builds signed requests and checks signed replies for one sender name."""

    def __init__(self, secret: bytes, *, sender: str, limits: Limits) -> None:
        self._secret = auth.check_secret(secret)
        if not is_name(sender):
            raise ConfigError(f"sender: must be a non-empty str of <= {MAX_NAME_CHARS} chars")
        self.sender = sender
        self.limits = limits
        self.offset_s = 0.0  # the receiver's clock minus ours, learned from a clock_skew refusal

    def request(
        self, op: str, body: Mapping[str, Any] | None, tensors: Sequence[torch.Tensor]
    ) -> tuple[str, list[Buffer]]:
        """A fresh request id and the signed frames (raises ``MessageRejected`` if oversized)."""
        if not is_name(op):
            raise ValueError(f"op: must be a str of 1..{MAX_NAME_CHARS} chars, got {op!r}")
        rid = secrets.token_hex(8)
        header = {  # rid, op, sender first: see codec.peek_header
            "v": codec.WIRE_VERSION,
            "rid": rid,
            "op": op,
            "sender": self.sender,
            "seq": next_seq(self.sender, int(self.offset_s * 1e9)),
            "ts": time.time() + self.offset_s,
            "body": dict(body or {}),
        }
        frames = codec.encode(
            header,
            list(tensors),
            secret=self._secret,
            domain=auth.DOMAIN_REQUEST,
            limits=self.limits,
        )
        return rid, frames

    def reply(self, frames: Sequence[Buffer]) -> ReplyOutcome:
        """Verify and decode a reply; raises ``MessageRejected`` for anything unauthentic or bad."""
        try:
            header, tensors = codec.decode(
                frames, secret=self._secret, domain=auth.DOMAIN_REPLY, limits=self.limits
            )
        except MessageRejected as exc:
            if exc.code == "auth":
                raise MessageRejected("auth", _unverified_hint(frames, self.limits)) from None
            raise
        check_fields(header, REPLY_FIELDS)
        body = header["body"]
        if header["ok"]:
            return ReplyOutcome(header["rid"], Reply(body, tensors), None)
        code, message = body.get("code"), body.get("message")
        if not (isinstance(code, str) and isinstance(message, str)) or tensors:
            raise MessageRejected("malformed", "error reply without str code and message")
        if code == "clock_skew":  # our clock is off the receiver's (signed reply: its clock)
            offset = float(header["ts"]) - time.time()
            log.warning("%s: clock %+.1f s off the receiver's; stamping with its clock", self.sender, -offset)
            self.offset_s = offset
        return ReplyOutcome(header["rid"], None, RemoteError(code, message))


def _unverified_hint(frames: Sequence[Buffer], limits: Limits) -> str:
    text = "reply failed authentication (is the server using a different secret?)"
    claimed = codec.peek_header(frames, limits)
    body = claimed.get("body")
    if claimed.get("ok") is False and isinstance(body, dict) and isinstance(body.get("code"), str):
        text += f"; unverified claim: error code {body['code'][:64]!r}"
    return text
