"""Every group the all-reduce strategy is bound to gets fresh bucket buffers: an all-reduce
abandoned in a broken group can still complete later (a frozen peer wakes up and finishes its
part of the ring) and write into the buffers it was given, which then must not be the ones a
newer step reduces (``tests/multiproc/test_peer_watch.py`` saw two survivors diverge before)."""

from __future__ import annotations

import torch
from torch import nn

from flotilla.comm.collective import Group
from flotilla.sync.allreduce import BucketedAllReduce


def test_binding_a_new_group_gives_fresh_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    sync = BucketedAllReduce(model, bucket_bytes=64)
    store = torch.distributed.HashStore()
    sync.bind(Group(store, namespace="epoch/1", rank=0, world_size=1))
    first = [b.flat for b in sync._buckets]
    sync.bind(Group(store, namespace="epoch/2", rank=0, world_size=1))
    second = [b.flat for b in sync._buckets]
    assert len(first) == len(second) > 1
    for a, b in zip(first, second, strict=True):
        assert a.data_ptr() != b.data_ptr() and a.shape == b.shape and not b.any()
