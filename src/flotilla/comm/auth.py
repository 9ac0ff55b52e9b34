"""Message authentication: the per-cluster secret, HMAC-SHA256 tags and the replay guard.

Invariants:
- The secret is ``bytes`` of at least ``MIN_SECRET_BYTES``; it travels only through a file of mode
  0600 (written atomically by ``write_secret_file``), never on a command line, and is never logged.
- A tag is HMAC-SHA256 over a *domain* (request or reply, so one cannot be replayed as the other)
  followed by every part, each preceded by its 8-byte length, so no two different frame lists share
  a tag.  A part longer than ``DIGEST_THRESHOLD`` bytes enters the HMAC as its 32-byte BLAKE3
  digest instead of its bytes (hash-then-MAC: forging a tag then needs a BLAKE3 collision or
  second preimage, 128-bit security).  BLAKE3 hashes at ~4.5 GB/s per core here against ~1.3 GB/s
  for SHA-256, and every tensor byte of a push/pull is authenticated four times.  Which parts are
  digested depends on the (authenticated) length alone, so the encoding stays unambiguous.
- Tags are compared in constant time (``hmac.compare_digest``).
- ``ReplayGuard`` accepts a message only if its sequence number lies in the sender's window:
  strictly greater than the last one accepted from that sender, and at most ``ts`` (in ns) +
  ``SEQ_AHEAD_NS`` (about 73 minutes).  Senders seed ``seq`` from their (offset-corrected) wall
  clock in ns (``endpoint_client.next_seq``), so every honest ``seq`` is below that bound, and one
  absurd ``seq`` (2^63-1, correctly signed) is rejected instead of locking the sender out.  It
  remembers at most ``max_senders`` senders (LRU); a forgotten or unknown sender must also carry a
  timestamp within ``window_s`` of this host's clock (``clock_skew`` otherwise), so replays are
  bounded by the window even after eviction or a restart.  A known sender's timestamp is not
  compared with this host's clock (its growing ``seq`` already rejects replays), so a host whose
  wall clock jumps is not locked out; a client refused with ``clock_skew`` learns its offset from
  the signed error reply's timestamp and retries once (``comm/base.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import blake3

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.errors import ConfigError, MessageRejected
from flotilla.core.log import get_logger

__all__ = [
    "DIGEST_THRESHOLD",
    "DOMAIN_REPLY",
    "DOMAIN_REQUEST",
    "MIN_SECRET_BYTES",
    "SECRET_BYTES",
    "SEQ_AHEAD_NS",
    "TAG_BYTES",
    "ReplayGuard",
    "check_secret",
    "generate_secret",
    "read_secret_file",
    "sign",
    "verify",
    "write_secret_file",
]

log = get_logger("comm.auth")

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
TAG_BYTES = 32
DOMAIN_REQUEST = b"flotilla/msg/v2/request\x00"
DOMAIN_REPLY = b"flotilla/msg/v2/reply\x00"
DIGEST_THRESHOLD = 64 * 1024
SEQ_AHEAD_NS = 2**42  # ~73 min: covers a clock jump; rejects an absurd seq
"""How far (ns, ~8.6 s) a request's ``seq`` may run ahead of its own timestamp (``ReplayGuard``)."""

Buffer = bytes | bytearray | memoryview


def generate_secret() -> bytes:
    """A fresh random per-cluster secret (32 bytes from the OS CSPRNG)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: object) -> bytes:
    """Return ``secret`` if it is usable, else raise ``ConfigError`` (never echoing its value)."""
    if not isinstance(secret, bytes):
        raise ConfigError(f"secret: must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret: must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def write_secret_file(path: str | os.PathLike[str], secret: bytes) -> None:
    """Write ``secret`` as one line of hex to ``path``, atomically, with mode 0600."""
    check_secret(secret)
    atomic_write_bytes(path, secret.hex().encode("ascii") + b"\n", mode=0o600)


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Read a secret written by ``write_secret_file``.

    Raises ``ConfigError`` (naming the path, never the content) if the file is missing, not hex or
    too short; logs a warning if the file is readable by group or others.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_bytes().strip()
    except FileNotFoundError:
        raise ConfigError(f"secret file {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"secret file {str(p)!r} cannot be read: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is accessible by group/others (mode %o); use 0600", p, mode & 0o777)
    try:
        secret = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"secret file {str(p)!r} is not a hex-encoded secret") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"secret file {str(p)!r} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed"
        )
    return secret


def _nbytes(part: Buffer) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(part)


def sign(secret: bytes, domain: bytes, parts: Sequence[Buffer]) -> bytes:
    """HMAC-SHA256 over ``domain`` and each part, each part preceded by its 8-byte length.

    A part of more than ``DIGEST_THRESHOLD`` bytes is fed as its BLAKE3-256 digest (module doc).
    """
    mac = hmac.new(secret, domain, hashlib.sha256)
    for part in parts:
        n = _nbytes(part)
        mac.update(n.to_bytes(8, "big"))
        mac.update(blake3.blake3(part).digest() if n > DIGEST_THRESHOLD else part)
    return mac.digest()


def verify(secret: bytes, domain: bytes, parts: Sequence[Buffer], tag: Buffer) -> bool:
    """True iff ``tag`` is the tag of ``parts`` under ``secret`` (constant-time compare)."""
    if _nbytes(tag) != TAG_BYTES:
        return False
    return hmac.compare_digest(sign(secret, domain, parts), bytes(tag))


class ReplayGuard:
    """Per-sender replay state of one receiving endpoint.  Not thread-safe: one owner thread."""

    def __init__(
        self,
        window_s: float,
        *,
        max_senders: int = 65536,
        now: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0:
            raise ConfigError(f"window_s: must be > 0, got {window_s}")
        if max_senders < 1:
            raise ConfigError(f"max_senders: must be >= 1, got {max_senders}")
        self._window_s = window_s
        self._max_senders = max_senders
        self._now = now
        self._last_seq: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last_seq)

    def check(self, sender: str, seq: int, ts: float) -> None:
        """Raise ``MessageRejected("replay")`` if not newer than the last accepted (or beyond the
        sender's window), ``MessageRejected("clock_skew")`` if an unknown sender's timestamp is
        outside the window (the client corrects its clock offset from the signed error reply and
        retries: ``endpoint_client.ClientCore``).  A known sender's timestamp is not compared
        with this host's clock: its ``seq`` must grow, which rejects every replay, and a host
        whose wall clock jumped (a VM resumed after a pause) is not locked out."""
        last = self._last_seq.get(sender)
        if last is None:
            skew_s = ts - self._now()
            if abs(skew_s) > self._window_s:
                raise MessageRejected(
                    "clock_skew", f"timestamp is {skew_s:+.1f} s from now (window {self._window_s} s)"
                )
        if seq > int(ts * 1e9) + SEQ_AHEAD_NS:
            raise MessageRejected(
                "replay", f"seq {seq} is beyond the sender's window (its timestamp {ts:.3f} s)"
            )
        if last is not None and seq <= last:
            raise MessageRejected("replay", f"seq {seq} is not greater than last seen {last}")

    def accept(self, sender: str, seq: int, ts: float) -> None:
        """``check`` then record ``seq`` as the newest from ``sender`` (evicting the LRU sender)."""
        self.check(sender, seq, ts)
        self._last_seq[sender] = seq
        self._last_seq.move_to_end(sender)
        while len(self._last_seq) > self._max_senders:
            self._last_seq.popitem(last=False)
