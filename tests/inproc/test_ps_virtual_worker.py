"""A HetPipe virtual worker (VW) on the parameter server, over the in-process transport (issue 19
item 5; ``ps/two_phase.py`` "Parts", ``ps/client_parts.py``): two shards, one plain worker and a
VW of two stages owning disjoint keys (stage 1's keys lie on shard 1 only, so its part is empty
on shard 0).  The test plays the VW's coordination: it commits once every part is staged on
every shard.  A VW clock is applied only with both parts and the commit, counts as one worker in
the gate, is discarded everywhere when a stage dies before the commit, committed everywhere when
the commit reached one shard, bad parts are refused without a change, a VW joins mid-run like
any worker, and a shard's backup replays the parts (``strategy.replication: 2``)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from flotilla.comm.msgplane import connect, serve
from flotilla.core.errors import RemoteError
from flotilla.ps.client import keys_of
from flotilla.ps.client_parts import VWPartClient
from flotilla.ps.consistency import BSP, SSP
from flotilla.ps.data_views import DataView
from flotilla.ps.replication_server import BackupServer, ReplicatedPSServer
from flotilla.ps.two_phase import MAX_PARTS, NONE

from .test_ps_server import FAST, SECRET, client, ones_like, servers, shard_configs, values

pytestmark = pytest.mark.timeout(60)
VALS = {"a": (600,), "b": (10,), "c": (3, 4)}  # a: chunks on shards 0 and 1; b, c: shard 1 only
OWN = (("a",), ("b", "c"))  # the VW's stage 0 and stage 1
VW = 1


def vw_parts(srvs, worker_id: int = VW) -> list[VWPartClient]:
    parts = [
        VWPartClient(
            [s.address for s in srvs],
            SECRET,
            worker_id=worker_id,
            keys=keys_of(values(**VALS)),
            own=own,
            part=i,
            parts=len(OWN),
            chunk_bytes=1024,
            options=FAST,
        )
        for i, own in enumerate(OWN)
    ]
    for p in parts:
        p.hello(0)
    return parts


def stage_all(parts: list[VWPartClient], clock: int, ks: tuple[float, float] = (2.0, 3.0)) -> None:
    """Every stage stages its part (stage i pushes ks[i] for each of its values)."""
    assert [p.stage(ones_like(values(**VALS), k), clock) for p, k in zip(parts, ks)] == [False, True]


def _vw_clocks(srvs, worker_id: int = VW) -> list[int | None]:
    return [srv.store.table.as_dict().get(worker_id) for srv in srvs]


def _pulled(c, clock: int) -> dict[str, torch.Tensor]:
    out = values(**VALS)
    c.pull(clock, out)
    return out


def test_the_layout_gives_stage_1_no_chunk_on_shard_0() -> None:
    with servers(shard_configs(2, 2)) as srvs:
        parts = vw_parts(srvs)
        assert [len(ch) for ch in parts[0]._chunks] == [2, 1]
        assert [len(ch) for ch in parts[1]._chunks] == [0, 2]
        for p in parts:
            p.close()


def test_a_vw_clock_is_applied_once_both_parts_are_staged_and_the_commit_came() -> None:
    with servers(shard_configs(2, 2, BSP())) as srvs:
        w0 = client(srvs, 0, values(**VALS))  # seeds zeros (a part client cannot seed)
        parts = vw_parts(srvs)
        w0.push(ones_like(values(**VALS)), 0)
        before = [srv.store.version for srv in srvs]
        assert parts[0].stage(ones_like(values(**VALS), 2.0), 0) is False
        assert [srv.store.staged_clock(VW) for srv in srvs] == [NONE, NONE]  # one part of two
        with pytest.raises(RemoteError) as err:  # an incomplete clock cannot be committed
            parts[0].commit(0)
        assert err.value.code == "not_staged"
        assert parts[1].stage(ones_like(values(**VALS), 3.0), 0) is True
        assert [srv.store.staged_clock(VW) for srv in srvs] == [0, 0]
        assert [srv.store.version for srv in srvs] == before and _vw_clocks(srvs) == [0, 0]
        assert parts[0].commit(0) == [v + 1 for v in before]  # one version step per shard
        assert parts[1].commit(0) == [v + 1 for v in before]  # the other stage's commit: done
        assert _vw_clocks(srvs) == [1, 1] and parts[0].clocks == parts[1].clocks == [1, 1]
        assert not any(srv.store.staged for srv in srvs)
        got = _pulled(w0, 1)  # the delta rule: 1 (worker 0) + 2 (stage 0) or + 3 (stage 1)
        assert torch.equal(got["a"], torch.full((600,), 3.0))
        assert torch.equal(got["b"], torch.full((10,), 4.0)) and torch.equal(
            got["c"], torch.full((3, 4), 4.0)
        )
        own0, own1 = {"a": torch.zeros(600)}, {"b": torch.zeros(10), "c": torch.zeros(3, 4)}
        parts[0].pull(1, own0)
        parts[1].pull(1, own1)  # (asks shard 1 only)
        assert torch.equal(own0["a"], got["a"]) and torch.equal(own1["b"], got["b"])
        with pytest.raises(Exception, match="does not push alone"):
            parts[0].push(ones_like(values(**VALS)), 1)
        for c in (w0, *parts):
            c.close()


def test_the_gate_counts_the_vw_as_one_worker() -> None:
    with servers(shard_configs(2, 2, BSP())) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        assert [sorted(srv.store.table.as_dict()) for srv in srvs] == [[0, VW], [0, VW]]
        w0.push(ones_like(values(**VALS)), 0)
        done = threading.Event()

        def pull() -> None:
            _pulled(w0, 1)
            done.set()

        t = threading.Thread(target=pull)
        t.start()  # gated: the VW has not pushed clock 0
        stage_all(parts, 0)
        assert [srv.store.table.c_global for srv in srvs] == [0, 0]  # staged is not pushed
        assert not done.is_set()
        for p in parts:
            p.commit(0)
        assert done.wait(20)
        t.join(10)
        assert [srv.store.table.c_global for srv in srvs] == [1, 1]
        for c in (w0, *parts):
            c.close()


def test_a_vw_whose_stage_dies_before_the_commit_is_evicted_with_nothing_of_that_clock_applied() -> None:
    with servers(shard_configs(2, 2, BSP())) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        w0.push(ones_like(values(**VALS)), 0)
        stage_all(parts, 0)
        for p in parts:
            p.commit(0)
        w0.push(ones_like(values(**VALS)), 1)
        assert parts[0].stage(ones_like(values(**VALS), 5.0), 1) is False  # stage 1 "dies" now
        versions = [srv.store.version for srv in srvs]
        w0.gone = lambda: {VW}  # the coordinator's word
        w0.park_s = 0.2
        got = _pulled(w0, 2)  # released only by the eviction of the VW on every shard
        assert [srv.store.removed_at[VW] for srv in srvs] == [1, 1]
        assert all(VW in srv.store.departed and not srv.store.staged for srv in srvs)
        assert [srv.store.version for srv in srvs] == versions  # nothing of the VW's clock 1
        assert [srv.store.table.c_global for srv in srvs] == [2, 2]
        outcome = w0.resolutions[-1]
        assert outcome["targets"] == [1]
        assert [r["resolved"] for r in outcome["shards"]] == [[[VW, "discarded", 1]]] * 2
        assert torch.equal(got["a"], torch.full((600,), 4.0))  # 1 + 1 (worker 0) + 2 (VW clock 0)
        assert torch.equal(got["b"], torch.full((10,), 5.0))  # 1 + 1 + 3
        with pytest.raises(RemoteError) as err:  # the zombie stage changes nothing
            parts[1].stage(ones_like(values(**VALS), 5.0), 1)
        assert err.value.code == "unknown_worker"
        for c in (w0, *parts):
            c.close()


def test_a_vw_dying_after_its_commit_reached_one_shard_is_committed_on_every_shard() -> None:
    with servers(shard_configs(2, 2, BSP())) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        w0.push(ones_like(values(**VALS)), 0)
        stage_all(parts, 0)
        versions = [srv.store.version for srv in srvs]
        parts[0]._commit_vw(0, 0, parts[0]._deadline())  # the commit reaches shard 0 only
        assert _vw_clocks(srvs) == [1, 0]
        w0.gone = lambda: {VW}
        w0.park_s = 0.2
        got = _pulled(w0, 1)  # shard 1's gate waits on the VW until the resolution
        assert [srv.store.version for srv in srvs] == [v + 1 for v in versions]  # applied everywhere
        assert [srv.store.removed_at[VW] for srv in srvs] == [1, 1]
        outcome = w0.resolutions[-1]
        assert outcome["targets"] == [1]
        assert [r["resolved"] for r in outcome["shards"]] == [[[VW, "none", 1]], [[VW, "committed", 1]]]
        assert torch.equal(got["a"], torch.full((600,), 3.0))  # both parts, on both shards
        assert torch.equal(got["b"], torch.full((10,), 4.0)) and torch.equal(
            got["c"], torch.full((3, 4), 4.0)
        )
        for c in (w0, *parts):
            c.close()


def test_bad_parts_are_refused_and_change_nothing() -> None:
    with servers(shard_configs(2, 2, BSP())) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        assert parts[0].stage(ones_like(values(**VALS), 2.0), 0) is False  # part 0 of 2 staged
        srv = srvs[1]  # holds a chunk of part 0 (chunk 1) and part 1's (chunks 3, 4)
        raw = connect(srv.address, SECRET, sender="vw-imposter")
        inc = srv.incarnation
        base = {"worker_id": VW, "clock": 0, "incarnation": inc, "base_version": 0}
        t200, t10, t12 = torch.zeros(200), torch.zeros(10), torch.zeros(12)

        def state():
            entry = srv.store.staged[VW]
            held = {p: (slots, [t.clone() for t in ts]) for p, (slots, ts) in entry.held.items()}
            return srv.store.digest(), srv.store.version, dict(srv.store.table.entries), entry.parts, held

        before = state()
        bad = [
            ("ps.stage_part", {**base, "chunks": [3, 4], "part": 2, "parts": 2}, [t10, t12], "bad_part"),
            ("ps.stage_part", {**base, "chunks": [3, 4], "part": 1, "parts": 3}, [t10, t12], "bad_part"),
            ("ps.stage_part", {**base, "chunks": [3, 4], "part": 0, "parts": 0}, [t10, t12], "bad_part"),
            ("ps.stage_part", {**base, "chunks": [3], "part": 0, "parts": MAX_PARTS + 1}, [t10], "bad_part"),
            ("ps.stage_part", {**base, "chunks": [1, 3], "part": 1, "parts": 2}, [t200, t10], "bad_key"),
            ("ps.stage_part", {**base, "chunks": [3, 3], "part": 1, "parts": 2}, [t10, t10], "bad_key"),
            ("ps.stage_part", {**base, "chunks": [], "part": 1, "parts": 2}, [t10], "bad_value"),
            ("ps.stage_part", {**base, "chunks": [3], "part": "1", "parts": 2}, [t10], "schema"),
            ("ps.stage_part", {**base, "clock": 4, "chunks": [3], "part": 1, "parts": 2}, [t10], "bad_clock"),
            (
                "ps.stage_part",
                {**base, "worker_id": 99, "chunks": [3], "part": 1, "parts": 2},
                [t10],
                "unknown_worker",
            ),
            ("ps.stage", {**base, "chunks": [3, 4]}, [t10, t12], "bad_part"),  # a whole clock: 1 part
            ("ps.commit", {"worker_id": VW, "clock": 0, "incarnation": inc}, [], "not_staged"),
        ]
        for op, body, tensors, code in bad:
            with pytest.raises(RemoteError) as err:
                raw.call(op, body, tensors, timeout_s=5)
            assert err.value.code == code, (op, body, err.value)
            after = state()
            assert after[:4] == before[:4], (op, body)
            assert after[4].keys() == before[4].keys()
            assert all(torch.equal(x, y) for p in after[4] for x, y in zip(after[4][p][1], before[4][p][1]))
        raw.close()
        assert parts[1].stage(ones_like(values(**VALS), 3.0), 0) is True  # the VW carries on
        for p in parts:
            p.commit(0)
        assert _vw_clocks(srvs) == [1, 1]
        for c in (w0, *parts):
            c.close()


def test_a_vw_joins_mid_run_like_any_worker() -> None:
    with servers(shard_configs(2, 1, SSP(staleness=1))) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        for k in range(3):
            w0.push(ones_like(values(**VALS)), k)
        before = [srv.store.version for srv in srvs]
        # the VW (id 7) names clock 0: shard 0 adds it to a new data view from max + 2 = 5, as one
        # member, and both stages end at that clock on both shards
        parts = vw_parts(srvs, worker_id=7)
        assert parts[0].clocks == parts[1].clocks == [5, 5]
        assert [dict(srv.store.table.entries) for srv in srvs] == [{0: 3, 7: 5}] * 2
        assert srvs[0].store.clocks.views.views[-1] == DataView(5, (0, 7))
        assert parts[1].data_views[1][-1] == DataView(5, (0, 7))
        for k in (3, 4):
            w0.push(ones_like(values(**VALS)), k)
        stage_all(parts, 5)
        for p in parts:
            p.commit(5)
        assert [srv.store.version for srv in srvs] == [v + 3 for v in before]  # 2 of w0, 1 of the VW
        assert _vw_clocks(srvs, 7) == [6, 6]
        got = _pulled(w0, 5)
        assert torch.equal(got["a"], torch.full((600,), 7.0)) and torch.equal(
            got["b"], torch.full((10,), 8.0)
        )
        parts[0].leave()
        parts[1].leave()  # (the VW left already: a no-op)
        assert all(7 in srv.store.departed for srv in srvs)
        for c in (w0, *parts):
            c.close()


def test_a_backup_replays_the_parts_into_the_same_state() -> None:
    cfg = shard_configs(1, 2)[0]
    with contextlib.ExitStack() as stack:
        b = BackupServer(cfg, serve(SECRET, "mem://vw-backup")).start()
        stack.callback(b.close)
        p = ReplicatedPSServer(
            cfg, serve(SECRET, "mem://vw-primary"), backup_address=b.address, secret=SECRET
        ).start()
        stack.callback(p.close)
        w0 = client([p], 0, values(**VALS))
        parts = vw_parts([p])
        w0.push(ones_like(values(**VALS)), 0)
        assert parts[0].stage(ones_like(values(**VALS), 2.0), 0) is False  # acknowledged: on the backup too
        assert b.store.staged[VW].parts == p.store.staged[VW].parts
        assert parts[1].stage(ones_like(values(**VALS), 3.0), 0) is True
        for part in parts:
            part.commit(0)
        assert b.store.version == p.store.version == 2 and not b.store.staged
        assert b.store.digest() == p.store.digest()
        for c in (w0, *parts):
            c.close()
