"""The rendezvous store under attack, in one process: junk planted by a plain ``TCPStore`` client
(no secret) under the keys gloo's rendezvous reads.  Without the secret-signed view the junk
reaches gloo's parser (``ValueError: basic_string::_M_create``), which must surface as a failed
rendezvous (``CollectiveError``), never escape; with it (``connect_store(..., secret=...)``) the
junk is ignored, counted, and the group forms and computes correctly."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import torch
import torch.distributed as dist

from flotilla.comm.collective import Group
from flotilla.comm.rejections import REJECTIONS
from flotilla.comm.store import StoreHost, connect_store
from flotilla.comm.store_auth import AuthStore, seal, unseal
from flotilla.core.errors import CollectiveError

pytestmark = pytest.mark.timeout(120)

SECRET = b"s" * 32
JUNK = b"\xff" * 64


def _outsider(host: StoreHost) -> dist.TCPStore:
    return dist.TCPStore(host.address.host, host.address.port, is_master=False, use_libuv=True,
                         timeout=dt.timedelta(seconds=5))  # fmt: skip


def _form(host: StoreHost, world: int, secret: bytes | None, timeout_s: float) -> list[object]:
    """Each rank's result: the allreduced tensor, or the exception its Group raised."""
    out: list[object] = [None] * world

    def run(rank: int) -> None:
        try:
            g = Group(connect_store(host.address, timeout_s, secret=secret), namespace="epoch/7/",
                      rank=rank, world_size=world, timeout_s=timeout_s, cancelled=lambda: False)  # fmt: skip
            t = torch.full((3,), float(rank + 1))
            g.allreduce(t)
            out[rank] = t
            g.close()
        except BaseException as exc:  # (recorded: the test asserts which)
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_junk_without_the_secret_is_a_failed_rendezvous_never_an_escaping_error() -> None:
    host = StoreHost()
    try:
        _outsider(host).set("epoch/7//0/0", JUNK)  # what rank 1 reads of rank 0
        with pytest.raises(CollectiveError, match="rendezvous failed"):  # (was: ValueError escaped)
            Group(connect_store(host.address, 2.0), namespace="epoch/7/", rank=1, world_size=2, timeout_s=2.0)
    finally:
        host.close()


def test_signed_store_ignores_planted_junk_and_the_group_forms() -> None:
    host = StoreHost()
    try:
        evil = _outsider(host)
        for r in range(3):
            evil.set(f"epoch/7//0/{r}", JUNK)
            evil.set(f"epoch/7//arrive/{r}", JUNK)
        out = _form(host, 3, SECRET, 20.0)
    finally:
        host.close()
    for o in out:
        assert isinstance(o, torch.Tensor), out
        assert torch.equal(o, torch.full((3,), 6.0))


def test_a_signed_value_cannot_be_moved_altered_or_forged() -> None:
    sealed = seal(SECRET, "epoch/1//0/0", b"addr")
    assert unseal(SECRET, "epoch/1//0/0", sealed) == b"addr"
    assert unseal(SECRET, "epoch/2//0/0", sealed) is None  # another epoch's key
    assert unseal(SECRET, "epoch/1//0/0", sealed[:-1] + b"x") is None  # altered
    assert unseal(b"o" * 32, "epoch/1//0/0", sealed) is None  # another secret
    assert unseal(SECRET, "epoch/1//0/0", b"FLS1" + b"\0" * 32 + b"addr") is None  # forged tag
    assert unseal(SECRET, "epoch/1//0/0", b"") is None


def test_get_waits_for_the_rightful_writer_then_gives_up() -> None:
    host = StoreHost()
    try:
        evil = _outsider(host)
        store = AuthStore(connect_store(host.address, 5.0), SECRET, timeout_s=0.3)
        evil.set("k", JUNK)
        before = REJECTIONS.counts().get("store_auth", {}).get("store", 0)
        with pytest.raises(CollectiveError, match="no authentic value"):
            store.get("k")
        assert not store.check(["k"])
        assert REJECTIONS.counts()["store_auth"]["store"] > before  # counted (and logged)
        writer = AuthStore(connect_store(host.address, 5.0), SECRET)
        writer.set("k", b"v")
        assert store.check(["k"]) and store.get("k") == b"v"
    finally:
        host.close()
