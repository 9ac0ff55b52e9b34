"""Message plane over the in-process transport: request/response, error replies, rejections that
change no state, timeouts, concurrency, restart and clean shutdown."""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest
import torch

from flotilla.comm import auth, codec
from flotilla.comm.endpoint_client import ClientCore, next_seq
from flotilla.comm.inproc import InprocClient, InprocServer, exchange_raw
from flotilla.comm.msgplane import Limits, Reply, Request, connect, serve
from flotilla.core.errors import CallTimeout, CommError, MessageRejected, RemoteError

SECRET = auth.generate_secret()
OTHER_SECRET = auth.generate_secret()
SLACK_S = 0.5


class Service:
    """Handlers over a little mutable state, so tests can assert that nothing changed."""

    def __init__(self) -> None:
        self.count = 0
        self.store: dict[str, int] = {}
        self.gate = threading.Event()
        self.entered = threading.Event()

    def register(self, srv) -> None:
        srv.register("incr", self.incr, {"key": str, "by": int}, max_tensors=0)
        srv.register("echo", lambda r: Reply(dict(r.body), list(r.tensors)))
        srv.register("plain", lambda r: {"sender": r.sender, "n": len(r.tensors)})
        srv.register("none", lambda r: None)
        srv.register("deny", self.deny)
        srv.register("fail", self.fail)
        srv.register("bad_return", lambda r: 42)
        srv.register("block", self.block)
        srv.register("scale", self.scale, max_tensors=1)

    def incr(self, req: Request) -> dict:
        self.count += 1
        self.store[req.body["key"]] = self.store.get(req.body["key"], 0) + req.body["by"]
        return {"count": self.count, "value": self.store[req.body["key"]]}

    def deny(self, req: Request) -> dict:
        raise RemoteError("denied", "not allowed")

    def fail(self, req: Request) -> dict:
        raise ValueError("boom")

    def block(self, req: Request) -> dict:
        self.entered.set()
        self.gate.wait(10)
        return {"blocked": req.body.get("i")}

    def scale(self, req: Request) -> Reply:
        (t,) = req.tensors
        t.mul_(2)  # decoded tensors are writable and private to the handler
        return Reply({}, [t])

    def snapshot(self) -> tuple[int, dict[str, int]]:
        return self.count, dict(self.store)


@pytest.fixture
def service():
    svc = Service()
    srv = serve(SECRET, "mem://", name="svc")
    svc.register(srv)
    srv.start()
    try:
        yield svc, srv
    finally:
        svc.gate.set()
        srv.close()


@pytest.fixture
def client(service):
    _, srv = service
    with connect(srv.address, SECRET, sender="client-0") as c:
        yield c


def _raw(op: str, body: dict, *, secret=SECRET, sender="raw", seq=None, ts=None, tensors=()):
    header = {
        "v": 1,
        "op": op,
        "sender": sender,
        "seq": next_seq(sender) if seq is None else seq,
        "ts": time.time() if ts is None else ts,
        "rid": "rawrid",
        "body": body,
    }
    return codec.encode(header, list(tensors), secret=secret, domain=auth.DOMAIN_REQUEST, limits=Limits())


def _signed_header(overrides: dict) -> list[bytes]:
    header = {
        "v": 1,
        "op": "incr",
        "sender": "raw",
        "seq": next_seq("raw"),
        "ts": time.time(),
        "rid": "rawrid",
        "body": {"key": "a", "by": 1},
        "tensors": [],
        **overrides,
    }
    head = msgpack.packb(header)
    return [head, auth.sign(SECRET, auth.DOMAIN_REQUEST, [head])]


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _reply_header(frames) -> dict:
    header, _ = codec.decode(frames, secret=SECRET, domain=auth.DOMAIN_REPLY, limits=Limits())
    return header


def _assert_error_reply(frames, code: str, rid: str = "rawrid") -> None:
    header = _reply_header(frames)
    assert header["ok"] is False and header["body"]["code"] == code, header
    assert header["rid"] == rid


# ----------------------------------------------------------------------------- happy paths
def test_echo_round_trips_tensors_bitwise(client):
    ts = [
        torch.randn(3, 4),
        torch.randn(5, dtype=torch.float64),
        torch.arange(7, dtype=torch.int64),
        torch.randn(2, 2).to(torch.bfloat16),
        torch.randint(0, 256, (9,), dtype=torch.uint8),
        torch.tensor(3.5),
        torch.zeros(0, 3),
        torch.arange(20.0).reshape(4, 5).t(),
    ]
    reply = client.call("echo", {"a": [1, "x"], "b": None}, ts, timeout_s=5)
    assert reply.body == {"a": [1, "x"], "b": None}
    assert len(reply.tensors) == len(ts)
    for got, want in zip(reply.tensors, ts):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _bytes_of(got) == _bytes_of(want)


