"""``hetpipe``'s launcher side declaring a VW dead (``sync/hetpipe_host.HetPipeHost.lost``) on real
in-process shards: the VW's held ids are evicted, and the id of a return given up (its
``arrival``) is barred first, so a newcomer's hello still on its way when the launcher gave it
up is refused instead of joining a job nobody would evict it from -- where it would hold every
other VW's pulls back at the WSP gate for good."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flotilla.core.errors import RemoteError
from flotilla.ps.client import PSClient, keys_of
from flotilla.sync.hetpipe_host import HetPipeHost
from flotilla.sync.hetpipe_stage import worker_id_of
from flotilla.sync.stage_plug import HostContext

pytestmark = pytest.mark.timeout(60)
SECRET = b"s" * 32


@pytest.fixture
def host():
    torch.manual_seed(0)
    settings = SimpleNamespace(s_local=1, clock_distance=0, ps_shards=2)
    ctx = HostContext(model=nn.Linear(8, 4), secret=SECRET, host="127.0.0.1", num_instances=2)
    h = HetPipeHost(settings, ctx)
    clients: list[PSClient] = []

    def client(worker_id: int) -> PSClient:
        c = PSClient(h.addresses, SECRET, worker_id=worker_id, keys=keys_of(h.initial))
        clients.append(c)
        return c

    try:
        yield h, client
    finally:
        for c in clients:
            c.close()
        h.close()


def _held(h: HetPipeHost) -> list[list[int]]:
    return [s.workers_local() for s in h.servers]


def test_a_return_given_up_has_its_id_barred_so_a_late_hello_is_refused(host) -> None:
    h, client = host
    client(0).hello(0)
    client(1).hello(0)
    assert _held(h) == [[0, 1], [0, 1]]
    h.lost(1)  # (VW 1 lost: never came back, nothing to bar)
    assert _held(h) == [[0], [0]] and h.evicted == [1]
    late = worker_id_of(1, 1, 2)  # (its first return, given up before its stages said hello)
    h.lost(1, arrival=1)
    assert _held(h) == [[0], [0]]  # (nothing held: the bar is what stops it)
    with pytest.raises(RemoteError, match="has left this job"):
        client(late).hello(0)  # (the newcomer's hello, arriving after the launcher gave it up)
    assert _held(h) == [[0], [0]]
    again = worker_id_of(1, 2, 2)  # (tried again: a new arrival, a new id -- welcome)
    client(again).hello(0)
    assert _held(h) == [[0, again], [0, again]]


def test_a_return_whose_hello_came_first_is_evicted_as_a_held_id(host) -> None:
    h, client = host
    client(0).hello(0)
    client(1).hello(0)
    h.lost(1)
    came = worker_id_of(1, 1, 2)
    client(came).hello(0)  # (its stages said hello, then one died before the VW was in)
    assert _held(h) == [[0, came], [0, came]]
    h.lost(1, arrival=1)
    assert _held(h) == [[0], [0]] and h.evicted == [1, 1]
