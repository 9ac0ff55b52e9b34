"""Deferred replies on the message plane (``Request.defer``), on both transports: a handler
answers later from another thread while the server keeps serving; errors, double resolution,
resolution after close, and a second ``defer`` are handled."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flotilla.comm import auth
from flotilla.comm.msgplane import Deferred, Reply, Request, connect, serve
from flotilla.core.errors import CallTimeout, CommError, RemoteError

SECRET = auth.generate_secret()
pytestmark = pytest.mark.timeout(60)


class Parked:
    """``park`` defers its reply; ``release`` resolves every parked request from another thread."""

    def __init__(self) -> None:
        self.parked: list[tuple[Deferred, Request]] = []
        self.lock = threading.Lock()
        self.arrived = threading.Semaphore(0)

    def park(self, req: Request) -> Deferred:
        d = req.defer()
        with self.lock:
            self.parked.append((d, req))
        self.arrived.release()
        return d

    def release(self, *, fail: bool = False) -> list[bool]:
        with self.lock:
            items, self.parked = self.parked, []
        out = []
        for d, req in items:
            if fail:
                out.append(d.fail("denied", f"no for {req.body['i']}"))
            else:
                out.append(d.resolve(Reply({"i": req.body["i"]}, [t * 2 for t in req.tensors])))
        return out


@pytest.fixture(params=["mem://", "tcp://127.0.0.1:0"], ids=["inproc", "zmq"])
def server(request):
    svc = Parked()
    srv = serve(SECRET, request.param, name="deferring")
    srv.register("park", svc.park)
    srv.register("now", lambda r: {"now": True})
    srv.register("twice", lambda r: (r.defer(), r.defer()))
    srv.start()
    try:
        yield svc, srv
    finally:
        srv.close()


def test_deferred_reply_arrives_later_while_the_server_keeps_serving(server) -> None:
    svc, srv = server
    result: dict[str, object] = {}
    with connect(srv.address, SECRET, sender="a") as a, connect(srv.address, SECRET, sender="b") as b:
        t = threading.Thread(
            target=lambda: result.update(reply=a.call("park", {"i": 7}, [torch.arange(4.0)], timeout_s=20))
        )
        t.start()
        assert svc.arrived.acquire(timeout=10)
        t0 = time.monotonic()
        assert b.call("now", timeout_s=5).body == {"now": True}  # not blocked by the park
        assert time.monotonic() - t0 < 2.0
        assert "reply" not in result
        resolver = threading.Thread(target=lambda: result.update(sent=svc.release()))
        resolver.start()
        resolver.join(10)
        t.join(10)
    assert result["sent"] == [True]
    reply = result["reply"]
    assert reply.body == {"i": 7} and reply.tensors[0].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_deferred_error_and_double_resolution(server) -> None:
    svc, srv = server
    errors: list[RemoteError] = []

    def call() -> None:
        with connect(srv.address, SECRET, sender="c") as c:
            try:
                c.call("park", {"i": 1}, timeout_s=20)
            except RemoteError as exc:
                errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert svc.arrived.acquire(timeout=10)
    ((d, _),) = svc.parked
    assert svc.release(fail=True) == [True]
    assert d.done and d.resolve({"late": 1}) is False and d.fail("x", "y") is False
    t.join(10)
    assert [(e.code, e.message) for e in errors] == [("denied", "no for 1")]


def test_many_parked_requests_resolve_in_any_order(server) -> None:
    svc, srv = server
    replies: dict[int, int] = {}
    clients = [connect(srv.address, SECRET, sender=f"m{i}") for i in range(5)]
    threads = [
        threading.Thread(
            target=lambda i=i: replies.update({i: clients[i].call("park", {"i": i}, timeout_s=20).body["i"]})
        )
        for i in range(5)
    ]
    try:
        for t in threads:
            t.start()
        for _ in range(5):
            assert svc.arrived.acquire(timeout=10)
        svc.parked.reverse()
        svc.release()
        for t in threads:
            t.join(10)
    finally:
        for c in clients:
            c.close()
    assert replies == {i: i for i in range(5)}


def test_defer_twice_is_an_error_reply(server) -> None:
    _, srv = server
    with connect(srv.address, SECRET, sender="d") as c:
        with pytest.raises(RemoteError) as err:
            c.call("twice", timeout_s=5)
    assert err.value.code == "internal" and "once" in err.value.message


def test_resolving_after_close_is_dropped_silently(server) -> None:
    svc, srv = server
    outcome: list[BaseException] = []

    def call(c) -> None:
        try:
            c.call("park", {"i": 3}, timeout_s=0.8)
        except BaseException as exc:
            outcome.append(exc)

    with connect(srv.address, SECRET, sender="e") as c:
        t = threading.Thread(target=call, args=(c,))
        t.start()
        assert svc.arrived.acquire(timeout=10)
        srv.close()
        assert svc.release() == [True]  # resolved, but nobody is there to send it
        t.join(10)
    assert [type(e) for e in outcome] == [CallTimeout]


def test_a_plain_request_cannot_defer() -> None:
    with pytest.raises(CommError, match="cannot defer"):
        Request("op", {}, [], "s").defer()
