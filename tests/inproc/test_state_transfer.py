"""``comm/state_transfer.broadcast_state``: the tensors of a state travel packed in buckets of one
dtype (a handful of broadcasts, not one per tensor) and arrive equal, in order, with their
shapes and dtypes; the bucketing is the same on both sides."""

from __future__ import annotations

import threading

import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.state_transfer import broadcast_state, buckets
from flotilla.comm.store import StoreHost, connect_store


def test_buckets_are_consecutive_tensors_of_one_dtype_up_to_the_limit() -> None:
    f, i = torch.float32, torch.int64
    sizes = [(f, 10), (f, 10), (i, 3), (f, 100), (f, 1), (f, 1)]
    assert buckets(sizes, limit=100, alone=1000) == [[0, 1], [2], [3], [4, 5]]  # (400 > limit)
    assert buckets(sizes, limit=1 << 20, alone=1000) == [[0, 1], [2], [3, 4, 5]]
    # (a tensor of ``alone`` bytes or more travels alone, and the small ones after it start anew)
    assert buckets(sizes, limit=1 << 20, alone=400) == [[0, 1], [2], [3], [4, 5]]
    assert buckets([]) == []


def test_a_state_of_mixed_tensors_arrives_equal_in_a_few_broadcasts(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    state = [
        torch.randn(3, 4, generator=g),
        torch.randn(7, generator=g),
        torch.arange(5, dtype=torch.int64),
        torch.tensor(2.5),  # (0-dim)
        torch.empty(0, 3),  # (no elements)
        torch.randn(2, 2, generator=g).half(),
        torch.tensor([True, False, True]),
        torch.randn(4, 4, generator=g).t(),  # (not contiguous)
    ]
    host = StoreHost()
    got: dict[int, tuple[dict, list[torch.Tensor]]] = {}
    launches: list[tuple[int, int]] = []  # (rank, tensors in one broadcast call)
    real = EpochGroup.broadcast

    def counting(self, tensors, src):
        launches.append((self.rank, len(tensors)))
        return real(self, tensors, src)

    monkeypatch.setattr(EpochGroup, "broadcast", counting)

    def member(rank: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=rank, world_size=2)
        try:
            if rank == 0:
                got[0] = broadcast_state(group, 0, {"step": 7}, state)
            else:
                got[1] = broadcast_state(group, 0, None, None)
        finally:
            group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    host.close()
    meta, out = got[1]
    assert meta == {"step": 7} and len(out) == len(state)
    for a, b in zip(state, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # (the header's length, the header, then the buckets -- float32 x2, int64, float32 x2 (the
    # 0-dim and the empty one with them), float16, bool, float32 -- in one call, a launch each)
    for rank in (0, 1):
        assert [n for r, n in launches if r == rank] == [1, 1, 6]
