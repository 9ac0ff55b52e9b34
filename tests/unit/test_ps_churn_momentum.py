"""Issue 19, the divergence after repeated kill-and-rejoin cycles: the server's momentum step must
not change with the live count when workers are declared dead (their data slices pass to the
survivors) or join mid-run.  Before the fix the 1/N shares kept N = the job's workers after an
eviction, so each fold took only live/N of the momentum step (the effective learning rate
``lr·(1 + 9f)`` at μ = 0.9 shrank with the live fraction f) and jumped back up when joiners
restored the count; ``examples/ps_ssp.yaml`` with three kill/restart cycles went from loss 0.19
to 1.1 within 40 clocks of the third join.  Here: a shard whose members are evicted and joined
follows ``torch.optim.SGD`` on the sum of each clock's pushes, clock by clock."""

from __future__ import annotations

import pytest
import torch

from flotilla.ps.consistency import BSP
from flotilla.ps.sharding import KeySpec
from flotilla.ps.store import ServerSGD, ShardConfig, ShardStore

pytestmark = pytest.mark.timeout(30)
KEYS = (KeySpec.of("w", (24,), "float32"),)


def _store(num_workers: int, rule: ServerSGD) -> ShardStore:
    store = ShardStore(
        ShardConfig(
            shard_index=0,
            num_shards=1,
            num_workers=num_workers,
            consistency=BSP(),
            update=rule,
            chunk_bytes=32,
        )
    )
    layout = store.make_layout(KEYS)
    ids = list(layout.chunk_ids)
    vals = [torch.linspace(-1, 1, layout.plan.chunks[c].num_elems) for c in ids]
    assert store.seed(list(KEYS), ids, vals)
    for w in range(num_workers):
        store.hello(w, 0, resync=False)
    return store


def _weights(store: ShardStore) -> torch.Tensor:
    assert store.layout is not None
    return torch.cat(store.read(list(store.layout.chunk_ids))[0])


def _push(store: ShardStore, worker: int, clock: int, grad: torch.Tensor) -> None:
    assert store.layout is not None
    ids = list(store.layout.chunk_ids)
    parts = list(grad.split([store.layout.plan.chunks[c].num_elems for c in ids]))
    store.push(worker, clock, store.version, ids, parts)


@pytest.mark.parametrize("nesterov", [False, True])
def test_evictions_and_joins_keep_the_server_optimizer_equal_to_sgd_on_the_clock_sums(nesterov: bool) -> None:
    rule = ServerSGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    store = _store(4, rule)
    param = torch.nn.Parameter(_weights(store).clone().double())
    opt = torch.optim.SGD([param], lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    gen = torch.Generator().manual_seed(3)
    live = [0, 1, 2, 3]
    # kill 3, kill 1, join 7, join 8, kill 0, join 9: the live count goes 4, 3, 2, 3, 4, 3, 4
    churn = {
        3: ("evict", 3),
        6: ("evict", 1),
        9: ("join", 7),
        12: ("join", 8),
        15: ("evict", 0),
        18: ("join", 9),
    }
    for clock in range(21):
        if clock in churn:
            what, w = churn[clock]
            if what == "evict":
                assert store.evict(w)
                live.remove(w)
            else:
                live.append(w)
        if churn.get(clock + 2, ("",))[0] == "join":  # a joiner starts 2 clocks past the table's
            assert store.hello(churn[clock + 2][1], 0, resync=False) == clock + 2  # (data views)
        # the live workers split the global batch: their pushes sum to its gradient
        grads = [torch.randn(24, generator=gen) for _ in live]
        for w, g in zip(live, grads):
            _push(store, w, clock, g)
        param.grad = torch.stack(grads).sum(0).double()
        opt.step()
        assert store.table.c_global == clock + 1
        assert torch.allclose(_weights(store).double(), param.detach(), rtol=1e-5, atol=1e-6), (clock, live)


def test_a_worker_that_leaves_still_takes_its_share_away_but_an_evicted_one_does_not() -> None:
    """Leave (finished early under SSP: nobody takes over its data) scales the momentum step by
    the fraction still in the job; evict (declared dead) does not."""
    rule = ServerSGD(lr=0.1, momentum=0.9)
    steps = {}
    for how in ("leave", "evict"):
        store = _store(2, rule)
        for w in (0, 1):
            _push(store, w, 0, torch.ones(24))  # m = 2 after the fold
        store.leave(1) if how == "leave" else store.evict(1)
        before = _weights(store)
        _push(store, 0, 1, torch.zeros(24))  # the fold of clock 1: only the momentum step
        steps[how] = float((before - _weights(store))[0])
        assert store.share_divisor() == (2 if how == "leave" else 1)
    assert steps["leave"] == pytest.approx(0.1 * 0.9 * 2.0 / 2)
    assert steps["evict"] == pytest.approx(0.1 * 0.9 * 2.0)
