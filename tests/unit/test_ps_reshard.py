"""A parameter-server job's shards cut into another number of shards (ps/reshard.py, issue 36
item 4): the same chunks, weights and momentum whatever the count; each shard at a clock
boundary (a lag-0 shard's last fold, another's pushes folded); one resume clock; refusals of an
incomplete set, another job's shard, another chunk size or another model, each naming it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.consistency import ASP, BSP
from flotilla.ps.reshard import ResumeError, check_keys, merge, reshard
from flotilla.ps.sharding import KeySpec
from flotilla.ps.snapshot import Snapshot, capture, restore, snapshot_path
from flotilla.ps.store import DeltaUpdate, ServerSGD, ShardConfig, ShardStore

pytestmark = pytest.mark.timeout(60)

# chunk_bytes 64 = 16 floats: "w" is 5 chunks, "b" one, "h" 3: shards get different mixes
KEYS = (
    KeySpec.of("w", (8, 10), "float32"),
    KeySpec.of("b", (6,), "float32"),
    KeySpec.of("h", (40,), "float32"),
)
WORKERS = 2
RULE = ServerSGD(lr=0.1, momentum=0.9, weight_decay=0.01)


def rules(num_shards: int, consistency=BSP(), workers: int = WORKERS) -> ShardConfig:
    return ShardConfig(
        shard_index=0,
        num_shards=num_shards,
        num_workers=workers,
        consistency=consistency,
        update=RULE,
        chunk_bytes=64,
    )


def full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k.name: torch.randn(k.num_elems, generator=g) for k in KEYS}


def chunks_of(store: ShardStore, values: dict[str, torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    layout = store.layout if store.layout is not None else store.make_layout(KEYS)
    out = []
    for c in layout.chunk_ids:
        ch = layout.plan.chunks[c]
        out.append(values[ch.key][ch.offset_elems : ch.offset_elems + ch.num_elems].clone())
    return list(layout.chunk_ids), out


def job(num_shards: int, pushes: list[tuple[int, int]], consistency=BSP()) -> list[ShardStore]:
    """``num_shards`` shards seeded alike, every (worker, clock) of ``pushes`` pushed to each."""
    stores = []
    for i in range(num_shards):
        store = ShardStore(replace(rules(num_shards, consistency), shard_index=i))
        ids, vals = chunks_of(store, full(0))
        assert store.seed(list(KEYS), ids, vals)
        for w in range(WORKERS):
            store.hello(w, 0, resync=False)
        for w, c in pushes:
            ids, grads = chunks_of(store, full(100 + 10 * c + w))
            store.push(w, c, 0, ids, grads)
        stores.append(store)
    return stores


def snaps(stores: list[ShardStore], where: str = "/old") -> list[Snapshot]:
    n = len(stores)
    return [
        replace(capture(s, incarnation=i + 1), source=str(snapshot_path(where, i, n)))
        for i, s in enumerate(stores)
    ]


def per_key(stores: list[ShardStore], kind: str) -> dict[str, torch.Tensor]:
    """Each key's flat tensor put together from the shards' chunks (weights or momentum)."""
    out = {k.name: torch.full((k.num_elems,), float("nan")) for k in KEYS}
    for s in stores:
        assert s.layout is not None
        for slot, c in enumerate(s.layout.chunk_ids):
            ch = s.layout.plan.chunks[c]
            t = s.weights[slot] if kind == "w" else s.momentum[slot]
            assert t is not None
            out[ch.key][ch.offset_elems : ch.offset_elems + ch.num_elems] = t
    return out


def restored(new: list[Snapshot], num_shards: int, workers: int = WORKERS) -> list[ShardStore]:
    out = []
    for i, snap in enumerate(new):
        store = ShardStore(replace(rules(num_shards, workers=workers), shard_index=i))
        restore(store, snap)
        out.append(store)
    return out


ROUNDS = [(w, c) for c in range(3) for w in range(WORKERS)]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2), (2, 2)])
def test_the_cut_holds_the_same_weights_and_momentum_as_the_old_shards(old: int, new: int) -> None:
    stores = job(old, ROUNDS)
    resumed = merge(snaps(stores), rules(new))
    assert resumed.resume_at == 3 and resumed.num_shards == old and resumed.behind == (0,) * old
    cut = restored(reshard(resumed, rules(new)), new)
    assert sorted(c for s in cut for c in s.layout.chunk_ids) == list(range(9))  # every chunk once
    for kind in ("w", "m"):
        want, got = per_key(stores, kind), per_key(cut, kind)
        assert all(torch.equal(want[k], got[k]) for k in want), kind
    reference = per_key(job(1, ROUNDS), "w")  # (chunk arithmetic does not depend on the count)
    assert all(torch.equal(reference[k], per_key(cut, "w")[k]) for k in reference)


def test_a_new_shard_starts_the_workers_at_the_resume_clock_and_trains_on_like_the_old_one() -> None:
    stores = job(2, ROUNDS)
    cut = restored(reshard(merge(snaps(stores), rules(3)), rules(3)), 3)
    for s in cut:
        assert s.version == 0 and s.table.entries == () and s.folded_clock == 3
        assert [s.hello(w, 0, resync=False) for w in range(WORKERS)] == [3, 3]  # (a fresh worker says 0)
    assert cut[0].clocks.views.views[0].start == 3  # shard 0's first data view starts there
    more = [(w, 3) for w in range(WORKERS)]
    for s in (*stores, *cut):  # one more clock on the old shards and on the cut
        for w, c in more:
            ids, grads = chunks_of(s, full(100 + 10 * c + w))
            s.push(w, c, 0, ids, grads)
    want, got = per_key(stores, "w"), per_key(cut, "w")
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_lag0_shard_gives_its_last_fold_and_a_shard_behind_is_counted() -> None:
    stores = job(2, [*ROUNDS, (0, 3)])  # worker 0 pushed clock 3 (logged, not folded) on both
    folded = per_key(job(2, ROUNDS), "w")
    resumed = merge(snaps(stores), rules(2))
    assert resumed.resume_at == 3 and resumed.behind == (0, 0)
    cut = restored(reshard(resumed, rules(2)), 2)
    assert all(torch.equal(folded[k], per_key(cut, "w")[k]) for k in folded)  # not worker 0's clock 3
    lagging = job(2, ROUNDS[:-2])  # folded clock 2 only
    mixed = merge(snaps([stores[0], lagging[1]]), rules(2))
    assert mixed.reach == (3, 2) and mixed.resume_at == 3 and mixed.behind == (0, WORKERS)


def test_an_asp_shard_folds_its_pending_gradients_into_momentum() -> None:
    pushes = [(0, 0), (1, 0), (0, 1)]  # clock 1 half pushed: pending sums and a momentum share
    stores = job(2, pushes, consistency=ASP())
    assert any(p is not None for s in stores for p in s.pending)
    expected = job(2, pushes, consistency=ASP())
    for s in expected:
        s._fold()  # what its next fold would have done
    resumed = merge(snaps(stores), rules(3, ASP()))
    assert resumed.resume_at == 2 and resumed.behind == (1, 1)  # worker 1 never reached clock 2
    cut = restored(reshard(resumed, rules(3, ASP())), 3)
    for kind in ("w", "m"):
        want, got = per_key(expected, kind), per_key(cut, kind)
        assert all(torch.equal(want[k], got[k]) for k in want), kind


def test_what_cannot_be_resumed_is_refused_naming_it() -> None:
    stores = job(3, ROUNDS)
    taken = snaps(stores, "/old")
    with pytest.raises(ResumeError, match=r"shard 1 is missing \(/old/ps-shard-1-of-3\.snap\)"):
        merge([taken[0], taken[2]], rules(2))
    with pytest.raises(ResumeError, match="given twice"):
        merge([taken[0], taken[0], taken[1], taken[2]], rules(2))
    other = snaps(job(2, ROUNDS), "/other")
    with pytest.raises(ResumeError, match=r"/other/ps-shard-1-of-2\.snap: num_shards 2 is not 3"):
        merge([*taken[:2], other[1]], rules(2))
    with pytest.raises(ResumeError, match="strategy.chunk_bytes: the snapshots were written with 64"):
        merge(taken, replace(rules(2), chunk_bytes=128))
    resumed = merge(taken, rules(2))
    check_keys(resumed, KEYS, "/old")  # the same model: fine
    with pytest.raises(ResumeError, match=r"parameter 'b' is float32\[7\] in this model, float32\[6\]"):
        check_keys(resumed, (KEYS[0], KeySpec.of("b", (7,), "float32"), KEYS[2]), "/old")
    with pytest.raises(ResumeError, match="the snapshots hold 'h', which this model lacks"):
        check_keys(resumed, KEYS[:2], "/old")
    with pytest.raises(ResumeError, match="no parameter-server snapshot"):
        merge([], rules(2))


def test_a_resumed_shards_clock_rule_is_pure_and_kept_in_its_snapshot(tmp_path: Path) -> None:
    from flotilla.ps import clock_rules

    state = ShardClocks(num_workers=2, resume_at=7)
    state, at = clock_rules.hello(state, 0, 0, resync=False)
    assert at == 7 and state.table.floor == 7
    state, at = clock_rules.hello(state, 1, 9, resync=False)  # (a worker naming a later clock keeps it)
    assert at == 9
    cut = reshard(merge(snaps(job(1, ROUNDS)), rules(1)), rules(1))[0]
    assert cut.meta["resume_at"] == 3


def test_another_data_order_or_clock_length_is_refused_and_the_jobs_key_order_is_kept() -> None:
    from flotilla.ps.consistency import WSP
    from flotilla.ps.wire import layout_digest

    def keyed(key: str) -> list[ShardStore]:
        stores = job(2, ROUNDS)
        for s in stores:
            s.config = replace(s.config, data_key=key)
        return stores

    taken = snaps(keyed("aaaa"))
    assert taken[0].meta["data_key"] == "aaaa" and taken[0].meta["wave_size"] == 1
    merge(taken, replace(rules(3), data_key="aaaa"))  # the same data: fine
    with pytest.raises(ResumeError, match="written by a job with other data"):
        merge(taken, replace(rules(3), data_key="bbbb"))
    wsp = replace(rules(3), consistency=WSP(s_local=3, clock_distance=0), update=DeltaUpdate())
    with pytest.raises(
        ResumeError, match=r"strategy.consistency: .* 1 step\(s\) per clock .* this job has 4"
    ):
        merge(taken, wsp)
    mixed = [taken[0], snaps(keyed("cccc"))[1]]
    with pytest.raises(ResumeError, match="its data_key is not"):
        merge(mixed, rules(3))
    reordered = (KEYS[2], KEYS[0], KEYS[1])  # (the job's model registers them in another order)
    resumed = merge(taken, rules(3))
    check_keys(resumed, reordered, "/old")
    cut = reshard(resumed, rules(3), reordered)
    assert {s.meta["layout_digest"] for s in cut} == {layout_digest(reordered, 3, 64)}
