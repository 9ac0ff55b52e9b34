"""ShardStore (update rules, validation, versions, clocks, gate); snapshots: test_ps_snapshot.py."""

from __future__ import annotations

import pytest
import torch

from flotilla.config.schema import AdamOptimizer, PSStrategy, SGDOptimizer
from flotilla.core.errors import ConfigError, RemoteError
from flotilla.ps.consistency import ASP, BSP, SSP, WSP
from flotilla.ps.server import shard_config_from
from flotilla.ps.sharding import KeySpec
from flotilla.ps.store import DeltaUpdate, ServerSGD, ShardConfig, ShardStore
from flotilla.sync.ps_settings import ps_config_from

pytestmark = pytest.mark.timeout(30)
KEYS = (KeySpec.of("w", (40,), "float32"), KeySpec.of("b", (6,), "float32"))


def make(
    update=DeltaUpdate(), consistency=BSP(), num_workers=2, chunk_bytes=64, keys=KEYS, seed=True
) -> ShardStore:
    store = ShardStore(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            num_workers=num_workers,
            consistency=consistency,
            update=update,
            chunk_bytes=chunk_bytes,
        )
    )
    if seed:
        layout = store.make_layout(keys)
        ids = list(layout.chunk_ids)
        vals = [torch.arange(layout.plan.chunks[c].num_elems, dtype=torch.float32) for c in ids]
        assert store.seed(list(keys), ids, vals)
        for w in range(num_workers):
            store.hello(w, 0, resync=False)
    return store


def ids_of(store: ShardStore) -> list[int]:
    return list(store.layout.chunk_ids)


def ones(store: ShardStore, value: float = 1.0) -> list[torch.Tensor]:
    return [torch.full((store.layout.plan.chunks[c].num_elems,), value) for c in ids_of(store)]


def test_seed_splits_keys_into_chunks_and_is_idempotent() -> None:
    store = make()
    assert len(ids_of(store)) == 4  # 40 floats at 16 per chunk -> 3 chunks, plus b
    assert not store.seed(list(KEYS), ids_of(store), ones(store))
    tensors, versions = store.read(ids_of(store))
    assert tensors[0].tolist() == list(range(14)) and versions == [0, 0, 0, 0]


def test_seed_with_another_layout_is_refused() -> None:
    store = make()
    with pytest.raises(RemoteError) as err:
        store.seed([KeySpec.of("w", (41,), "float32")], [0], [torch.zeros(41)])
    assert err.value.code == "layout"


def test_delta_push_adds_and_counts_versions() -> None:
    store = make(consistency=ASP())  # (a BSP read serves the last fold: test_versioned_reads.py)
    before, _ = store.read(ids_of(store))
    result = store.push(0, 0, 0, ids_of(store), ones(store, 2.0))
    assert result.applied and result.version == 1 and result.clock == 1
    after, versions = store.read(ids_of(store))
    assert all(torch.equal(a, b + 2) for a, b in zip(after, before))
    assert versions == [1, 1, 1, 1]
    assert before[0].tolist() == list(range(14))  # published tensors are never mutated


def test_retried_push_is_acknowledged_not_applied() -> None:
    store = make()
    store.push(0, 0, 0, ids_of(store), ones(store))
    digest = store.digest()
    again = store.push(0, 0, 0, ids_of(store), ones(store))
    assert not again.applied and again.version == 1 and store.digest() == digest


@pytest.mark.parametrize(
    "change, code",
    [
        (dict(worker=7), "unknown_worker"),
        (dict(clock=3), "bad_clock"),
        (dict(clock=-5), "bad_clock"),
        (dict(base_version=-1), "bad_version"),
        (dict(base_version=99), "bad_version"),
        (dict(chunks=[0, 0, 1, 2]), "bad_key"),
        (dict(chunks=[0, 1, 2, 99]), "bad_key"),
        (dict(chunks=[]), "bad_key"),
        (dict(value=float("nan")), "bad_value"),
        (dict(value=float("inf")), "bad_value"),
        (dict(dtype=torch.float64), "bad_value"),
        (dict(short=True), "bad_value"),
    ],
)
def test_bad_pushes_change_nothing(change: dict, code: str) -> None:
    store = make()
    digest = store.digest()
    tensors = ones(store, change.get("value", 1.0))
    if "dtype" in change:
        tensors[1] = tensors[1].to(change["dtype"])
    if change.get("short"):
        tensors[2] = tensors[2][:-1]
    with pytest.raises(RemoteError) as err:
        store.push(
            change.get("worker", 0),
            change.get("clock", 0),
            change.get("base_version", 0),
            change.get("chunks", ids_of(store)),
            tensors,
        )
    assert err.value.code == code
    assert store.digest() == digest and store.version == 0


