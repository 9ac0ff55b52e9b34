"""Properties and goldens of the pure PS key -> shard plan (flotilla.ps.sharding)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.ps.sharding import DTYPE_ITEMSIZE, Chunk, KeySpec, plan_shards, split_key

MIB = 1024 * 1024


@st.composite
def key_lists(draw: st.DrawFn) -> list[KeySpec]:
    names = draw(st.lists(st.text("abcdefgh.", min_size=1, max_size=6), unique=True, max_size=12))
    keys = []
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 30), max_size=2)))
        dtype = draw(st.sampled_from(["float32", "float16", "float64", "int8", "torch.bfloat16"]))
        keys.append(KeySpec.of(name, shape, dtype))
    return keys


plans = st.tuples(key_lists(), st.integers(1, 8), st.integers(16, 3000))


@settings(deadline=None, max_examples=100)
@given(plans)
def test_every_element_covered_exactly_once(args: tuple[list[KeySpec], int, int]) -> None:
    keys, num_shards, chunk_bytes = args
    plan = plan_shards(keys, num_shards, chunk_bytes=chunk_bytes)
    for k in keys:
        chunks = plan.chunks_of_key(k.name)
        assert [c.chunk_idx for c in chunks] == list(range(len(chunks)))
        offset = 0
        for c in chunks:
            assert c.offset_elems == offset
            assert c.num_bytes == c.num_elems * k.itemsize
            offset += c.num_elems
        assert offset == k.num_elems
        # the fewest chunks that respect chunk_bytes
        per_chunk = chunk_bytes // k.itemsize
        assert len(chunks) == max(1, math.ceil(k.num_elems / per_chunk))
    by_shard = [plan.chunks_of_shard(s) for s in range(num_shards)]
    all_ids = [c.chunk_id for shard in by_shard for c in shard]
    assert sorted(all_ids) == sorted(c.chunk_id for c in plan.chunks)
    assert len(all_ids) == len(set(all_ids))
    for s, shard in enumerate(by_shard):
        assert all(plan.shard_of(c) == s == plan.shard_of(c.chunk_id) for c in shard)


@settings(deadline=None, max_examples=100)
@given(plans)
def test_chunk_size_and_greedy_balance_bound(args: tuple[list[KeySpec], int, int]) -> None:
    keys, num_shards, chunk_bytes = args
    plan = plan_shards(keys, num_shards, chunk_bytes=chunk_bytes)
    assert all(c.num_bytes <= chunk_bytes for c in plan.chunks)
    loads = plan.bytes_per_shard()
    total = sum(k.num_bytes for k in keys)
    assert sum(loads) == total
    largest = max((c.num_bytes for c in plan.chunks), default=0)
    # max <= mean + largest chunk, in exact integer arithmetic
    assert max(loads) * num_shards <= total + num_shards * largest


@settings(deadline=None, max_examples=60)
@given(plans, st.randoms(use_true_random=False))
def test_deterministic_and_independent_of_key_order(
    args: tuple[list[KeySpec], int, int], rnd: random.Random
) -> None:
    keys, num_shards, chunk_bytes = args
    plan = plan_shards(keys, num_shards, chunk_bytes=chunk_bytes)
    again = plan_shards(list(keys), num_shards, chunk_bytes=chunk_bytes)
    assert plan == again
    shuffled = list(keys)
    rnd.shuffle(shuffled)
    other = plan_shards(shuffled, num_shards, chunk_bytes=chunk_bytes)
    assert {c.chunk_id: plan.shard_of(c) for c in plan.chunks} == {
        c.chunk_id: other.shard_of(c) for c in other.chunks
    }
    assert plan.bytes_per_shard() == other.bytes_per_shard()


def test_golden_plan() -> None:
    keys = [
        KeySpec.of("w1", (2560, 1024), "float32"),  # 10 MiB -> 3 chunks
        KeySpec.of("b1", (1024,), "float32"),  # 4 KiB
        KeySpec.of("w2", (1024, 256), "float32"),  # 1 MiB
    ]
    plan = plan_shards(keys, 2, chunk_bytes=4 * MIB)
    w1 = plan.chunks_of_key("w1")
    assert [c.num_elems for c in w1] == [873814, 873813, 873813]
    assert [c.offset_elems for c in w1] == [0, 873814, 1747627]
    # LPT: w1#0 (3495256 B) -> 0, w1#1 (3495252 B) -> 1, w1#2 -> the lighter shard 1,
    # then w2 (1 MiB) and b1 -> shard 0.
    assert [plan.shard_of(("w1", i)) for i in range(3)] == [0, 1, 1]
    assert plan.shard_of(("w2", 0)) == 0
    assert plan.shard_of(("b1", 0)) == 0
    assert plan.bytes_per_shard() == (873814 * 4 + MIB + 4096, 873813 * 8)
    assert plan.index_of(("b1", 0)) == 3


def test_tie_broken_by_shard_index_and_names() -> None:
    keys = [KeySpec.of(n, (4,), "float32") for n in ("c", "a", "b")]
    plan = plan_shards(keys, 2, chunk_bytes=1024)
    # equal sizes: ordered a, b, c; a -> 0, b -> 1, c -> 0
    assert [plan.shard_of((n, 0)) for n in "abc"] == [0, 1, 0]


def test_empty_and_scalar_keys() -> None:
    keys = [KeySpec.of("empty", (0, 3), "float32"), KeySpec.of("scalar", (), "float64")]
    plan = plan_shards(keys, 3, chunk_bytes=8)
    assert plan.chunks_of_key("empty") == (
        Chunk(key="empty", chunk_idx=0, offset_elems=0, num_elems=0, num_bytes=0),
    )
    assert plan.chunks_of_key("scalar")[0].num_bytes == 8
    assert plan_shards([], 4).bytes_per_shard() == (0, 0, 0, 0)


def test_split_key_sizes_differ_by_at_most_one() -> None:
    chunks = split_key(KeySpec.of("x", (10,), "int8"), 3)
    assert [c.num_elems for c in chunks] == [3, 3, 2, 2]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: plan_shards([], 0), "num_shards"),
        (lambda: plan_shards([], True), "num_shards"),
        (lambda: plan_shards([], 2, chunk_bytes=0), "chunk_bytes"),
        (lambda: plan_shards([KeySpec.of("x", (4,), "float64")], 2, chunk_bytes=4), "chunk_bytes"),
        (lambda: plan_shards([KeySpec.of("x", (1,), "int8")] * 2, 1), "unique"),
        (lambda: KeySpec(name="x", shape=(2,), dtype="float32", num_bytes=7), "num_bytes"),
        (lambda: KeySpec(name="x", shape=(2,), dtype="float13", num_bytes=8), "dtype"),
        (lambda: KeySpec.of("x", (2,), "float13"), "dtype"),
        (lambda: KeySpec.of("x", (-1,), "int8"), "shape"),
        (lambda: KeySpec.of("", (1,), "int8"), "name"),
    ],
)
def test_invalid_args_raise_value_error_naming_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        call()
    assert isinstance(info.value, ConfigError)


def test_unknown_lookups() -> None:
    plan = plan_shards([KeySpec.of("x", (4,), "float32")], 2)
    with pytest.raises(KeyError):
        plan.shard_of(("y", 0))
    with pytest.raises(KeyError):
        plan.chunks_of_key("y")
    with pytest.raises(ValueError, match="shard"):
        plan.chunks_of_shard(2)
    assert "float32" in DTYPE_ITEMSIZE
