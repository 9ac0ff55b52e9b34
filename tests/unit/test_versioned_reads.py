"""Versioned reads and ordered clocks under BSP (``ps/versioned_reads.py``, issue 37): a pull
serves exactly the weights after the last completed clock whatever arrived since, and a clock's
pushes are summed in worker order whatever order they arrived in -- also across a snapshot."""

from __future__ import annotations

import itertools

import pytest
import torch

from flotilla.ps.consistency import BSP, SSP, WSP
from flotilla.ps.sharding import KeySpec
from flotilla.ps.snapshot import SnapshotError, capture, decode_snapshot, encode_snapshot, restore
from flotilla.ps.store import DeltaUpdate, ServerSGD, ShardConfig, ShardStore

KEYS = [KeySpec.of("w", (5, 8), "float32"), KeySpec.of("b", (7,), "float32")]
RULE = ServerSGD(lr=0.1, momentum=0.9, weight_decay=0.01)


def make(consistency=BSP(), update=RULE, workers: int = 3) -> ShardStore:
    store = ShardStore(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            num_workers=workers,
            consistency=consistency,
            update=update,
            chunk_bytes=64,
        )
    )
    layout = store.make_layout(KEYS)
    ids = list(layout.chunk_ids)
    gen = torch.Generator().manual_seed(1)
    vals = [torch.randn(layout.plan.chunks[c].num_elems, generator=gen) for c in ids]
    assert store.seed(list(KEYS), ids, vals)
    for w in range(workers):
        store.hello(w, 0, resync=False)
    return store


def grads(store: ShardStore, worker: int, clock: int) -> list[torch.Tensor]:
    """A worker's gradient for a clock: random floats, so summation order shows in the bits."""
    gen = torch.Generator().manual_seed(1000 * clock + worker)
    layout = store.layout
    return [torch.randn(layout.plan.chunks[c].num_elems, generator=gen) * 10 for c in layout.chunk_ids]


def push(store: ShardStore, worker: int, clock: int) -> None:
    ids = list(store.layout.chunk_ids)
    assert store.push(worker, clock, store.version, ids, grads(store, worker, clock)).applied


def run(store: ShardStore, orders: list[tuple[int, ...]]) -> ShardStore:
    for clock, order in enumerate(orders):
        for w in order:
            push(store, w, clock)
    return store


def test_a_bsp_read_serves_the_last_completed_clock_whatever_arrived_since() -> None:
    store = make()
    ids = list(store.layout.chunk_ids)
    run(store, [(0, 1, 2)])  # clock 0 complete: the fold
    after_clock0 = [t.clone() for t in store.weights]
    version, c_global = store.version, store.table.c_global
    push(store, 2, 1)  # a fast worker's clock 1 arrives before the others' pulls for clock 1
    assert not all(torch.equal(a, b) for a, b in zip(store.weights, after_clock0))  # applied here
    tensors, versions = store.read(ids)
    assert all(torch.equal(a, b) for a, b in zip(tensors, after_clock0))
    assert store.read_clock() == (version, c_global) == (3, 1) and versions == [3] * len(ids)
    push(store, 0, 1)
    push(store, 1, 1)  # clock 1 complete: reads move on to it
    tensors, _ = store.read(ids)
    assert all(torch.equal(a, b) for a, b in zip(tensors, store.weights))
    assert store.read_clock() == (6, 2)


@pytest.mark.parametrize("consistency", [SSP(staleness=1), SSP(staleness=2)])
def test_models_with_staleness_read_every_push_applied_so_far(consistency) -> None:
    store = make(consistency)
    run(store, [(0, 1, 2)])
    push(store, 2, 1)
    tensors, _ = store.read(list(store.layout.chunk_ids))
    assert all(a is b for a, b in zip(tensors, store.weights))
    assert store.read_clock() == (4, 1)


@pytest.mark.parametrize(
    ("consistency", "update"),
    [
        (BSP(), RULE),
        (BSP(), ServerSGD(lr=0.05)),
        (SSP(staleness=0), RULE),
        (WSP(s_local=0, clock_distance=0), DeltaUpdate()),
    ],
)
def test_a_clocks_pushes_are_summed_in_worker_order_whatever_order_they_arrive(consistency, update) -> None:
    reference = run(make(consistency, update), [(0, 1, 2)] * 4).digest()
    digests = set()
    for perm in itertools.permutations(range(3)):
        orders = [perm, perm[::-1], perm, (0, 1, 2)]
        digests.add(run(make(consistency, update), orders).digest())
    assert digests == {reference}


def test_without_the_reordering_arrival_order_changes_the_bits(monkeypatch) -> None:
    """The mutation the test above must catch: apply pushes in arrival order only."""
    monkeypatch.setattr(ShardStore, "_log_push", lambda *a: None)
    digests = {run(make(), [p] * 3).digest() for p in itertools.permutations(range(3))}
    assert len(digests) > 1


def test_a_snapshot_taken_mid_clock_restores_the_fold_state_and_the_log() -> None:
    store = run(make(), [(2, 0, 1)])
    push(store, 2, 1)  # out of order within clock 1 ...
    push(store, 0, 1)
    snap = decode_snapshot(encode_snapshot(capture(store, incarnation=5)), "mem")
    fresh = ShardStore(store.config)
    assert restore(fresh, snap) == 5
    assert fresh.digest() == store.digest() and fresh.read_clock() == store.read_clock()
    ids = list(store.layout.chunk_ids)
    assert all(torch.equal(a, b) for a, b in zip(fresh.read(ids)[0], store.read(ids)[0]))
    for s in (store, fresh):
        push(s, 1, 1)  # ... completed on both: the same ordered sum
        run_clock = [(1, 0, 2)]
        for w in run_clock[0]:
            push(s, w, 2)
    assert fresh.digest() == store.digest() == run(make(), [(0, 1, 2)] * 3).digest()


def test_a_malformed_fold_state_is_refused_and_changes_nothing() -> None:
    store = run(make(), [(0, 1, 2)])
    push(store, 1, 1)
    snap = capture(store, incarnation=5)
    fresh = make()
    before = fresh.digest()
    for bad in (
        {**snap.meta["fold_state"], "log": [[1, 1, [99]]]},  # a slot this shard does not hold
        {**snap.meta["fold_state"], "log": [[1, 1, [0, 1]], [1, 2, [0]]]},  # no tensors logged
        {**snap.meta["fold_state"], "versions": [1]},
        "nonsense",
    ):
        forged = type(snap)(meta={**snap.meta, "fold_state": bad}, tensors=snap.tensors)
        with pytest.raises(SnapshotError, match="fold_state"):
            restore(fresh, decode_snapshot(encode_snapshot(forged), "forged"))
        assert fresh.digest() == before