@pytest.mark.parametrize(
    "momentum, weight_decay, nesterov",
    [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.01, True), (0.5, 0.1, False)],
)
def test_server_sgd_matches_the_torch_sgd_formula(
    momentum: float, weight_decay: float, nesterov: bool
) -> None:
    rule = ServerSGD(lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    store = make(update=rule, num_workers=1, keys=(KeySpec.of("w", (40,), "float32"),), chunk_bytes=1024)
    (w0,), _ = store.read(ids_of(store))
    ref, buf = w0.clone().double(), None  # torch.optim.SGD's documented update, naively
    gen = torch.Generator().manual_seed(0)
    for clock in range(5):
        g = torch.randn(40, generator=gen)
        store.push(0, clock, store.version, ids_of(store), [g])
        d = g.double() + weight_decay * ref
        if momentum:
            buf = d.clone() if buf is None else momentum * buf + d
            d = d + momentum * buf if nesterov else buf
        ref = ref - 0.1 * d
    (w,), _ = store.read(ids_of(store))
    assert torch.allclose(w, ref.float(), rtol=1e-5, atol=1e-6), (w - ref.float()).abs().max()


@pytest.mark.parametrize(
    "momentum, weight_decay, nesterov", [(0.9, 0.0, False), (0.9, 0.05, True), (0.5, 0.1, False)]
)
def test_bsp_pushes_of_a_clock_make_one_torch_sgd_step_on_their_sum(
    momentum: float, weight_decay: float, nesterov: bool
) -> None:
    """Three workers push every clock in a shuffled order; after each clock the shard's weights
    equal torch.optim.SGD run on the summed (global-batch) gradient: momentum and weight decay act
    once per global clock, not once per push."""
    rule = ServerSGD(lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    store = make(update=rule, num_workers=3, keys=(KeySpec.of("w", (40,), "float32"),), chunk_bytes=64)
    w0 = torch.cat(store.read(ids_of(store))[0])
    param = torch.nn.Parameter(w0.clone().double())
    opt = torch.optim.SGD([param], lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    gen = torch.Generator().manual_seed(1)
    for clock in range(6):
        grads = [torch.randn(40, generator=gen) for _ in range(3)]
        for worker in torch.randperm(3, generator=gen).tolist():
            parts = list(grads[worker].split([store.layout.plan.chunks[c].num_elems for c in ids_of(store)]))
            store.push(worker, clock, store.version, ids_of(store), parts)
        param.grad = torch.stack(grads).sum(0).double()
        opt.step()
        assert store.table.c_global == clock + 1
        w = torch.cat(store.read(ids_of(store))[0])
        assert torch.allclose(w.double(), param.detach(), rtol=1e-5, atol=1e-6), clock


def test_pushes_ahead_of_the_global_clock_apply_at_once_and_fold_once_per_global_clock() -> None:
    rule = ServerSGD(lr=0.1, momentum=0.9)
    store = make(
        update=rule,
        num_workers=2,
        consistency=SSP(staleness=3),
        keys=(KeySpec.of("w", (4,), "float32"),),
        chunk_bytes=64,
    )
    (w0,), _ = store.read(ids_of(store))
    for clock in range(3):  # worker 0 runs 3 clocks ahead
        store.push(0, clock, store.version, ids_of(store), [torch.ones(4)])
    (w,), _ = store.read(ids_of(store))
    assert torch.allclose(w, w0 - 0.3)  # read-my-writes: applied at once
    assert store.momentum == [None] and store.table.c_global == 0  # nothing folded yet
    store.push(1, 0, store.version, ids_of(store), [torch.full((4,), 2.0)])
    assert store.table.c_global == 1
    assert torch.allclose(store.momentum[0], torch.full((4,), 5.0))  # 3·1 + 2, folded once
    (w,), _ = store.read(ids_of(store))
    assert torch.allclose(w, w0 - 0.5)  # no momentum term before the first fold
    store.push(1, 1, store.version, ids_of(store), [torch.zeros(4)])
    (w,), _ = store.read(ids_of(store))
    # Its 1/N share of clock 1's momentum step, then the fold (c_global 1 -> 2) applies the rest.
    assert torch.allclose(w, w0 - 0.5 - 0.1 * 0.9 * 5.0)
    assert torch.allclose(store.momentum[0], torch.full((4,), 4.5))  # clock 1 folded: 0.9·5 + 0
    # Worker 0, two clocks ahead, pushes twice: together at most one momentum step per clock.
    store.push(0, 3, store.version, ids_of(store), [torch.zeros(4)])
    store.push(0, 4, store.version, ids_of(store), [torch.zeros(4)])
    (w2,), _ = store.read(ids_of(store))
    assert torch.allclose(w2, w - 0.1 * 0.9 * 4.5)  # 1/2 + 1/2 of the step, then no more
    store.push(0, 5, store.version, ids_of(store), [torch.zeros(4)])
    assert torch.equal(store.read(ids_of(store))[0][0], w2)


def test_gate_waits_for_every_worker_to_join_and_push() -> None:
    store = make(seed=False, num_workers=2)
    store.hello(0, 0, resync=False)
    assert store.may_serve(0, 0) is False  # worker 1 has not joined yet
    store.hello(1, 0, resync=False)
    assert store.may_serve(0, 0)
    layout = store.make_layout(KEYS)
    store.seed(
        list(KEYS),
        list(layout.chunk_ids),
        [torch.zeros(layout.plan.chunks[c].num_elems) for c in layout.chunk_ids],
    )
    store.push(0, 0, 0, ids_of(store), ones(store))
    assert not store.may_serve(0, 1)  # BSP: worker 1 has not pushed clock 0
    store.push(1, 0, 0, ids_of(store), ones(store))
    assert store.may_serve(0, 1)
    with pytest.raises(RemoteError) as err:
        store.may_serve(0, 2)  # a pull for a clock not reached yet
    assert err.value.code == "bad_clock"


@pytest.mark.parametrize(
    "model, servable",
    [(ASP(), True), (SSP(staleness=1), True), (BSP(), False), (WSP(s_local=2, clock_distance=0), False)],
)
def test_gate_per_model(model, servable: bool) -> None:
    store = make(consistency=model)
    store.push(0, 0, 0, ids_of(store), ones(store))
    assert store.may_serve(0, 1) is servable


def test_membership_full_table_left_workers_and_resync() -> None:
    store = make(num_workers=2)
    with pytest.raises(RemoteError) as err:  # a join mid-run more than JOIN_LEAD ahead of all
        store.hello(5, 4, resync=False)
    assert err.value.code == "bad_clock"
    assert store.hello(0, 4, resync=False) == 0  # no silent clock jumps
    assert store.hello(0, 4, resync=True) == 4  # after a restart the worker's clock wins
    assert store.table.c_global == 0
    store.leave(1)
    assert store.table.c_global == 4 and store.complete
    with pytest.raises(RemoteError):
        store.hello(1, 0, resync=False)
    # a join mid-run starts at c_global; on shard 0 at the start of its data view (max + 2)
    assert store.config.shard_index == 0 and store.hello(5, 0, resync=False) == 6
    assert store.evict(5) and not store.evict(5) and not store.evict(7)  # unknown/departed: no-op
    assert store.table.as_dict() == {0: 4}


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="shard_index"):
        ShardConfig(shard_index=2, num_shards=2, num_workers=1, consistency=BSP(), update=DeltaUpdate())
    with pytest.raises(ConfigError, match="momentum"):
        ServerSGD(lr=0.1, momentum=1.5)
    with pytest.raises(ConfigError, match="nesterov"):
        ServerSGD(lr=0.1, nesterov=True)


def test_shard_config_from_strategy() -> None:
    cfg = shard_config_from(
        ps_config_from(
            PSStrategy(consistency="ssp", staleness=2, num_servers=3), SGDOptimizer(lr=0.2, momentum=0.5)
        ),
        num_workers=4,
        shard_index=1,
    )
    assert cfg.consistency == SSP(staleness=2) and cfg.update == ServerSGD(lr=0.2, momentum=0.5)
    assert (cfg.num_shards, cfg.num_workers, cfg.shard_index) == (3, 4, 1)
    with pytest.raises(ConfigError, match="update"):
        ps_config_from(PSStrategy(), AdamOptimizer())
    with pytest.raises(ConfigError, match="delta"):
        ps_config_from(PSStrategy(consistency="wsp", s_local=2), SGDOptimizer())
    wsp = shard_config_from(
        ps_config_from(
            PSStrategy(consistency="wsp", s_local=2, update="delta", clock_distance=1), AdamOptimizer()
        ),
        num_workers=1,
        shard_index=0,
    )
    assert wsp.consistency == WSP(s_local=2, clock_distance=1) and wsp.update == DeltaUpdate()


def test_a_departed_workers_momentum_share_is_not_taken() -> None:
    """With 2 workers, after one leaves, a clock's momentum step is half of the full one."""
    store = make(
        update=ServerSGD(lr=0.1, momentum=0.9),
        consistency=SSP(staleness=3),
        keys=(KeySpec.of("w", (4,), "float32"),),
    )
    for worker in (0, 1):
        store.push(worker, 0, store.version, ids_of(store), [torch.ones(4)])
    assert torch.equal(store.momentum[0], torch.full((4,), 2.0))
    store.leave(1)
    (w,), _ = store.read(ids_of(store))
    store.push(0, 1, store.version, ids_of(store), [torch.zeros(4)])
    (w2,), _ = store.read(ids_of(store))
    assert torch.allclose(w2, w - 0.1 * 0.9 * 2.0 / 2)  # 1 share of 2, no remainder
    assert torch.allclose(store.momentum[0], torch.full((4,), 1.8))


def test_a_resync_that_advances_the_global_clock_folds() -> None:
    """After a restart a worker says hello with its acknowledged clock; if that advances c_global
    the clock is folded before any pull is served (momentum buffer formed, shares reset)."""
    store = make(update=ServerSGD(lr=0.1, momentum=0.9), keys=(KeySpec.of("w", (4,), "float32"),))
    store.push(0, 0, store.version, ids_of(store), [torch.ones(4)])
    assert store.table.c_global == 0 and store.momentum == [None]
    store.hello(1, 1, resync=True)  # worker 1's push of clock 0 was acked by a lost shard
    assert store.table.c_global == 1 and store.folded_clock == 1
    assert torch.equal(store.momentum[0], torch.ones(4)) and store.applied == [0]


@pytest.mark.parametrize(
    "model, ahead",
    [
        (ASP(), 1),
        (SSP(staleness=1), 1),
        (SSP(staleness=3), 1),
        (SSP(staleness=0), 0),
        (BSP(), 0),
        (WSP(s_local=0, clock_distance=2), 0),
    ],
)
def test_read_ahead_pulls_one_clock_past_the_own_clock_only_where_the_model_allows(model, ahead: int) -> None:
    """``max_pull_ahead``: SSP(s >= 1) and ASP serve a pull for the worker's own clock + 1,
    gated as any pull (c_global >= clock - s); other models refuse it as ``bad_clock``."""
    store = make(consistency=model)
    store.push(0, 0, 0, ids_of(store), ones(store))  # worker 0 at clock 1, 1 at 0
    if ahead:
        lag = {ASP: None}.get(type(model), getattr(model, "staleness", 0))
        assert store.may_serve(0, 2) is (lag is None or store.table.c_global >= 2 - lag)
    else:
        with pytest.raises(RemoteError) as err:
            store.may_serve(0, 2)
        assert err.value.code == "bad_clock"
    with pytest.raises(RemoteError) as err:
        store.may_serve(0, 3)  # never two clocks ahead
    assert err.value.code == "bad_clock"