def test_handler_return_kinds(client):
    assert client.call("plain", {}, [torch.ones(2)]).body == {"sender": "client-0", "n": 1}
    assert client.call("none").body == {} and client.call("none").tensors == []


def test_received_tensors_are_private_and_writable(client):
    t = torch.arange(4.0)
    reply = client.call("scale", tensors=[t])
    assert reply.tensors[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- error replies
def test_unknown_op_and_schema_errors_name_the_problem(service, client):
    svc, _ = service
    cases = [
        ("nope", {}, "unknown_op", "nope"),
        ("incr", {"key": "a"}, "schema", "'by'"),
        ("incr", {"key": "a", "by": 1, "extra": 0}, "schema", "'extra'"),
        ("incr", {"key": "a", "by": "1"}, "schema", "'by'"),
        ("incr", {"key": "a", "by": True}, "schema", "'by'"),
    ]
    for op, body, code, needle in cases:
        with pytest.raises(RemoteError) as info:
            client.call(op, body)
        assert info.value.code == code and needle in info.value.message
    with pytest.raises(RemoteError) as info:
        client.call("incr", {"key": "a", "by": 1}, [torch.ones(1)])
    assert info.value.code == "schema" and "max_tensors" in info.value.message
    assert svc.snapshot() == (0, {})
    assert client.call("incr", {"key": "a", "by": 2}).body == {"count": 1, "value": 2}


def test_handler_errors_become_error_replies_and_server_survives(service, client, caplog):
    svc, _ = service
    with pytest.raises(RemoteError) as info:
        client.call("deny")
    assert (info.value.code, info.value.message) == ("denied", "not allowed")
    with caplog.at_level(logging.ERROR, logger="flotilla"):
        with pytest.raises(RemoteError) as info:
            client.call("fail")
    assert info.value.code == "internal" and "ValueError: boom" in info.value.message
    assert "handler for 'fail' raised" in caplog.text and "Traceback" in caplog.text
    with pytest.raises(RemoteError) as info:
        client.call("bad_return")
    assert info.value.code == "internal"
    assert client.call("incr", {"key": "k", "by": 1}).body["count"] == 1


# ----------------------------------------------------------------------------- rejections
def test_wrong_secret_is_rejected_without_state_change(service, caplog):
    svc, srv = service
    with caplog.at_level(logging.WARNING, logger="flotilla"):
        with connect(srv.address, OTHER_SECRET, sender="intruder") as bad:
            with pytest.raises(MessageRejected) as info:
                bad.call("incr", {"key": "a", "by": 1}, timeout_s=5)
        forged = _raw("incr", {"key": "a", "by": 1}, secret=OTHER_SECRET)
        reply = exchange_raw(srv.address, forged, timeout_s=5)
    assert info.value.code == "auth" and "unverified claim: error code 'auth'" in info.value.message
    _assert_error_reply(reply, "auth")
    assert "rejected message" in caplog.text and "auth" in caplog.text
    assert svc.snapshot() == (0, {})


def test_replayed_message_is_rejected_without_state_change(service):
    svc, srv = service
    frames = _raw("incr", {"key": "a", "by": 5})
    assert _reply_header(exchange_raw(srv.address, frames, timeout_s=5))["ok"] is True
    assert svc.snapshot() == (1, {"a": 5})
    _assert_error_reply(exchange_raw(srv.address, frames, timeout_s=5), "replay")
    old_seq = _raw("incr", {"key": "a", "by": 5}, seq=1)
    _assert_error_reply(exchange_raw(srv.address, old_seq, timeout_s=5), "replay")
    stale = _raw("incr", {"key": "a", "by": 5}, sender="fresh", ts=time.time() - 120)
    _assert_error_reply(exchange_raw(srv.address, stale, timeout_s=5), "clock_skew")  # (unknown sender)
    assert svc.snapshot() == (1, {"a": 5})


@pytest.mark.parametrize(
    "frames_of, code, rid",
    [
        (lambda: [b"\xc1", auth.sign(SECRET, auth.DOMAIN_REQUEST, [b"\xc1"])], "malformed", ""),
        (lambda: [b"only-one-frame"], "malformed", ""),
        (lambda: _signed_header({"tensors": [{"dtype": "float32", "shape": [1]}]}), "malformed", "rawrid"),
        (lambda: _raw("incr", {"key": "a", "by": 1}, seq=-1), "malformed", "rawrid"),
        (lambda: _raw("incr", {"key": 3, "by": 1}), "schema", "rawrid"),
        (lambda: _raw("incr", {"key": "a", "by": 1}) + [b"x" * 8], "auth", "rawrid"),
    ],
    ids=["garbage", "one_frame", "descriptor_mismatch", "negative_seq", "schema", "extra_frame"],
)
def test_malformed_messages_are_rejected_without_state_change(service, client, frames_of, code, rid):
    svc, srv = service
    _assert_error_reply(exchange_raw(srv.address, frames_of(), timeout_s=5), code, rid)
    assert svc.snapshot() == (0, {})
    assert client.call("incr", {"key": "a", "by": 1}).body["count"] == 1


def test_oversized_messages_are_rejected_without_state_change():
    svc = Service()
    small = Limits(max_message_bytes=64 * 1024, max_header_bytes=4096, max_frames=4)
    with serve(SECRET, "mem://", limits=small, name="small") as srv:
        svc.register(srv)
        with connect(srv.address, SECRET, sender="big") as c:
            for tensors, body in [
                ([torch.zeros(20_000)], {}),  # 80 kB > 64 kB
                ([torch.zeros(1)] * 3, {}),  # 5 frames > 4
                ([], {"pad": "x" * 5000}),  # header > 4 kB
            ]:
                with pytest.raises(RemoteError) as info:
                    c.call("echo", body, tensors, timeout_s=5)
                assert info.value.code == "oversized"
            assert c.call("incr", {"key": "a", "by": 1}).body["count"] == 1
        with connect(srv.address, SECRET, sender="big", limits=small) as c:
            with pytest.raises(MessageRejected) as info:
                c.call("echo", {}, [torch.zeros(20_000)])  # refused before sending
            assert info.value.code == "oversized"
    assert svc.snapshot() == (1, {"a": 1})


def test_reply_with_bad_tag_is_rejected_by_the_client(service):
    _, srv = service
    with InprocClient(srv.address, SECRET, sender="c") as c:
        core = ClientCore(SECRET, sender="c", limits=Limits())
        _, forged = core.request("x", {}, [])  # signed as a request, not a reply
        c._replies.put(forged)
        with pytest.raises(MessageRejected) as info:
            c.call("echo", timeout_s=5)
        assert info.value.code == "auth"


# ----------------------------------------------------------------------------- timeouts
def test_call_times_out_and_late_reply_is_discarded(service, client):
    svc, _ = service
    start = time.monotonic()
    with pytest.raises(CallTimeout):
        client.call("block", {"i": 1}, timeout_s=0.3)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 0.3 + SLACK_S
    assert svc.entered.wait(5)
    svc.gate.set()  # the server now sends the late reply to the first call
    assert client.call("block", {"i": 2}, timeout_s=5).body == {"blocked": 2}
    assert client.call("echo", {"i": 3}, timeout_s=5).body == {"i": 3}


def test_call_to_missing_server_times_out():
    with connect("mem://nobody-here", SECRET, sender="c") as c:
        start = time.monotonic()
        with pytest.raises(CallTimeout):
            c.call("echo", timeout_s=0.2)
        assert time.monotonic() - start < 0.2 + SLACK_S


# ----------------------------------------------------------------------------- concurrency
def test_many_concurrent_clients(service):
    svc, srv = service
    num_clients, num_calls = 8, 40
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with connect(srv.address, SECRET, sender=f"w{i}") as c:
                for n in range(1, num_calls + 1):
                    reply = c.call("incr", {"key": f"k{i}", "by": 1}, timeout_s=10)
                    assert reply.body["value"] == n
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert svc.count == num_clients * num_calls
    assert svc.store == {f"k{i}": num_calls for i in range(num_clients)}


def test_one_client_shared_by_threads(client):
    results: dict[int, list[float]] = {}

    def worker(i: int) -> None:
        for j in range(20):
            reply = client.call("echo", {"i": i, "j": j}, [torch.full((3,), float(i * 100 + j))])
            assert reply.body == {"i": i, "j": j}
            results.setdefault(i, []).append(reply.tensors[0][0].item())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: [float(i * 100 + j) for j in range(20)] for i in range(4)}


