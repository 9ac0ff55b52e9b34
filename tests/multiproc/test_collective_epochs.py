"""Collective plane: per-epoch gloo groups built, torn down and rebuilt in-process (real processes)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from flotilla.comm.collective import EpochGroup, wait_disposed
from flotilla.comm.group_factory import GroupFactory
from flotilla.comm.store import StoreAddress, StoreHost, connect_store

pytestmark = pytest.mark.timeout(120)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    """Native threads too (gloo's are invisible to ``threading``)."""
    return len(os.listdir("/proc/self/task"))


def _worker(worker_id: int, address: tuple[str, int], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store(StoreAddress(*address))
    base_threads, base_fds = _threads(), _fds()
    results = {}
    # epoch 1: workers 0, 1, 2;  epoch 2: workers 0 and 2 (worker 1 gone)
    for epoch, members in ((1, (0, 1, 2)), (2, (0, 2))):
        if worker_id not in members:
            break
        g = EpochGroup(
            store, epoch=epoch, rank=members.index(worker_id), world_size=len(members), timeout_s=20
        )
        t = torch.full((5,), float(worker_id + 1))
        g.allreduce(t)
        mx = torch.tensor([float(worker_id)])
        g.allreduce(mx, op="max")
        results[epoch] = (t.tolist(), mx.item())
        g.close()
    assert wait_disposed(60.0)  # (backends are destroyed on threads of their own)
    # a destroyed backend's native threads finish exiting on their own, a moment later on a
    # loaded machine: wait (bounded) for the counts to come back rather than sample them once
    deadline = time.monotonic() + 30.0
    leaked = (_threads() - base_threads, _fds() - base_fds)
    while leaked != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = (_threads() - base_threads, _fds() - base_fds)
    out.put((worker_id, results, leaked))


def test_epoch_groups_rebuild_in_process_without_leaks() -> None:
    host = StoreHost("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(w, (host.address.host, host.address.port), out)) for w in range(3)
    ]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            wid, results, leaked = out.get(timeout=90)
            got[wid] = (results, leaked)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        host.close()
    for wid in (0, 1, 2):
        assert got[wid][0][1] == ([6.0] * 5, 2.0), f"epoch 1 all-reduce wrong on {wid}"
    for wid in (0, 2):
        assert got[wid][0][2] == ([4.0] * 5, 2.0), f"epoch 2 all-reduce wrong on {wid}"
    assert 2 not in got[1][0]
    for wid in (0, 1, 2):
        assert got[wid][1] == (0, 0), f"worker {wid} leaked (threads, fds) {got[wid][1]}"


def test_collective_times_out_with_a_clear_error() -> None:
    from flotilla.core.errors import CollectiveError

    host = StoreHost("127.0.0.1")
    try:
        store = connect_store(host.address)
        with pytest.raises(CollectiveError, match="rendezvous|timed out|Timeout|timeout"):
            EpochGroup(
                store, epoch=7, rank=0, world_size=2, timeout_s=1.0, rendezvous_timeout_s=1.0
            )  # rank 1 never comes
    finally:
        host.close()


def _pairs_worker(worker_id: int, address: tuple[str, int], out: mp.Queue) -> None:
    """Groups by namespace: overlapping pair groups coexist; a cached group is reused; a member
    blocked on a peer whose group failed is released at once (the peer's close cascades)."""
    torch.set_num_threads(1)
    store = connect_store(StoreAddress(*address))
    factory = GroupFactory(store, timeout_s=20)
    setup = []
    for pair in ((0, 1), (1, 2), (0, 2), (0, 1)):  # the last one is cached
        if worker_id in pair:
            ns = f"pairs/{pair[0]}-{pair[1]}"
            g = factory.get(ns, pair, worker_id)
            setup.append(g.setup_s)
            t = torch.tensor([float(worker_id + 1)])
            g.allreduce(t)
            assert t.item() == float(pair[0] + pair[1] + 2), (pair, t)
    factory.close()
    out.put((worker_id, setup))


def test_groups_by_namespace_coexist_and_are_cached() -> None:
    host = StoreHost("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_pairs_worker, args=(w, (host.address.host, host.address.port), out))
        for w in range(3)
    ]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=90) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        host.close()
    # workers 0 and 1 meet twice in pair (0, 1): the second time the cached group is reused
    assert len(got[0]) == len(got[1]) == 3 and len(got[2]) == 2, got
    assert got[0][2] == got[0][0] and got[1][2] == got[1][0]
    built = [s for setups in got.values() for s in setups[:2]]
    print(f"\npair group set-up (rendezvous included), s: {[round(s, 4) for s in built]}")


def _abort_worker(worker_id: int, address: tuple[str, int], out: mp.Queue) -> None:
    import time as _time

    from flotilla.core.errors import CollectiveError

    torch.set_num_threads(1)
    store = connect_store(StoreAddress(*address))
    g = EpochGroup(store, epoch=1, rank=worker_id, world_size=3, timeout_s=30)
    g.allreduce(torch.ones(4))
    if worker_id == 2:  # dies without taking part
        os._exit(0)
    t0 = _time.monotonic()
    try:
        g.allreduce(torch.ones(100_000))
        out.put((worker_id, -1.0))
    except CollectiveError:
        out.put((worker_id, _time.monotonic() - t0))


def test_a_dead_member_releases_every_survivor_quickly() -> None:
    """Rank 2 exits; ranks 0 and 1 are inside an all-reduce (30 s timeout).  The ones next to it
    fail at once and release their group, so the other one fails too: nobody waits 30 s."""
    host = StoreHost("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_abort_worker, args=(w, (host.address.host, host.address.port), out))
        for w in range(3)
    ]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=90) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        host.close()
    print(f"\nsurvivors released after (s): {got[0]:.3f}, {got[1]:.3f}")
    assert 0 <= got[0] < 10 and 0 <= got[1] < 10, got
