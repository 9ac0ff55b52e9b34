"""Emulated links (``comm/shaping.py``, ``cluster.links.emulate``): real gloo groups of members
in threads of one process, each member with its own name, over links slower than the host.

Every assertion on time is a lower bound the model gives (a message cannot arrive before its
modelled link delivered it), which holds on any machine; the payloads are checked exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.link_costs import ModelCosts
from flotilla.cluster.spec import Link, LinkModel, PairLink
from flotilla.comm import shaping
from flotilla.comm.collective import Group, wait_disposed
from flotilla.comm.endpoint import Reply
from flotilla.comm.msgplane import MessageClient, MessageServer
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.errors import CollectiveError

pytestmark = pytest.mark.timeout(120)

MB = 2**20
# a-b: 80 Mbit/s (10 MB/s), 20 ms; the rest: the default 10 Gbit/s, no latency
SLOW = PairLink(a="a", b="b", bandwidth_gbps=0.08, latency_s=0.02)
MODEL = LinkModel(default_bandwidth_gbps=10.0, latency_s=0.0, pairs=(SLOW,))
COSTS = ModelCosts(MODEL)


def _groups(names: list[str], namespace: str, host: StoreHost) -> list[Group]:
    def build(rank: int) -> Group:
        return Group(
            connect_store(host.address),
            namespace=namespace,
            rank=rank,
            world_size=len(names),
            timeout_s=60.0,
            shaping=shaping.Shaping(me=names[rank], costs=COSTS),
        )

    return _in_threads(*[lambda r=r: build(r) for r in range(len(names))])


def _in_threads(*fns: Callable[[], Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


@pytest.fixture
def host() -> Any:
    h = StoreHost("127.0.0.1")
    yield h
    h.close()
    assert wait_disposed(30.0)


def test_a_send_arrives_no_earlier_than_its_link_delivers_it_in_order(
    host: StoreHost,
) -> None:
    a, b = _groups(["a", "b"], "p2p/", host)
    try:
        sizes = [MB, MB // 2, 4]  # bytes; three sends back to back on one link
        sent = [torch.full((n // 4,), float(i + 1)) for i, n in enumerate(sizes)]
        got = [torch.zeros(n // 4) for n in sizes]
        arrived: list[float] = []

        def receive() -> None:
            for i, buf in enumerate(got):
                b.recv(buf, 0, tag=10 + i).wait()
                arrived.append(time.monotonic())

        t = threading.Thread(target=receive)
        t.start()
        posted = time.monotonic()
        handles = [a.send(x, 1, tag=10 + i) for i, x in enumerate(sent)]
        post_s = time.monotonic() - posted
        for h in handles:
            h.wait()
        t.join(60)
        for x, y in zip(sent, got, strict=True):
            assert torch.equal(x, y)
        link = Link(bandwidth_gbps=SLOW.bandwidth_gbps, latency_s=SLOW.latency_s)
        # each leaves when the link has sent the ones before it (serialised), then its latency
        left = 0.0
        for i, n in enumerate(sizes):
            left += transfer_s(n, link) - link.latency_s
            assert arrived[i] - posted >= left + link.latency_s - 1e-3, (i, arrived[i] - posted)
        assert post_s < transfer_s(sizes[0], link)  # (posting does not wait for the link)
    finally:
        a.close()
        b.close()


def test_an_allreduce_takes_at_least_the_ring_over_the_slowest_link(host: StoreHost) -> None:
    groups = _groups(["a", "b", "c"], "ar/", host)
    try:
        n = MB // 4
        tensors = [torch.full((n,), float(r + 1)) for r in range(3)]
        t0 = time.monotonic()
        _in_threads(*[lambda g=g, x=x: g.allreduce(x) for g, x in zip(groups, tensors, strict=True)])
        took = time.monotonic() - t0
        for x in tensors:
            assert torch.equal(x, torch.full((n,), 6.0))
        slowest = Link(bandwidth_gbps=SLOW.bandwidth_gbps, latency_s=SLOW.latency_s)
        assert took >= ring_allreduce_s(3, MB, slowest) - 1e-3
        # a group without the slow pair is held only by its fast links' (negligible) model
        assert COSTS.allreduce_s(("a", "c"), MB) < 0.01 < COSTS.allreduce_s(("a", "b", "c"), MB)
    finally:
        for g in groups:
            g.close()


def test_a_broadcast_is_held_by_the_sources_slowest_link(host: StoreHost) -> None:
    groups = _groups(["a", "b", "c"], "bc/", host)
    try:
        x = [torch.arange(MB // 4, dtype=torch.float32) if r == 0 else torch.zeros(MB // 4) for r in range(3)]
        t0 = time.monotonic()
        _in_threads(*[lambda g=g, t=t: g.broadcast([t], 0) for g, t in zip(groups, x, strict=True)])
        took = time.monotonic() - t0
        assert all(torch.equal(t, x[0]) for t in x)
        assert took >= COSTS.broadcast_s(("a", "b", "c"), 0, MB) - 1e-3
        assert COSTS.broadcast_s(("a", "b", "c"), 0, MB) == pytest.approx(
            transfer_s(MB, Link(bandwidth_gbps=0.08, latency_s=0.02))
        )
    finally:
        for g in groups:
            g.close()


def test_an_abort_fails_the_sends_still_on_their_link_at_once(host: StoreHost) -> None:
    # 10 MB at 10 MB/s: the send waits about a second on its link; the abort ends that wait
    a, b = _groups(["a", "b"], "abort/", host)
    try:
        handle = a.send(torch.zeros(10 * MB // 4), 1, tag=1)
        threading.Timer(0.1, lambda: a.abort("epoch 2 is broken")).start()
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="broken"):
            handle.wait()
        assert time.monotonic() - t0 < transfer_s(10 * MB, Link(bandwidth_gbps=0.08, latency_s=0.02))
    finally:
        a.close()
        b.close()


def test_a_message_plane_call_crosses_the_link_both_ways() -> None:
    secret = b"k" * 32
    slow = ModelCosts(LinkModel(default_bandwidth_gbps=0.08, latency_s=0.02))
    server = MessageServer(secret, name="srv", shaping=shaping.Shaping(me="srv", costs=slow))
    server.register("echo", lambda req: Reply({}, list(req.tensors)))
    server.start()
    client = MessageClient(server.address, secret, sender="a", shaping=shaping.Shaping(me="a", costs=slow))
    payload = torch.ones(MB // 4)
    try:
        t0 = time.monotonic()
        reply = client.call("echo", {}, [payload], timeout_s=30)
        took = time.monotonic() - t0
        assert torch.equal(reply.tensors[0], payload)
        assert took >= 2 * transfer_s(MB, Link(bandwidth_gbps=0.08, latency_s=0.02)) - 1e-3
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("installed_later", [False, True])
def test_a_server_receives_its_clients_messages_one_after_another(installed_later: bool) -> None:
    """Two clients (processes of their own) push 1 MiB each to one server at once: the server's
    link takes them in one after the other, so the later one is in no earlier than two
    transmissions after they left (SPEC §1: a shard's link is what m workers share); each
    client's own link is its own.  ``installed_later``: the server was built before its process
    installed the links (a worker's peer server is: it exists before the worker knows its job)."""
    secret = b"k" * 32
    slow = ModelCosts(LinkModel(default_bandwidth_gbps=0.08, latency_s=0.005))
    mine = shaping.Shaping(me="srv", costs=slow)
    server = MessageServer(secret, name="srv", shaping=None if installed_later else mine)
    server.register("push", lambda req: {"n": len(req.tensors)})
    server.start()
    if installed_later:
        shaping.install(mine)
    clients = [
        MessageClient(server.address, secret, sender=f"w{i}", shaping=shaping.Shaping(me=f"w{i}", costs=slow))
        for i in range(2)
    ]
    payload = torch.ones(MB // 4)
    try:
        for c in clients:
            c.call("push", {}, [], timeout_s=30)  # (connected)
        start = threading.Barrier(2)

        def push(c: MessageClient) -> float:
            start.wait()
            t0 = time.monotonic()
            c.call("push", {}, [payload], timeout_s=30)
            return time.monotonic() - t0

        took = _in_threads(*[lambda c=c: push(c) for c in clients])
        link = Link(bandwidth_gbps=0.08, latency_s=0.005)
        one = transfer_s(MB, link) - link.latency_s  # one message's transmission
        assert min(took) >= one + link.latency_s - 1e-3
        assert max(took) >= 2 * one + link.latency_s - 1e-3, took
    finally:
        shaping.install(None)
        for c in clients:
            c.close()
        server.close()


def test_the_cluster_section_installs_its_links_only_when_asked() -> None:
    from flotilla.config.load import load_config

    text = (
        "job: {{model: {{name: cnn1d}}, dataset: {{name: mnist1d, num_samples: 256}},\n"
        "      batch_size: 8, steps: 2}}\n"
        "cluster:\n  workers: [{{name: a}}, {{name: b}}]\n"
        "  links: {{bandwidth_gbps: 1.0, latency_s: 0.001, {extra}\n"
        "          pairs: [{{a: a, b: b, bandwidth_gbps: 0.5}}]}}\n"
    )
    off = load_config(text=text.format(extra=""))
    assert off.cluster.link_shaping("a") is None
    on = load_config(text=text.format(extra="emulate: true, "))
    s = on.cluster.link_shaping("a")
    assert s is not None and s.me == "a"
    lat, per_byte = s.costs.p2p("a", "b")
    assert lat == 0.001 and per_byte == pytest.approx(1 / (0.5e9 / 8))
    assert s.costs.message("a") == (0.001, pytest.approx(1 / (1e9 / 8)))


@pytest.mark.parametrize("numel", [MB // 4, 16 * MB])
def test_a_closing_server_sends_the_replies_still_on_its_link(numel: int) -> None:
    """A reply waiting for its modelled departure when the server closes is sent, not dropped
    (the handler closes the server, then answers: the reply is queued on the link).  64 MB is more
    than loopback's socket buffers hold: a socket closed without linger cut it off (a CI failure
    of the 1-MB reply on a loaded machine, the same race)."""
    secret = b"k" * 32
    slow = ModelCosts(LinkModel(default_bandwidth_gbps=0.08, latency_s=0.05))
    server = MessageServer(secret, name="srv", shaping=shaping.Shaping(me="srv", costs=slow))

    def last(req: Any) -> Reply:
        server.close()
        return Reply({"bye": True}, [torch.ones(numel)])

    server.register("last", last)
    server.start()
    client = MessageClient(server.address, secret, sender="a")
    try:
        reply = client.call("last", {}, timeout_s=30)
        assert reply.body == {"bye": True} and reply.tensors[0].numel() == numel
    finally:
        client.close()
        server.close()
