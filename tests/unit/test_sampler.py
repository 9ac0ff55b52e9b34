"""Properties of the global-batch sampler: exactly-once per epoch under changing world sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.data.sampler import GlobalBatchSampler, epoch_permutation, shard_bounds

sizes = st.integers(min_value=1, max_value=300)


@settings(max_examples=60, deadline=None)
@given(
    num_samples=sizes,
    batch=st.integers(min_value=1, max_value=64),
    seed=st.integers(min_value=0, max_value=2**32),
    epoch=st.integers(min_value=0, max_value=5),
    data=st.data(),
)
def test_every_sample_exactly_once_per_epoch_with_changing_world(num_samples, batch, seed, epoch, data):
    sampler = GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch, seed=seed)
    first = epoch * sampler.steps_per_epoch
    used = []
    for step in range(first, first + sampler.steps_per_epoch):
        assert sampler.data_epoch(step) == epoch
        world = data.draw(st.integers(min_value=1, max_value=9), label=f"world@{step}")
        shards = [sampler.shard(step, r, world) for r in range(world)]
        np.testing.assert_array_equal(np.concatenate(shards), sampler.global_batch(step))
        sizes_ = [len(s) for s in shards]
        assert max(sizes_) - min(sizes_) <= 1
        assert sizes_ == sorted(sizes_, reverse=True)  # array_split: the extra samples go first
        used.extend(np.concatenate(shards).tolist())
    assert len(used) == num_samples
    assert sorted(used) == list(range(num_samples))
    assert sampler.data_epoch(first + sampler.steps_per_epoch) == epoch + 1


@settings(max_examples=40, deadline=None)
@given(num_samples=sizes, batch=st.integers(min_value=1, max_value=64))
def test_batch_sizes_and_steps_per_epoch(num_samples, batch):
    sampler = GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch)
    spe = sampler.steps_per_epoch
    assert spe == -(-num_samples // batch)
    lens = [len(sampler.global_batch(s)) for s in range(spe)]
    assert lens[:-1] == [batch] * (spe - 1)
    assert lens[-1] == num_samples - batch * (spe - 1)
    assert sampler.batch_len(spe - 1) == lens[-1]
    assert all(sampler.global_batch(s).dtype == np.int64 for s in range(spe))


@settings(max_examples=40, deadline=None)
@given(num_samples=sizes, batch=st.integers(min_value=1, max_value=64))
def test_drop_last_uses_only_full_batches(num_samples, batch):
    if batch > num_samples:
        with pytest.raises(ConfigError, match="global_batch_size"):
            GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch, drop_last=True)
        return
    sampler = GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch, drop_last=True)
    assert sampler.steps_per_epoch == num_samples // batch
    batches = [sampler.global_batch(s) for s in range(sampler.steps_per_epoch)]
    assert all(len(b) == batch for b in batches)
    used = np.concatenate(batches)
    assert len(np.unique(used)) == len(used) == batch * (num_samples // batch)


def test_deterministic_and_epochs_differ():
    a = GlobalBatchSampler(num_samples=1000, global_batch_size=100, seed=7)
    b = GlobalBatchSampler(num_samples=1000, global_batch_size=100, seed=7)
    np.testing.assert_array_equal(a.global_batch(3), b.global_batch(3))
    np.testing.assert_array_equal(a.shard(13, 2, 3), b.shard(13, 2, 3))
    epoch0 = np.concatenate([a.global_batch(s) for s in range(10)])
    epoch1 = np.concatenate([a.global_batch(s) for s in range(10, 20)])
    assert not np.array_equal(epoch0, epoch1)
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(1000))
    other_seed = GlobalBatchSampler(num_samples=1000, global_batch_size=100, seed=8)
    assert not np.array_equal(a.global_batch(0), other_seed.global_batch(0))


def test_returned_arrays_are_fresh_and_cache_is_read_only():
    s = GlobalBatchSampler(num_samples=50, global_batch_size=10, seed=1)
    batch = s.global_batch(0)
    expected = batch.copy()
    batch[:] = -1  # mutating a returned array must not affect later calls
    np.testing.assert_array_equal(s.global_batch(0), expected)
    perm = epoch_permutation(50, 1, 0)
    assert not perm.flags.writeable
    np.testing.assert_array_equal(perm[:10], expected)


def test_shard_may_be_empty_when_world_exceeds_batch():
    s = GlobalBatchSampler(num_samples=5, global_batch_size=3)
    shards = [s.shard(1, r, 4) for r in range(4)]  # last step holds 2 samples
    assert [len(x) for x in shards] == [1, 1, 0, 0]


def test_shard_bounds_matches_array_split():
    for n in range(0, 23):
        for w in range(1, 7):
            parts = np.array_split(np.arange(n), w)
            for r in range(w):
                lo, hi = shard_bounds(n, r, w)
                np.testing.assert_array_equal(np.arange(n)[lo:hi], parts[r])


@settings(max_examples=60, deadline=None)
@given(
    num_samples=sizes,
    batch=st.integers(min_value=1, max_value=64),
    min_shard=st.integers(min_value=1, max_value=4),
    data=st.data(),
)
def test_min_shard_keeps_every_sample_once_and_no_part_smaller(num_samples, batch, min_shard, data):
    # (a model with BatchNorm cannot train on one sample: its shards hold 2 at least)
    sampler = GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch, min_shard=min_shard)
    plain = GlobalBatchSampler(num_samples=num_samples, global_batch_size=batch)
    used = []
    for step in range(sampler.steps_per_epoch):
        world = data.draw(st.integers(min_value=1, max_value=9), label=f"world@{step}")
        shards = [sampler.shard(step, r, world) for r in range(world)]
        np.testing.assert_array_equal(np.concatenate(shards), sampler.global_batch(step))
        sizes_ = [len(x) for x in shards]
        n = sampler.batch_len(step)
        assert all(k == 0 or k >= min(min_shard, n) for k in sizes_), sizes_
        assert sizes_ == sorted(sizes_, reverse=True)
        busy = [k for k in sizes_ if k]
        assert max(busy) - min(busy) <= 1 and len(busy) == min(world, max(1, n // min_shard))
        if n >= min_shard * world:  # (a batch long enough: the plain split)
            assert sizes_ == [len(plain.shard(step, r, world)) for r in range(world)]
        used.extend(np.concatenate(shards).tolist())
    assert sorted(used) == list(range(num_samples))


def test_min_shard_splits_a_short_batch_over_the_first_ranks():
    assert [shard_bounds(5, r, 4, min_part=2) for r in range(4)] == [(0, 3), (3, 5), (5, 5), (5, 5)]
    assert [shard_bounds(1, r, 3, min_part=2) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    assert [shard_bounds(8, r, 4, min_part=2) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="min_part must be >= 1"):
        shard_bounds(4, 0, 2, min_part=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_samples": 0, "global_batch_size": 1}, "num_samples"),
        ({"num_samples": 10, "global_batch_size": 0}, "global_batch_size"),
        ({"num_samples": 10, "global_batch_size": 2, "seed": -1}, "seed"),
        ({"num_samples": 10.0, "global_batch_size": 2}, "num_samples"),
        ({"num_samples": 10, "global_batch_size": 2, "drop_last": 1}, "drop_last"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        GlobalBatchSampler(**kwargs)


def test_invalid_step_rank_world():
    s = GlobalBatchSampler(num_samples=10, global_batch_size=4)
    with pytest.raises(ValueError, match="step"):
        s.global_batch(-1)
    with pytest.raises(ValueError, match="rank"):
        s.shard(0, 3, 3)
    with pytest.raises(ValueError, match="world_size"):
        s.shard(0, 0, 0)
