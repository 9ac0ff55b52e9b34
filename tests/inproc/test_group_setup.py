"""A member that dies after announcing itself, while the backend's own rendezvous (gloo's
full-mesh connect, which cannot be interrupted) waits for it: the survivor gives up as soon as
the member is known dead (``cancelled``), not after the rendezvous timeout, and the abandoned
construction is cleaned up on its own thread (``wait_disposed``)."""

from __future__ import annotations

import threading
import time

import pytest

from flotilla.comm.collective import Group, wait_disposed
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.errors import CollectiveError


def test_a_member_dead_after_arriving_is_given_up_on_at_once() -> None:
    host = StoreHost("127.0.0.1")
    store = connect_store(host.address)
    try:
        store.set("g//arrive/1", b"1")  # member 1 announced itself, then died before gloo's connect
        dead = threading.Event()
        threading.Timer(0.3, dead.set).start()  # ... and its death is learned 0.3 s later
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="cancelled"):
            Group(store, namespace="g/", rank=0, world_size=2, timeout_s=5.0, cancelled=dead.is_set)
        waited = time.monotonic() - t0
        print(f"\ngave up {waited:.3f} s after the start (death learned at 0.3 s; rendezvous timeout 5 s)")
        assert waited < 2.5  # far below the 5 s the uninterruptible rendezvous would have waited
        assert wait_disposed(30.0)  # the abandoned construction failed and was reaped
    finally:
        host.close()


def test_the_abandoned_construction_does_not_hold_the_store_connection() -> None:
    """Chaos run of this session: a view's group given up on (a member died while it formed)
    left gloo's rendezvous blocked in a ``get`` on the worker's one store connection, and the next
    view's group waited behind it for the store's 30 s timeout.  The construction has a
    connection of its own now (``comm.store.private_connection``): the shared one answers at
    once, while the abandoned rendezvous still waits."""
    host = StoreHost("127.0.0.1")
    store = connect_store(host.address, secret=b"s" * 32)  # (an AuthStore: the workers' kind)
    try:
        store.set("g//arrive/1", b"1")  # member 1 arrived, then died before gloo's connect
        dead = threading.Event()
        threading.Timer(0.3, dead.set).start()
        with pytest.raises(CollectiveError, match="cancelled"):
            Group(store, namespace="g/", rank=0, world_size=2, timeout_s=8.0, cancelled=dead.is_set)
        t0 = time.monotonic()
        store.set("next-view/arrive/0", b"1")
        assert store.get("next-view/arrive/0") == b"1"
        answered = time.monotonic() - t0
        still_waiting = any(t.name == "group-setup" and t.is_alive() for t in threading.enumerate())
        print(
            f"\nthe store answered in {answered:.3f} s; abandoned rendezvous still waiting: {still_waiting}"
        )
        assert still_waiting, "the store answered only once the abandoned rendezvous had given up"
        assert answered < 4.0  # (the abandoned get holds a shared connection for 8 s)
        assert wait_disposed(60.0)
    finally:
        host.close()


def test_without_a_death_the_group_forms_as_before() -> None:
    host = StoreHost("127.0.0.1")
    stores = [connect_store(host.address) for _ in range(2)]
    groups: dict[int, Group] = {}

    def build(rank: int) -> None:
        groups[rank] = Group(stores[rank], namespace="h/", rank=rank, world_size=2, cancelled=lambda: False)

    try:
        threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(groups) == [0, 1]
        import torch

        out: dict[int, float] = {}

        def reduce(rank: int) -> None:
            t = torch.tensor([float(rank + 1)])
            groups[rank].allreduce(t)
            out[rank] = float(t.item())

        threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out == {0: 3.0, 1: 3.0}
    finally:
        for g in groups.values():
            g.close()
        assert wait_disposed(30.0)
        host.close()
