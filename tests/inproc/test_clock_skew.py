"""A host whose wall clock is off or jumps (a VM resumed after a pause) is not locked out by the
replay guard's time window (issue 37 item 8; ``comm/auth.py``, ``comm/endpoint_client.py``): a
known sender is held to a growing ``seq`` only, and a client an unknown receiver refuses with
``clock_skew`` learns the receiver's clock from the signed error reply and retries once.  Replays
stay refused."""

from __future__ import annotations

import time
import types

import pytest

from flotilla.comm import auth, endpoint_client
from flotilla.comm.inproc import exchange_raw
from flotilla.comm.msgplane import Limits, Request, connect, serve
from flotilla.core.errors import RemoteError

SECRET = auth.generate_secret()


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def incr(self, req: Request) -> dict:
        self.count += int(req.body["by"])
        return {"count": self.count}


def _server(counter: Counter):
    srv = serve(SECRET, "mem://", name="skewed")
    srv.register("incr", counter.incr, None)
    return srv.start()


@pytest.fixture
def skew(monkeypatch):
    """Set the client side's wall clock ``skew[0]`` seconds off this host's (the server's)."""
    off = [0.0]
    fake = types.SimpleNamespace(
        time=lambda: time.time() + off[0], time_ns=lambda: time.time_ns() + int(off[0] * 1e9)
    )
    monkeypatch.setattr(endpoint_client, "time", fake)
    return off


@pytest.mark.parametrize("offset_s", [300.0, -300.0, 4000.0])
def test_a_client_with_a_skewed_clock_learns_the_receivers_and_is_served(skew, caplog, offset_s) -> None:
    counter = Counter()
    srv = _server(counter)
    skew[0] = offset_s
    try:
        with connect(srv.address, SECRET, sender=f"skewed-{offset_s:g}") as client:
            assert client.call("incr", {"by": 2}).body == {"count": 2}  # refused once, then served
            assert client.call("incr", {"by": 3}).body == {"count": 5}
            assert counter.count == 5  # the refused attempt changed nothing
    finally:
        srv.close()
    assert "clock_skew" in caplog.text and "off the receiver's" in caplog.text


def test_a_known_sender_whose_clock_jumps_is_not_locked_out_and_a_restarted_receiver_learns_it(
    skew,
) -> None:
    counter = Counter()
    srv = _server(counter)
    try:
        with connect(srv.address, SECRET, sender="jumper") as client:
            assert client.call("incr", {"by": 1}).body == {"count": 1}
            skew[0] = -600.0  # the VM resumes ten minutes behind
            assert client.call("incr", {"by": 1}).body == {"count": 2}  # known: seq grows
            skew[0] = 900.0  # and then ahead
            assert client.call("incr", {"by": 1}).body == {"count": 3}
    finally:
        srv.close()
    restarted = _server(counter)  # a fresh guard: the sender is unknown there
    try:
        with connect(restarted.address, SECRET, sender="jumper") as client:
            assert client.call("incr", {"by": 1}).body == {"count": 4}
    finally:
        restarted.close()


def test_a_replayed_message_is_still_refused(skew) -> None:
    counter = Counter()
    srv = _server(counter)
    try:
        core = endpoint_client.ClientCore(SECRET, sender="replayer", limits=Limits())
        _, frames = core.request("incr", {"by": 7}, [])
        first = core.reply(exchange_raw(srv.address, frames, timeout_s=5))
        assert first.error is None and counter.count == 7
        skew[0] = -600.0
        again = core.reply(exchange_raw(srv.address, frames, timeout_s=5))
        assert isinstance(again.error, RemoteError) and again.error.code == "replay"
        assert counter.count == 7
    finally:
        srv.close()
    fresh = _server(counter)  # an old message at a receiver that never saw its sender
    try:
        _, old = endpoint_client.ClientCore(SECRET, sender="old", limits=Limits()).request(
            "incr", {"by": 1}, []
        )
        skew[0] = 0.0
        time_travel = endpoint_client.ClientCore(SECRET, sender="old", limits=Limits())
        outcome = time_travel.reply(exchange_raw(fresh.address, old, timeout_s=5))
        assert outcome.error is not None and outcome.error.code == "clock_skew" and counter.count == 7
    finally:
        fresh.close()
