"""The buffer policy of ``allreduce`` (``sync/buffers.py``) on real gloo groups: a BatchNorm model's
replicas hold identical state_dicts (parameters AND running statistics) after every committed
step, the running statistics are the mean of the replicas' (integers: rank 0's), and a discarded
step leaves the buffers as they were before it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.faults import Fault, FaultInjector, FaultPlan
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.sync.state import export_state, import_state, model_digest
from flotilla.trainer.step import run_step

pytestmark = pytest.mark.timeout(120)


def bn_model() -> nn.Module:
    g = torch.Generator().manual_seed(0)  # (not the global generator: replicas are threads)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def data(n: int = 240) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g) * torch.arange(1, 7)  # shards with clearly different stats
    return x, (x[:, 0] > 0).long()


def run(
    num_workers: int,
    num_steps: int,
    *,
    batch: int = 24,
    plan: FaultPlan = FaultPlan(),
    per_step: Callable[[int, int, nn.Module, bool], None] | None = None,
) -> dict[int, list[tuple[int, bool, str]]]:
    """Per worker, ``(step, committed, digest)`` of every attempted step (a discarded step is redone)."""
    host = StoreHost("127.0.0.1")
    x, y = data()
    log: dict[int, list[tuple[int, bool, str]]] = {w: [] for w in range(num_workers)}
    errors: dict[int, BaseException] = {}

    def worker(w: int) -> None:
        try:
            faults = FaultInjector(plan, str(w))
            group = EpochGroup(
                connect_store(host.address), epoch=1, rank=w, world_size=num_workers, timeout_s=20,
                faults=faults,
            )  # fmt: skip
            model = bn_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            sync = BucketedAllReduce(model, bucket_bytes=128, optimizer=opt)
            sync.bind(group)
            step = 0
            while step < num_steps:
                idx = torch.arange(step * batch, (step + 1) * batch) % x.shape[0]
                mine = idx.tensor_split(num_workers)[w]
                faults.unit_started(step)
                res = run_step(model, sync, x[mine], y[mine], step=step, global_batch=batch)
                assert not res.decision.broken, res.decision.reason
                if per_step is not None:
                    per_step(w, step, model, res.decision.committed)
                log[w].append((step, res.decision.committed, model_digest(model)))
                step += int(res.decision.committed)
            sync.close()
            group.close()
        except BaseException as exc:  # reported below
            errors[w] = exc

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    host.close()
    assert not any(t.is_alive() for t in threads), "replica threads hung"
    assert not errors, errors
    return log


def test_batchnorm_replicas_hold_one_state_after_every_committed_step() -> None:
    log = run(3, 6)
    for i in range(6):
        digests = {log[w][i][2] for w in range(3)}
        assert all(log[w][i][1] for w in range(3))
        assert len(digests) == 1, f"step {i}: {len(digests)} distinct digests over 3 replicas"


def test_the_running_statistics_are_the_mean_of_the_replicas_and_the_counter_rank0s() -> None:
    """One step from a fresh model: each replica's BatchNorm sees only its shard; the committed
    running mean is the mean of the three shards' updates (momentum 0.1 from zero)."""
    x, _ = data()
    shards = torch.arange(24).tensor_split(3)
    with torch.no_grad():
        h = [bn_model()[0](x[s]) for s in shards]
    expected_mean = torch.stack([0.1 * t.mean(0) for t in h]).double().mean(0).float()
    seen: dict[int, nn.Module] = {}
    run(3, 1, per_step=lambda w, _s, m, _c: seen.__setitem__(w, m))
    for w in range(3):
        bn = seen[w][1]
        torch.testing.assert_close(bn.running_mean, expected_mean, rtol=1e-6, atol=1e-7)
        assert int(bn.num_batches_tracked) == 1
    # (without the policy, replica 0 would hold its own shard's statistics only)
    assert not torch.allclose(seen[0][1].running_mean, 0.1 * h[0].mean(0), atol=1e-4)


def test_a_discarded_step_leaves_the_buffers_as_before_it() -> None:
    """Step 2 fails on worker 1 once and is redone: afterwards every replica's BatchNorm counter
    says 3 batches after 3 committed steps, and the state equals that of an undisturbed run."""
    plan = FaultPlan((Fault(worker="1", step=2, phase="sync", action="fail"),))  # (fires once)
    before: dict[int, list[torch.Tensor]] = {}

    def per_step(w: int, step: int, model: nn.Module, committed: bool) -> None:
        if step == 1 and committed:
            before[w] = [b.clone() for b in model.buffers()]
        if step == 2 and not committed:  # discarded: buffers exactly as after step 1
            for a, b in zip(before[w], model.buffers(), strict=True):
                assert torch.equal(a, b)

    disturbed = run(3, 3, plan=plan, per_step=per_step)
    assert [c for _s, c, _d in disturbed[1]] == [True, True, False, True]
    clean = run(3, 3)
    assert {disturbed[w][-1][2] for w in range(3)} == {clean[0][-1][2]}


def test_a_newcomer_receives_the_buffers_with_the_state() -> None:
    """The state a donor hands a joining worker (``sync/state.export_state``) carries the running
    statistics and the counter, so the newcomer's digest equals the donor's."""
    donor, newcomer = bn_model(), bn_model()
    opt_d = torch.optim.SGD(donor.parameters(), lr=0.1, momentum=0.9)
    opt_n = torch.optim.SGD(newcomer.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    for _ in range(3):
        opt_d.zero_grad()
        nn.functional.cross_entropy(donor(x[:24]), y[:24]).backward()
        opt_d.step()
    assert int(donor[1].num_batches_tracked) == 3 and model_digest(donor) != model_digest(newcomer)
    meta, tensors = export_state(donor, opt_d, {"step": 3})
    import_state(newcomer, opt_n, meta, tensors)
    assert torch.equal(newcomer[1].running_mean, donor[1].running_mean)
    assert torch.equal(newcomer[1].running_var, donor[1].running_var)
    assert int(newcomer[1].num_batches_tracked) == 3
    assert model_digest(newcomer) == model_digest(donor)
