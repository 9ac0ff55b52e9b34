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
