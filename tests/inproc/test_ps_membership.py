"""PS membership under churn over the in-process transport (issue 19): a pull gated on a dead worker
is released once a survivor evicts it (on every shard); a worker joins mid-run at the shards' global
clock and its pushes are applied; and (issue 18 item 5) correctly signed requests carrying extreme
clocks, versions, ids, waits and eviction lists are refused, logged and change nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from flotilla.comm.msgplane import connect
from flotilla.core.errors import RemoteError
from flotilla.ps.clock_rules import JOIN_LEAD, MAX_CLOCK, MAX_RESYNC_JUMP, MAX_WORKER_ID
from flotilla.ps.consistency import BSP, SSP
from flotilla.ps.data_views import DataView
from flotilla.ps.server import MAX_EVICT

from .test_ps_server import SECRET, client, ones_like, servers, shard_configs, values

pytestmark = pytest.mark.timeout(60)
VALS = {"a": (40,), "b": (8, 8)}


def _tables(srvs) -> list[dict[int, int]]:
    return [dict(srv.store.table.entries) for srv in srvs]


def test_a_pull_gated_on_a_dead_worker_is_released_by_evicting_it_on_every_shard() -> None:
    with servers(shard_configs(2, 3, BSP())) as srvs:
        vals = values(**VALS)
        w = [client(srvs, i, vals) for i in range(3)]
        for c in w:
            c.push(ones_like(vals), 0)
        w[0].push(ones_like(vals), 1)
        w[1].push(ones_like(vals), 1)  # worker 2 "dies" at clock 1: the BSP gate for 2 waits on it
        w[0].gone = lambda: {2}
        w[0].park_s = 0.2
        out = values(**VALS)
        w[0].pull(2, out)  # released only by the eviction (worker 2 never pushes again)
        assert _tables(srvs) == [{0: 2, 1: 2}, {0: 2, 1: 2}]
        assert all(srv.store.departed == frozenset({2}) for srv in srvs)
        with pytest.raises(RemoteError) as err:  # the evicted worker cannot come back as itself
            w[2].push(ones_like(vals), 1)
        assert err.value.code == "unknown_worker"
        for c in w:
            c.close()


@pytest.mark.parametrize("committed_on", [(0,), (), (0, 1)])
def test_a_dead_workers_last_clock_is_applied_on_every_shard_or_on_none(committed_on: tuple) -> None:
    """Worker 2 stages clock 1 on both shards and dies having committed it on ``committed_on``
    only; a survivor's eviction fences both shards and resolves: the clock ends applied on every
    shard (committed somewhere) or on none, and the zombie's late commit is refused."""
    with servers(shard_configs(2, 3, BSP())) as srvs:
        vals = values(**VALS)
        w = [client(srvs, i, vals) for i in range(3)]
        for c in w:
            c.push(ones_like(vals), 0)
        for c in w[:2]:
            c.push(ones_like(vals), 1)
        dying = w[2]
        flats = dying._flat(ones_like(vals, 3.0))
        for s in range(2):
            assert dying._stage(s, flats, 1, dying._deadline())
        for s in committed_on:
            dying._commit(s, flats, 1, dying._deadline())
        versions = [srv.store.version for srv in srvs]
        w[0].gone = lambda: {2}
        w[0].park_s = 0.2
        w[0].pull(2, values(**VALS))  # released by the eviction (unless committed everywhere)
        w[0].evict_gone()  # (a no-op if the pull's wait already resolved worker 2)
        applied = 1 if committed_on else 0
        assert [srv.store.removed_at[2] for srv in srvs] == [1 + applied] * 2
        assert [srv.store.version for srv in srvs] == [
            v + applied - (s in committed_on) for s, v in enumerate(versions)
        ]
        assert all(2 in srv.store.departed and not srv.store.staged for srv in srvs)
        outcome = w[0].resolutions[-1]
        assert outcome["ids"] == [2] and outcome["targets"] == [1 + applied]
        with pytest.raises(RemoteError) as err:  # the zombie's late commit changes nothing
            dying._commit(1, flats, 1, dying._deadline())
        assert err.value.code == "unknown_worker"
        for c in w:
            c.close()


def test_a_worker_joins_mid_run_at_the_global_clock_and_its_pushes_are_applied() -> None:
    with servers(shard_configs(2, 2, SSP(staleness=1))) as srvs:
        vals = values(**VALS)
        w = [client(srvs, i, vals) for i in range(2)]
        for k in range(3):
            for c in w:
                c.push(ones_like(vals), k)
        w[0].push(ones_like(vals), 3)  # c_global 3 on both shards, worker 0 at 4
        before = [srv.store.version for srv in srvs]
        # names clock 0; shard 0 puts it in a new data view from max + 2 = 6 (nobody can be
        # computing clock 6 yet: ps/data_views.py), shard 1 follows on the next hello
        joiner = client(srvs, 7, vals)
        assert joiner.clocks == [6, 6] and _tables(srvs) == [{0: 4, 1: 3, 7: 6}] * 2
        assert srvs[0].store.clocks.views.views[-1] == DataView(6, (0, 1, 7))
        assert srvs[1].store.clocks.views.views == ()  # (only shard 0 keeps them)
        assert joiner.data_views[1][-1] == DataView(6, (0, 1, 7))  # carried by the hello reply
        for k in (3, 4, 5):
            w[1].push(ones_like(vals), k)
        for k in (4, 5):
            w[0].push(ones_like(vals), k)
        before = [srv.store.version for srv in srvs]
        out = values(**VALS)
        joiner.pull(6, out)
        joiner.push(ones_like(vals, 2.0), 6)
        assert [srv.store.version for srv in srvs] == [v + 1 for v in before]  # applied on every shard
        after = values(**VALS)
        joiner.pull(6, after)
        for name in VALS:  # delta rule: its push of 2.0 is in the weights
            assert torch.equal(after[name], out[name] + 2.0)
        for c in (*w, joiner):
            c.close()


