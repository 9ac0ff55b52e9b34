"""PS shard snapshots (ps/snapshot.py): a safetensors file with a JSON manifest; round trip,
atomic mode-0600 writes, and one-line refusals of truncated, corrupt, old-format and foreign files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from flotilla.ps.consistency import BSP
from flotilla.ps.sharding import KeySpec
from flotilla.ps.snapshot import (
    FORMAT,
    Snapshot,
    SnapshotError,
    capture,
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    restore,
    snapshot_path,
    write_snapshot,
)
from flotilla.ps.store import DeltaUpdate, ServerSGD, ShardConfig, ShardStore

pytestmark = pytest.mark.timeout(30)
KEYS = (KeySpec.of("w", (40,), "float32"), KeySpec.of("b", (6,), "float32"))


def config(num_workers: int = 2, chunk_bytes: int = 64, num_shards: int = 1, update=DeltaUpdate()):
    return ShardConfig(
        shard_index=0,
        num_shards=num_shards,
        num_workers=num_workers,
        consistency=BSP(),
        update=update,
        chunk_bytes=chunk_bytes,
    )


def make(update=DeltaUpdate(), keys=KEYS) -> ShardStore:
    store = ShardStore(config(update=update))
    layout = store.make_layout(keys)
    ids = list(layout.chunk_ids)
    vals = [torch.arange(layout.plan.chunks[c].num_elems).to(layout.dtypes[i]) for i, c in enumerate(ids)]
    assert store.seed(list(keys), ids, vals)
    for w in range(2):
        store.hello(w, 0, resync=False)
    return store


def layout_of(store: ShardStore):
    assert store.layout is not None
    return store.layout


def ids_of(store: ShardStore) -> list[int]:
    return list(layout_of(store).chunk_ids)


def ones(store: ShardStore, value: float = 1.0) -> list[torch.Tensor]:
    return [
        torch.full((layout_of(store).plan.chunks[c].num_elems,), value, dtype=layout_of(store).dtypes[i])
        for i, c in enumerate(ids_of(store))
    ]


def trained(weight_decay: float = 0.01) -> ShardStore:
    store = make(update=ServerSGD(lr=0.1, momentum=0.9, weight_decay=weight_decay))
    store.push(0, 0, 0, ids_of(store), ones(store))
    store.push(1, 0, 1, ids_of(store), ones(store, -3.0))
    store.push(1, 1, 2, ids_of(store), ones(store, 0.5))  # ahead: pending and a momentum share
    return store


def refused(path: Path, data: bytes) -> str:
    """The one-line error that ``data`` read from ``path`` provokes."""
    with pytest.raises(SnapshotError) as info:
        decode_snapshot(data, str(path))
    message = str(info.value)
    assert message.startswith(f"snapshot {path}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_snapshot_round_trip_restores_everything(tmp_path, weight_decay: float) -> None:
    store = trained(weight_decay)
    assert all(p is not None for p in store.pending) and store.applied[0] == 1
    path = snapshot_path(tmp_path, 0, 1)
    write_snapshot(path, capture(store, incarnation=77))
    assert oct(path.stat().st_mode)[-3:] == "600"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    fresh = ShardStore(store.config)
    assert restore(fresh, read_snapshot(path)) == 77
    assert fresh.digest() == store.digest()
    assert fresh.version == 3 and fresh.table.as_dict() == {0: 1, 1: 2}
    assert fresh.applied == store.applied and fresh.folded_clock == store.folded_clock == 1
    fresh.push(0, 1, 3, ids_of(fresh), ones(fresh))  # it keeps working (and folds)
    store.push(0, 1, 3, ids_of(store), ones(store))
    assert fresh.digest() == store.digest()
    assert all(torch.equal(a, b) for a, b in zip(fresh.weights, store.weights))


def test_the_file_is_plain_safetensors_with_a_json_manifest(tmp_path) -> None:
    store = trained()
    path = tmp_path / "s.snap"
    write_snapshot(path, capture(store, incarnation=5))
    tensors = load_file(path)  # any safetensors reader opens it
    n = len(store.weights)
    assert {f"w.{s}" for s in range(n)} | {f"m.{s}" for s in range(n)} <= set(tensors)
    assert all(torch.equal(tensors[f"w.{s}"], store.weights[s]) for s in range(n))
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["format"] == FORMAT == "flotilla-ps-snapshot/3" and meta["crc32"].isdigit()
    manifest = json.loads(meta["manifest"])
    assert manifest["version"] == 3 and manifest["incarnation"] == 5
    assert manifest["layout_digest"] == layout_of(store).digest
    assert manifest["keys"] == [["w", [40], "float32"], ["b", [6], "float32"]]


def test_other_dtypes_and_views_of_one_buffer_round_trip() -> None:
    keys = (KeySpec.of("h", (10,), "bfloat16"), KeySpec.of("d", (3,), "float64"))
    store = make(keys=keys)
    snap = capture(store, incarnation=1)
    buf = torch.arange(6, dtype=torch.float32)  # chunks sharing one storage are encoded too
    shared = Snapshot(meta=snap.meta, tensors=((0, "w", buf[:3]), (1, "w", buf[3:])))
    assert [t.tolist() for _, _, t in decode_snapshot(encode_snapshot(shared), "x").tensors] == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
    ]
    fresh = ShardStore(store.config)
    restore(fresh, decode_snapshot(encode_snapshot(snap), "mem"))
    assert fresh.digest() == store.digest()
    assert [w.dtype for w in fresh.weights] == [w.dtype for w in store.weights]


def test_a_truncated_snapshot_is_refused(tmp_path) -> None:
    path = tmp_path / "s.snap"
    data = encode_snapshot(capture(trained(), incarnation=1))
    end = 8 + int.from_bytes(data[:8], "little")  # end of the header, start of the tensor bytes
    lengths = {*range(0, len(data), 7), *range(end - 9, end + 9), *range(len(data) - 9, len(data))}
    messages = {refused(path, data[:n]) for n in sorted(lengths)}
    assert any("header length" in m for m in messages) and any("safetensors" in m for m in messages)
    path.write_bytes(data[:-1])  # and through the file API, which the server uses
    with pytest.raises(SnapshotError, match=f"snapshot {path}: invalid safetensors data"):
        read_snapshot(path)
    path.write_bytes(data)
    assert read_snapshot(path).version == 3


def test_a_corrupted_byte_is_refused_anywhere_in_the_file(tmp_path) -> None:
    path = tmp_path / "s.snap"
    data = encode_snapshot(capture(trained(), incarnation=1))
    payload = len(data) - 8 - int.from_bytes(data[:8], "little")
    for i in sorted({*range(0, len(data), 5), *range(len(data) - payload, len(data), 3)}):
        bad = bytearray(data)
        bad[i] ^= 0x01
        message = refused(path, bytes(bad))
        if i >= len(data) - payload:
            assert "CRC mismatch" in message
    # a change that keeps the header valid JSON (version 3 -> 4) is caught by the CRC as well
    assert b'\\"version\\":3' in data
    assert "CRC mismatch" in refused(path, data.replace(b'\\"version\\":3', b'\\"version\\":4'))
    assert "header length" in refused(path, (2**62).to_bytes(8, "little") + data[8:])
    path.write_bytes(data[:100] + bytes([data[100] ^ 0x01]) + data[101:])
    with pytest.raises(SnapshotError, match=f"snapshot {path}: "):
        read_snapshot(path)


def test_old_formats_and_foreign_files_are_refused_with_advice(tmp_path) -> None:
    path = tmp_path / "s.snap"
    for magic in (b"FLOTILLA-PS-SNP1", b"FLOTILLA-PS-SNP2"):
        assert "older flotilla" in refused(path, magic + bytes(40)) and "delete it" in refused(path, magic)
    assert "not a flotilla PS snapshot" in refused(path, save({"w.0": torch.ones(3)}))
    assert "header length" in refused(path, b"")
    with pytest.raises(SnapshotError, match=f"snapshot {path}: cannot read"):
        read_snapshot(path)
    with pytest.raises(SnapshotError, match="not been seeded"):
        capture(ShardStore(config()), incarnation=1)


@pytest.mark.parametrize(
    "other, why",
    [
        (dict(num_workers=3), "num_workers"),
        (dict(num_shards=2), "num_shards"),
        (dict(chunk_bytes=128), "chunk_bytes"),
    ],
)
def test_a_snapshot_of_another_identity_is_refused_and_nothing_changes(tmp_path, other, why) -> None:
    path = tmp_path / "s.snap"
    write_snapshot(path, capture(trained(), incarnation=1))
    store = ShardStore(config(**other))
    with pytest.raises(SnapshotError, match=why) as info:
        restore(store, read_snapshot(path))
    assert str(info.value).startswith(f"snapshot {path}: it is for") and "\n" not in str(info.value)
    assert store.layout is None and store.version == 0


def test_a_snapshot_whose_tensors_do_not_fit_its_layout_is_refused(tmp_path) -> None:
    snap = capture(trained(), incarnation=1)
    bad_layout = Snapshot(meta={**snap.meta, "layout_digest": "0" * 32}, tensors=snap.tensors)
    short = Snapshot(meta=snap.meta, tensors=((0, "w", torch.zeros(2)), *snap.tensors[1:]))
    missing = Snapshot(meta=snap.meta, tensors=tuple(t for t in snap.tensors if t[:2] != (1, "w")))
    for bad, why in [(bad_layout, "layout digest"), (short, "w.0 does not fit"), (missing, "misses")]:
        store = ShardStore(config(update=ServerSGD(lr=0.1, momentum=0.9, weight_decay=0.01)))
        with pytest.raises(SnapshotError, match=why):
            restore(store, decode_snapshot(encode_snapshot(bad), str(tmp_path / "x.snap")))
        assert store.layout is None and store.version == 0


def test_evicted_workers_survive_a_snapshot_so_the_momentum_shares_do_not_change() -> None:
    """A shard restarted from its snapshot still knows which departed workers were evicted (dead,
    their slices taken over) and which left: the momentum shares' divisor is the same after it."""
    store = ShardStore(config(num_workers=3, update=ServerSGD(lr=0.1, momentum=0.9)))
    layout = store.make_layout(KEYS)
    ids = list(layout.chunk_ids)
    assert store.seed(list(KEYS), ids, [torch.zeros(layout.plan.chunks[c].num_elems) for c in ids])
    for w in range(3):
        store.hello(w, 0, resync=False)
    store.evict(2)
    before = store.share_divisor()
    fresh = ShardStore(store.config)
    restore(fresh, decode_snapshot(encode_snapshot(capture(store, incarnation=5)), "mem"))
    assert fresh.clocks.evicted == store.clocks.evicted == frozenset({2})
    assert fresh.share_divisor() == before == 2  # (were it taken for one that left: 3)


def test_a_snapshot_naming_an_evicted_worker_that_never_departed_is_refused() -> None:
    store = make()
    snap = capture(store, incarnation=1)
    bad = Snapshot(meta={**snap.meta, "evicted": [1]}, tensors=snap.tensors)
    with pytest.raises(SnapshotError, match="never departed"):
        restore(ShardStore(store.config), bad)
