"""Parameter server over the in-process transport: non-blocking gated pulls, pull timeouts,
batching (one request per shard per step), chunk reassembly, snapshots and restart, and PSSync
training three workers (threads) under every consistency model."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest
import torch
from torch import nn

from flotilla.comm import auth
from flotilla.comm.msgplane import serve
from flotilla.config.schema import AdamOptimizer, PSStrategy, SGDOptimizer
from flotilla.core.errors import CallTimeout
from flotilla.ps.client import ClientOptions, PSClient, keys_of
from flotilla.ps.consistency import BSP, ConsistencyModel
from flotilla.ps.server import PSServer, SnapshotPolicy, shard_config_from
from flotilla.ps.store import DeltaUpdate, ShardConfig
from flotilla.sync.ps_settings import ps_config_from
from flotilla.sync.via_ps import PSSync

SECRET = auth.generate_secret()
pytestmark = pytest.mark.timeout(90)
FAST = ClientOptions(pull_timeout_s=20.0, attempt_timeout_s=2.0)


def shard_configs(
    num_shards: int, num_workers: int, model: ConsistencyModel = BSP(), chunk_bytes: int = 1024
) -> list[ShardConfig]:
    return [
        ShardConfig(
            shard_index=i,
            num_shards=num_shards,
            num_workers=num_workers,
            consistency=model,
            update=DeltaUpdate(),
            chunk_bytes=chunk_bytes,
        )
        for i in range(num_shards)
    ]


@contextlib.contextmanager
def servers(configs: list[ShardConfig], snapshots: SnapshotPolicy | None = None, names=None):
    started = []
    try:
        for i, cfg in enumerate(configs):
            bind = f"mem://{names[i]}" if names else "mem://"
            started.append(PSServer(cfg, serve(SECRET, bind, name=f"shard{i}"), snapshots=snapshots).start())
        yield started
    finally:
        for s in started:
            s.close()


def values(**shapes) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in shapes.items()}


def client(srvs, worker_id: int, vals, options=FAST, chunk_bytes=1024, two_phase=None) -> PSClient:
    c = PSClient(
        [s.address for s in srvs],
        SECRET,
        worker_id=worker_id,
        keys=keys_of(vals),
        chunk_bytes=chunk_bytes,
        options=options,
        two_phase=two_phase,
    )
    c.hello(0)
    c.initialize(vals)
    return c


def wait_until(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def ones_like(vals, k: float = 1.0):
    return {n: torch.full_like(t, k) for n, t in vals.items()}


# ----------------------------------------------------------------------------- runtime
def test_a_gated_pull_waits_without_blocking_the_server() -> None:
    vals = values(a=(300,), b=(7, 5))
    with servers(shard_configs(2, 2)) as srvs:
        c0, c1 = client(srvs, 0, vals), client(srvs, 1, vals)
        try:
            out0 = {n: t.clone() for n, t in vals.items()}
            c0.push(ones_like(vals), 0)
            done = threading.Event()
            t = threading.Thread(target=lambda: (c0.pull(1, out0), done.set()))
            t.start()
            out1 = {n: t.clone() for n, t in vals.items()}
            c1.pull(0, out1)  # served although worker 0's pull is parked
            # the parked pull is visible in the stats (polled: there is no event to wait on)
            assert wait_until(lambda: {s["pending"] for s in c1.stats()} == {1}, 10)
            assert not done.is_set()
            c1.push(ones_like(vals, 2.0), 0)  # completes clock 0: worker 0 may go on
            assert done.wait(10)
            t.join(10)
            assert all(torch.all(v == 3.0) for v in out0.values())
        finally:
            c0.close()
            c1.close()


def test_a_pull_that_stays_gated_times_out_with_a_clear_error() -> None:
    vals = values(a=(10,))
    opts = ClientOptions(pull_timeout_s=1.0, attempt_timeout_s=0.3)
    with servers(shard_configs(1, 2)) as srvs:
        c0, c1 = client(srvs, 0, vals, opts), client(srvs, 1, vals, opts)
        try:
            c0.push(ones_like(vals), 0)
            with pytest.raises(CallTimeout) as err:
                c0.pull(1, {n: t.clone() for n, t in vals.items()})
            text = str(err.value)
            assert "pull_timeout_s" in text and "still blocked" in text
            assert "c_global=0 must reach 1" in text and "workers behind: [1]" in text
        finally:
            c0.close()
            c1.close()


@pytest.mark.parametrize("two_phase", [False, True])
def test_one_request_per_shard_per_push_and_pull(two_phase: bool) -> None:
    """One request per shard per push and per pull; with two-phase pushes (ps/two_phase.py) a
    push is a stage and a commit, and a push_pull a stage and a commit carried by the pull."""
    vals = {f"layer{i}": torch.zeros(50 + i) for i in range(12)}
    with servers(shard_configs(3, 1)) as srvs:
        c = client(srvs, 0, vals, two_phase=two_phase)
        try:
            out = {n: t.clone() for n, t in vals.items()}
            c.pull(0, out)
            for clock in range(4):
                c.push(ones_like(vals), clock)
                c.pull(clock + 1, out)
            for clock in range(4, 7):
                c.push_pull(ones_like(vals), clock, out)
        finally:
            c.close()
        for s in srvs:
            if not two_phase:
                assert s.op_counts["ps.push"] == 4 and s.op_counts["ps.pull"] == 5
                assert s.op_counts["ps.pushpull"] == 3 and s.store.version == 7
            else:
                assert s.op_counts["ps.stage"] == 7 and s.op_counts["ps.commit"] == 4
                assert s.op_counts["ps.pull"] == 5 and s.op_counts["ps.cpull"] == 3
                assert s.op_counts["ps.push"] == s.op_counts["ps.pushpull"] == 0 and s.store.version == 7
    assert all(torch.all(v == 7.0) for v in out.values())


def test_big_keys_are_chunked_over_shards_and_reassembled() -> None:
    gen = torch.Generator().manual_seed(1)
    vals = {"big": torch.randn(64, 40, generator=gen), "small": torch.randn(3, generator=gen)}
    with servers(shard_configs(3, 1, chunk_bytes=1024)) as srvs:
        c = client(srvs, 0, vals)
        try:
            assert len(c.plan.chunks_of_key("big")) == 10  # 10240 bytes in <= 1 KiB chunks
            assert all(s.store.layout and len(s.store.weights) >= 3 for s in srvs)
            loads = c.plan.bytes_per_shard()
            assert max(loads) - min(loads) <= 1024
            out = {n: torch.zeros_like(t) for n, t in vals.items()}
            c.pull(0, out)
            assert all(torch.equal(out[n], vals[n]) for n in vals)
        finally:
            c.close()


def test_periodic_snapshots_and_restart_lose_at_most_the_updates_since(tmp_path) -> None:
    vals = values(a=(100,), b=(9,))
    policy = SnapshotPolicy(directory=tmp_path, every_versions=2, every_s=0.0)
    cfgs = shard_configs(2, 1)
    opts = ClientOptions(pull_timeout_s=10.0, attempt_timeout_s=0.5)
    out = {n: t.clone() for n, t in vals.items()}
    with servers(cfgs, policy, names=["ps-a", "ps-b"]) as srvs:
        c = client(srvs, 0, vals, opts)
        c.pull(0, out)
        for clock in range(4):  # versions 1..4; snapshots at 2, 4
            c.push(ones_like(vals), clock)
        assert all(s.wait_snapshot(4, 10) for s in srvs), [s.snapshot_version for s in srvs]
        snap_versions = [s.snapshot_version for s in srvs]
        c.push(ones_like(vals), 4)  # version 5: not in any snapshot
        for s in srvs:
            s.close(final_snapshot=False)  # stands for a crash
    assert snap_versions == [4, 4]
    with servers(cfgs, policy, names=["ps-a", "ps-b"]) as again:
        assert [s.store.version for s in again] == [4, 4]
        assert all(s.restored_from is not None for s in again)
        try:
            c.push(ones_like(vals), 5)  # "restarted" -> hello -> retried
            c.pull(6, out)
        finally:
            c.close()
        assert [s.store.version for s in again] == [5, 5]
        assert [s.store.clock_of(0) for s in again] == [6, 6]
    # 6 pushes of ones were made, the 5th was lost with the crash (after the snapshot at 4)
    assert all(torch.all(v == 5.0) for v in out.values())


def test_a_time_based_snapshot_is_written(tmp_path) -> None:
    vals = values(a=(10,))
    policy = SnapshotPolicy(directory=tmp_path, every_versions=0, every_s=0.2)
    with servers(shard_configs(1, 1), policy) as srvs:
        c = client(srvs, 0, vals)
        try:
            c.push(ones_like(vals), 0)
            assert srvs[0].wait_snapshot(1, 10)
        finally:
            c.close()


# ----------------------------------------------------------------------------- PSSync training
def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 8, generator=gen) * 3
    y = torch.randint(0, 3, (600,), generator=gen)
    return centers[y] + torch.randn(600, 8, generator=gen), y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _pssync(model: nn.Module, optimizer_cfg, strategy: PSStrategy, addresses, worker_id: int, **kw) -> PSSync:
    """A ``PSSync`` for a run's strategy and optimizer (delta mode: with the job's optimizer)."""
    ps = ps_config_from(strategy, optimizer_cfg)
    optimizer = None
    if isinstance(ps.update, DeltaUpdate):
        o = optimizer_cfg
        if isinstance(o, AdamOptimizer):
            optimizer = torch.optim.Adam(
                model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
            )
        else:
            optimizer = torch.optim.SGD(
                model.parameters(),
                lr=o.lr,
                momentum=o.momentum,
                weight_decay=o.weight_decay,
                nesterov=o.nesterov,
            )
    return PSSync(model, ps, addresses, SECRET, worker_id, optimizer=optimizer, **kw)


def _train(sync: PSSync, model: nn.Module, x, y, rank: int, num_clocks: int, global_batch: int) -> None:
    sync.initialize()
    gen = torch.Generator().manual_seed(100 + rank)
    for clock in range(num_clocks):
        for i in range(sync.wave_size):
            idx = torch.randint(0, x.shape[0], (global_batch // 3,), generator=gen)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum") / global_batch
            loss.backward()
            if i < sync.wave_size - 1:
                sync.local_step()
        if clock % 2:
            sync.push_pull(clock)  # fused: one round trip per shard
        else:
            sync.push(clock)
            sync.pull(clock + 1)


def _run_workers(fn, syncs: list[PSSync]) -> list[BaseException]:
    """Run ``fn(w)`` for every worker in its own thread, close every sync; the errors raised."""
    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            fn(w)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(len(syncs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in syncs:
        s.close()
    return errors


CASES = [
    (PSStrategy(consistency="bsp", num_servers=2, chunk_bytes=256), SGDOptimizer(lr=0.1)),
    (PSStrategy(consistency="asp", num_servers=2, chunk_bytes=256), SGDOptimizer(lr=0.1)),
    (PSStrategy(consistency="ssp", staleness=2, num_servers=1), SGDOptimizer(lr=0.1, momentum=0.5)),
    (PSStrategy(consistency="wsp", s_local=0, clock_distance=1, num_servers=2), SGDOptimizer(lr=0.1)),
    (
        PSStrategy(consistency="wsp", s_local=1, clock_distance=1, num_servers=2, update="delta"),
        SGDOptimizer(lr=0.05),
    ),
    (PSStrategy(consistency="bsp", num_servers=2, update="delta"), AdamOptimizer(lr=0.01)),
]


@pytest.mark.parametrize(
    "strategy, optimizer", CASES, ids=["bsp", "asp", "ssp2", "wsp0", "wsp1-delta", "bsp-delta-adam"]
)
def test_pssync_three_workers_train_and_the_loss_falls(strategy, optimizer) -> None:
    x, y = _data()
    cfgs = [
        shard_config_from(ps_config_from(strategy, optimizer), num_workers=3, shard_index=i)
        for i in range(strategy.num_servers)
    ]
    reference = _model()
    with torch.no_grad():
        loss0 = nn.functional.cross_entropy(reference(x), y).item()
    with servers(cfgs) as srvs:
        models = [_model() for _ in range(3)]
        syncs = [
            _pssync(m, optimizer, strategy, [s.address for s in srvs], w, num_workers=3, options=FAST)
            for w, m in enumerate(models)
        ]

        errors = _run_workers(
            lambda w: _train(syncs[w], models[w], x, y, w, num_clocks=25, global_batch=48), syncs
        )
        final = models[0]
        assert not errors, errors
        assert all(s.store.version == 25 * 3 for s in srvs)
    with torch.no_grad():
        loss1 = nn.functional.cross_entropy(final(x), y).item()
    assert loss1 < 0.6 * loss0, (loss0, loss1)


def _straggler_pair(strategy: PSStrategy, finish, names: list[str]):
    """Two workers (w1 the straggler) train 30 clocks with ``push_pull``, then ``finish(sync)``.
    Returns ``(seen, models, plain_pulls, loss0)``: per worker ``(clock, read_c_global, pulled)``
    before each clock, the models, the servers' ``ps.pull`` count and the initial loss; checks
    that nothing failed and every push was applied once."""
    x, y = _data()
    optimizer = SGDOptimizer(lr=0.1, momentum=0.5)
    cfgs = [
        shard_config_from(ps_config_from(strategy, optimizer), num_workers=2, shard_index=i) for i in range(2)
    ]
    with torch.no_grad():
        loss0 = nn.functional.cross_entropy(_model()(x), y).item()
    seen: dict[int, list[tuple[int, int, bool]]] = {0: [], 1: []}
    with servers(cfgs, names=names) as srvs:
        models = [_model() for _ in range(2)]
        syncs = [
            _pssync(m, optimizer, strategy, [s.address for s in srvs], w, num_workers=2, options=FAST)
            for w, m in enumerate(models)
        ]

        def run(w: int) -> None:
            sync, model = syncs[w], models[w]
            sync.initialize()
            gen = torch.Generator().manual_seed(7 + w)
            for clock in range(30):
                seen[w].append((clock, sync.read_c_global, sync.pulled))
                idx = torch.randint(0, x.shape[0], (24,), generator=gen)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum") / 48
                loss.backward()
                if w == 1:
                    time.sleep(0.01)  # the straggler
                sync.push_pull(clock)
            finish(sync)

        errors = _run_workers(run, syncs)
        assert not errors, errors
        assert all(s.store.version == 30 * 2 for s in srvs)  # every push applied once
        pulls = sum(s.op_counts["ps.pull"] for s in srvs)
    assert all(s.read_ahead is (strategy.read_ahead and strategy.consistency.kind != "bsp") for s in syncs)
    return seen, models, pulls, loss0


def _final_loss(model: nn.Module) -> float:
    x, y = _data()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


@pytest.mark.parametrize("consistency, staleness", [("ssp", 2), ("bsp", 0)])
def test_cached_reads_skip_pulls_only_within_the_ssp_bound(consistency: str, staleness: int) -> None:
    """A slow and a fast worker with ``cached_reads``: every clock's weights contain every
    worker's updates for clocks < read_c_global, read_c_global >= clock - s holds for every clock,
    SSP skips pulls (pushes then go out asynchronously, applied exactly once) and BSP never does;
    the loss still falls."""
    strategy = PSStrategy(
        consistency=consistency, staleness=staleness, num_servers=2, chunk_bytes=256, cached_reads=True
    )
    seen, models, _, loss0 = _straggler_pair(
        strategy, lambda sync: sync.refresh(30), [f"cr-{consistency}-a", f"cr-{consistency}-b"]
    )
    for w in (0, 1):
        for clock, read, _ in seen[w]:
            assert read >= clock - staleness, (w, clock, read)
    skipped = sum(not pulled for w in (0, 1) for _, _, pulled in seen[w])
    if consistency == "bsp":
        assert skipped == 0
    else:
        assert skipped > 10, seen
    loss1 = _final_loss(models[0])
    assert loss1 < 0.6 * loss0, (loss0, loss1)


@pytest.mark.parametrize("consistency, staleness", [("ssp", 2), ("asp", 0), ("bsp", 0)])
def test_read_ahead_overlaps_the_next_pull_and_keeps_the_ssp_bound(consistency: str, staleness: int) -> None:
    """A slow and a fast worker with ``read_ahead``: under SSP/ASP every clock's weights were
    pulled before the previous clock's push (so the pull overlapped that clock's compute), SSP's
    bound ``read_c_global >= clock - s`` holds for every clock, every push is applied once, the
    loss falls; BSP cannot read ahead and ignores the option."""
    strategy = PSStrategy(
        consistency=consistency, staleness=staleness, num_servers=2, chunk_bytes=256, read_ahead=True
    )
    seen, models, pulls, loss0 = _straggler_pair(
        strategy, lambda sync: sync.pull_final(30), [f"ra-{consistency}-a", f"ra-{consistency}-b"]
    )
    for w in (0, 1):
        for clock, read, _ in seen[w]:
            if consistency == "ssp":
                assert read >= clock - staleness, (w, clock, read)
            if consistency == "bsp":
                assert read == clock, (w, clock, read)  # a pull after every push
        if consistency != "bsp":  # at clock k the weights came from before the push of k - 1
            assert all(read <= clock - 1 for clock, read, _ in seen[w][1:]), seen[w]
    # plain pulls, per worker and shard: initialize, the final pull and (read-ahead) clock 0's
    assert pulls == 2 * 2 * (3 if consistency != "bsp" else 2), pulls
    loss1 = _final_loss(models[0])
    assert loss1 < 0.6 * loss0, (loss0, loss1)


@pytest.mark.parametrize("consistency", ["ssp", "asp"])
def test_read_ahead_with_one_worker_is_plain_sgd(consistency: str, caplog) -> None:
    """One worker, no momentum: the weights it computes clock k+1 on (pulled during clock k,
    plus its own clock-k step applied locally) are exactly SGD's; the final global weights equal
    ``torch.optim.SGD`` on the same minibatches up to float rounding.  Worker 0 warns that reads
    are staler."""
    x, y = _data()
    strategy = PSStrategy(
        consistency=consistency, staleness=1, num_servers=2, chunk_bytes=256, read_ahead=True
    )
    optimizer = SGDOptimizer(lr=0.2, momentum=0.0)
    cfgs = [
        shard_config_from(ps_config_from(strategy, optimizer), num_workers=1, shard_index=i) for i in range(2)
    ]
    model, reference = _model(), _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, x.shape[0], (32,), generator=gen) for _ in range(20)]
    with servers(cfgs, names=[f"ra1-{consistency}-a", f"ra1-{consistency}-b"]) as srvs:
        with caplog.at_level(logging.WARNING, logger="flotilla"):
            sync = _pssync(
                model, optimizer, strategy, [s.address for s in srvs], 0, num_workers=1, options=FAST
            )
        assert "strategy.read_ahead: every read is up to one clock staler" in caplog.text
        try:
            sync.initialize()
            for clock, idx in enumerate(batches):
                for m in (model, reference):
                    nn.functional.cross_entropy(m(x[idx]), y[idx]).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                sync.push_pull(clock)
                if clock:
                    assert sync.read_c_global == clock  # pulled before the push of `clock`
                for p, q in zip(model.parameters(), reference.parameters()):
                    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
            sync.pull_final(len(batches))
        finally:
            sync.close()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)


@contextlib.contextmanager
def _trained_then_restarted_empty(strategy: PSStrategy, names: list[str]):
    """One worker trains 3 clocks against 2 shards, then the shards restart with all state lost
    (same addresses); yields ``(sync, model, fresh servers)`` and closes the sync afterwards."""
    x, y = _data()
    optimizer = SGDOptimizer(lr=0.1)
    cfgs = [
        shard_config_from(ps_config_from(strategy, optimizer), num_workers=1, shard_index=i) for i in range(2)
    ]
    model = _model()
    opts = ClientOptions(pull_timeout_s=10.0, attempt_timeout_s=0.5)
    with servers(cfgs, names=names):
        sync = _pssync(
            model, optimizer, strategy, [f"mem://{n}" for n in names], 0, num_workers=1, options=opts
        )
        _train(sync, model, x, y, 0, num_clocks=3, global_batch=48)
        sync.client.wait_pushes()  # nothing in flight when the shards go
    with servers(cfgs, names=names) as fresh:
        try:
            yield sync, model, fresh
        finally:
            sync.close()


def test_a_server_restarted_without_snapshot_is_reseeded_by_the_workers() -> None:
    x, y = _data()
    with _trained_then_restarted_empty(PSStrategy(consistency="bsp", num_servers=2), ["rs-a", "rs-b"]) as (
        sync,
        model,
        fresh,
    ):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        sync.pull(3)  # restarted -> hello -> not_initialized -> seed
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        sync.push(3)
        sync.pull(4)
        assert [s.store.version for s in fresh] == [1, 1]
        assert [s.store.clock_of(0) for s in fresh] == [4, 4]


def test_an_async_push_to_a_shard_that_lost_its_state_reseeds_on_the_callers_thread() -> None:
    """The pool thread never reads the live weights: ``wait_pushes`` seeds the shard from them
    (they already hold the worker's own update) and moves the shard's clock for the worker past
    the push, so the update is not applied twice."""
    x, y = _data()
    strategy = PSStrategy(consistency="ssp", staleness=2, num_servers=2, cached_reads=True)
    with _trained_then_restarted_empty(strategy, ["ar-a", "ar-b"]) as (sync, model, fresh):
        nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        assert sync.push_pull(3) is False  # cached: async push, own step
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        sync.client.wait_pushes()  # reseeds from `after`
        assert [s.store.version for s in fresh] == [0, 0]  # seeded, the push not applied
        assert [s.store.clock_of(0) for s in fresh] == [4, 4]
        sync.pull(4)
        assert all(torch.equal(p, after[n]) for n, p in model.named_parameters())


def test_a_read_ahead_request_to_a_shard_that_lost_its_state_reseeds_on_the_callers_thread() -> None:
    """The fused [push c, pull c + 2] fails on shards restarted empty: ``wait_pushes`` seeds them
    from the caller's weights (which hold its clock-c update), moves their clock for the worker
    past the push (not applied twice) and pulls the read-ahead part, so training goes on."""
    x, y = _data()
    strategy = PSStrategy(consistency="ssp", staleness=2, num_servers=2, read_ahead=True)
    optimizer = SGDOptimizer(lr=0.1)
    names = ["rar-a", "rar-b"]
    cfgs = [
        shard_config_from(ps_config_from(strategy, optimizer), num_workers=1, shard_index=i) for i in range(2)
    ]
    model = _model()
    sync = _pssync(
        model,
        optimizer,
        strategy,
        [f"mem://{n}" for n in names],
        0,
        num_workers=1,
        options=ClientOptions(pull_timeout_s=10.0, attempt_timeout_s=0.5),
    )
    try:
        with servers(cfgs, names=names):
            sync.initialize()
            for clock in range(3):
                nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
                sync.push_pull(clock)
            sync.client.wait_pushes()  # nothing in flight when the shards go
        with servers(cfgs, names=names) as fresh:
            nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
            sync.push_pull(3)  # uses the reply held; the request fails
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
            sync.client.wait_pushes()  # reseeds from `after`, pulls for clock 5
            assert [s.store.version for s in fresh] == [0, 0]  # seeded, the push not applied
            assert [s.store.clock_of(0) for s in fresh] == [4, 4]
            assert all(torch.equal(sync.staging.target("ahead")[n], after[n]) for n in after)
            nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
            sync.push_pull(4)
            sync.pull_final(5)
            assert [s.store.version for s in fresh] == [1, 1]
    finally:
        sync.close()