# ----------------------------------------------------------------------------- lifecycle
def test_restart_at_same_address_and_bind_conflict():
    srv = serve(SECRET, "mem://restartable", name="one")
    srv.register("who", lambda r: {"name": "one"})
    with srv, connect("mem://restartable", SECRET, sender="c") as c:
        with pytest.raises(CommError, match="already bound"):
            InprocServer(SECRET, "mem://restartable")
        assert c.call("who").body == {"name": "one"}
        srv.close()
        with pytest.raises(CallTimeout):
            c.call("who", timeout_s=0.1)
        with serve(SECRET, "mem://restartable", name="two") as srv2:
            srv2.register("who", lambda r: {"name": "two"})
            assert c.call("who", timeout_s=5).body == {"name": "two"}


def test_close_is_idempotent_and_leaves_no_threads():
    baseline = threading.active_count()
    srv = serve(SECRET, "mem://", name="t").start()
    srv.register("echo", lambda r: r.body)
    c = connect(srv.address, SECRET, sender="c")
    assert c.call("echo", {"x": 1}).body == {"x": 1}
    assert threading.active_count() == baseline + 1
    c.close()
    c.close()
    srv.close()
    srv.close()
    assert threading.active_count() == baseline
    with pytest.raises(CommError):
        c.call("echo")
    with pytest.raises(CommError):
        srv.start()