def test_a_join_or_resync_ahead_of_every_live_worker_is_refused() -> None:
    with servers(shard_configs(1, 1, BSP())) as srvs:
        vals = values(**VALS)
        w0 = client(srvs, 0, vals)
        w0.push(ones_like(vals), 0)
        raw = connect(srvs[0].address, SECRET, sender="late")
        inc = srvs[0].incarnation
        with pytest.raises(RemoteError) as err:
            raw.call("ps.hello", {"worker_id": 5, "clock": 1 + JOIN_LEAD + 1, "incarnation": -1}, timeout_s=5)
        assert err.value.code == "bad_clock" and _tables(srvs) == [{0: 1}]
        raw.close()
        w0.close()
        assert inc == srvs[0].incarnation


EXTREMES = [2**63 - 1, 2**62, 10**15, MAX_CLOCK + 1, -(2**63)]


def test_signed_extreme_values_are_refused_and_change_nothing() -> None:
    """Every field a PS peer sends, at its extremes, with a valid signature: refused with the
    expected code, no state change; the job's workers then carry on."""
    with servers(shard_configs(2, 2, SSP(staleness=1))) as srvs:
        vals = values(**VALS)
        w = [client(srvs, i, vals) for i in range(2)]
        for c in w:
            c.push(ones_like(vals), 0)
        raw = connect(srvs[0].address, SECRET, sender="w0-imposter")
        inc = srvs[0].incarnation
        state = (_tables(srvs), [srv.store.digest() for srv in srvs], [srv.store.version for srv in srvs])
        ids = [cid for cid, _ in w[0]._chunks[0]]  # shard 0's chunks: a push is well formed but for
        zeros = [torch.zeros(c.num_elems) for _, c in w[0]._chunks[0]]  # the one extreme field
        bad: list[tuple[str, dict]] = []
        for x in EXTREMES:
            bad += [
                ("ps.hello", {"worker_id": 0, "clock": x, "incarnation": inc + 1}),  # resync
                ("ps.hello", {"worker_id": x, "clock": 0, "incarnation": -1}),
                (
                    "ps.push",
                    {"worker_id": 0, "clock": x, "incarnation": inc, "base_version": 0, "chunks": ids},
                ),
                (
                    "ps.push",
                    {"worker_id": 0, "clock": 1, "incarnation": inc, "base_version": x, "chunks": ids},
                ),
                ("ps.pull", {"worker_id": 0, "clock": x, "incarnation": inc, "chunks": ids, "wait_s": 0.1}),
                ("ps.pull", {"worker_id": 0, "clock": 1, "incarnation": inc, "chunks": [x], "wait_s": 0.1}),
                ("ps.evict", {"worker_id": 0, "incarnation": inc, "evict": [x]}),
                (
                    "ps.stage",
                    {"worker_id": 0, "clock": x, "incarnation": inc, "base_version": 0, "chunks": ids},
                ),
                ("ps.commit", {"worker_id": 0, "clock": x, "incarnation": inc}),
                (
                    "ps.cpull",
                    {
                        "worker_id": 0,
                        "clock": 1,
                        "incarnation": inc,
                        "chunks": ids,
                        "wait_s": 0.1,
                        "commit": x,
                    },
                ),
                ("ps.fence", {"worker_id": 0, "incarnation": inc, "evict": [x]}),
                ("ps.resolve", {"worker_id": 0, "incarnation": inc, "evict": [x], "upto": [1]}),
                ("ps.resolve", {"worker_id": 0, "incarnation": inc, "evict": [1], "upto": [x]}),
            ]
        bad += [
            ("ps.hello", {"worker_id": 0, "clock": 1 + MAX_RESYNC_JUMP + 1, "incarnation": inc + 1}),
            ("ps.hello", {"worker_id": MAX_WORKER_ID + 1, "clock": 0, "incarnation": -1}),
            ("ps.evict", {"worker_id": 0, "incarnation": inc, "evict": list(range(2, 3 + MAX_EVICT))}),
            ("ps.evict", {"worker_id": 99, "incarnation": inc, "evict": [1]}),  # not a member: refused
            (
                "ps.pull",
                {"worker_id": 0, "clock": 1, "incarnation": inc, "chunks": ids, "wait_s": float("inf")},
            ),
            ("ps.pull", {"worker_id": 0, "clock": 1, "incarnation": inc, "chunks": ids, "wait_s": -1.0}),
        ]
        codes = []
        for op, body in bad:
            with pytest.raises(RemoteError) as err:
                raw.call(op, body, zeros if op in ("ps.push", "ps.stage") else (), timeout_s=5)
            codes.append(err.value.code)
            after = (_tables(srvs), [srv.store.digest() for srv in srvs], [srv.store.version for srv in srvs])
            assert after == state, (op, body)
        assert set(codes) <= {"bad_clock", "bad_version", "schema", "unknown_worker", "bad_key"}, codes
        assert {"bad_clock", "bad_version", "schema", "unknown_worker"} <= set(codes), codes
        assert srvs[0].store.departed == frozenset()  # no extreme id evicted anyone
        raw.close()
        done = threading.Event()

        def peer() -> None:
            w[1].push(ones_like(vals), 1)
            done.set()

        t = threading.Thread(target=peer)
        t.start()
        w[0].push(ones_like(vals), 1)  # the job's workers are unharmed: they carry on
        t.join(10)
        assert done.is_set() and _tables(srvs) == [{0: 2, 1: 2}, {0: 2, 1: 2}]
        for c in w:
            c.close()
