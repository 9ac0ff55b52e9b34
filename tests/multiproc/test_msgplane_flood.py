"""A junk flood against a real zmq server, and signed extreme values.

Flood: for ``FLOOD_S`` (10 s) a sender without the secret sends as fast as zmq takes them: bad
tags, undecodable headers, oversized frame lists (``max_frames``), and stale timestamps signed
with a wrong secret.  The log must stay small -- at most one WARNING line per reason per 5 s,
with counts -- and every message must be counted per reason.  Stated bound: ``LOG_BOUND_BYTES``
(16 KiB) for the whole flood (it was 4.2 MB in 30 s before issue 18).

Signed extremes: ``seq`` = 2^63-1 (and 2^64-1, which msgpack also carries) under a live sender's
name, correctly signed, is rejected and does not lock that sender out.
"""

from __future__ import annotations

import io
import logging
import math
import time

import pytest
import zmq

from flotilla.comm import auth, codec
from flotilla.comm.endpoint_client import next_seq
from flotilla.comm.msgplane import Limits, MessageServer, connect

pytestmark = pytest.mark.timeout(120)

SECRET = b"f" * 32
WRONG = b"w" * 32
FLOOD_S = 10.0  # (the server answers ~4,000 junk messages/s on 2 busy cores)
LOG_BOUND_BYTES = 16 * 1024
LIMITS = Limits(max_frames=8)


def _raw(sender: str, *, secret: bytes = SECRET, seq: int | None = None, ts: float | None = None) -> list:
    header = {
        "v": 1,
        "rid": "r",
        "op": "ping",
        "sender": sender,
        "seq": next_seq(sender) if seq is None else seq,
        "ts": time.time() if ts is None else ts,
        "body": {},
    }
    return codec.encode(header, [], secret=secret, domain=auth.DOMAIN_REQUEST, limits=Limits())


def _junk(i: int) -> list:
    kind = i % 4
    if kind == 0:
        return _raw("junk", secret=WRONG)  # auth
    if kind == 1:
        return [b"\xc1not msgpack", b"\0" * 32]  # auth (a tag that cannot verify)
    if kind == 2:
        return [b"x"] * 20  # oversized: 20 frames > max_frames
    return [b"x"]  # malformed: no tag


@pytest.fixture
def server():
    srv = MessageServer(SECRET, "tcp://127.0.0.1:0", limits=LIMITS, name="flooded")
    srv.register("ping", lambda req: {"pong": True})
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def captured():
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.WARNING)  # the default level
    root = logging.getLogger("flotilla")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_junk_flood_leaves_a_small_log_and_every_rejection_counted(server, captured) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    sent = answered = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < FLOOD_S:
            if sent - answered < 500:  # as fast as the server answers, 500 ahead of it
                sock.send_multipart(_junk(sent))
                sent += 1
            while sock.poll(0 if sent - answered < 500 else 50):
                sock.recv_multipart()  # (the error replies)
                answered += 1
        # every junk message is answered (with an error) once handled: wait for the last ones
        counted = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counted = sum(sum(by.values()) for by in server._core.rejections.counts().values())
            if counted >= sent:
                break
            sock.poll(100)
            while sock.poll(0):
                sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()
    elapsed = time.monotonic() - start
    server._core.rejections.flush()
    text = captured.getvalue()
    counts = server._core.rejections.counts()
    per_reason = {r: sum(b.values()) for r, b in counts.items()}
    lines = text.count("\n")
    print(
        f"\nflood: {sent} junk messages in {elapsed:.1f} s -> {len(text)} bytes, {lines} lines; {per_reason}"
    )
    assert sent > 1000, "the flood was not a flood"
    assert counted == sent
    assert set(counts) == {"auth", "oversized", "malformed"}
    assert len(text) < LOG_BOUND_BYTES
    for reason in counts:  # at most one line per reason per 5 s (plus the first)
        lines = [ln for ln in text.splitlines() if f"for {reason}:" in ln]
        assert 1 <= len(lines) <= math.ceil(elapsed / 5.0) + 1, (reason, lines)


def test_signed_extreme_seq_is_rejected_and_does_not_lock_the_sender_out(server, captured) -> None:
    client = connect(server.address, SECRET, sender="w0")
    try:
        assert client.call("ping", {}, timeout_s=10).body == {"pong": True}
        for seq in (2**63 - 1, 2**64 - 1):
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            try:
                sock.connect(server.address)
                sock.send_multipart(_raw("w0", seq=seq))
                assert sock.poll(10_000)
                header, _ = codec.decode(
                    sock.recv_multipart(), secret=SECRET, domain=auth.DOMAIN_REPLY, limits=Limits()
                )
            finally:
                sock.close(0)
                ctx.term()
            assert header["ok"] is False and header["body"]["code"] == "replay"
        assert client.call("ping", {}, timeout_s=10).body == {"pong": True}  # not locked out
    finally:
        client.close()
    assert "for replay:" in captured.getvalue()
