"""Per-step groups (``comm/group_factory.py``) when a failure is seen (a broken epoch, from the
coordinator or the peer watch): a group being set up for a member that never arrives is given up
on at once (``breaks`` changed), and only groups with a collective in flight are aborted
(``abort_busy``): an idle one stays usable, since its peers hold theirs under the same name."""

from __future__ import annotations

import threading

import pytest
import torch

from flotilla.comm.collective import wait_disposed
from flotilla.comm.group_factory import GroupFactory
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.errors import CollectiveError

pytestmark = pytest.mark.timeout(120)


def test_a_set_up_waiting_for_a_dead_member_gives_up_when_a_failure_is_seen() -> None:
    host = StoreHost("127.0.0.1")
    try:
        breaks = [0]
        factory = GroupFactory(connect_store(host.address), timeout_s=600.0, breaks=lambda: breaks[0])
        threading.Timer(0.3, lambda: breaks.__setitem__(0, 1)).start()  # a death is learned
        with pytest.raises(CollectiveError, match="cancelled"):  # (not the 600 s timeout)
            factory.get("pr/0-1/0", [0, 1], 0)  # member 1 never arrives
        assert wait_disposed(30.0)
    finally:
        host.close()


def test_abort_busy_aborts_only_a_group_inside_a_collective() -> None:
    host = StoreHost("127.0.0.1")
    factories = [GroupFactory(connect_store(host.address), timeout_s=60.0) for _ in range(2)]
    groups: dict[int, object] = {}

    def build(rank: int) -> None:
        groups[rank] = factories[rank].get("pr/0-1/0", [0, 1], rank)

    try:
        threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        g0, g1 = factories[0].get("pr/0-1/0", [0, 1], 0), factories[1].get("pr/0-1/0", [0, 1], 1)
        handle = g0.allreduce_async(torch.ones(4))  # member 0 waits in it; member 1 is idle
        for f in factories:
            f.abort_busy("epoch 1 is broken")
        assert g0.aborted and not g1.aborted
        with pytest.raises(CollectiveError, match="broken"):
            handle.wait()
    finally:
        for f in factories:
            f.close()
        host.close()
