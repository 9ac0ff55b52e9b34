"""``job.optimizer.clip_grad_norm`` under ``allreduce`` clips the REDUCED gradient (the global
batch's mean gradient), not each replica's: 3 replicas on real gloo groups end with the weights of
single-process training on the whole batch with ``clip_grad_norm_``, up to float rounding, and
differ clearly from replicas that would clip their own shard's gradient."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.trainer.optim import clip_before_step
from flotilla.trainer.step import run_step

pytestmark = pytest.mark.timeout(120)
MAX_NORM, LR, STEPS, BATCH = 0.05, 0.5, 5, 24


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * BATCH, 6, generator=g)
    return x, torch.randint(0, 3, (STEPS * BATCH,), generator=g)


def replicas(num_workers: int) -> list[nn.Module]:
    host = StoreHost("127.0.0.1")
    x, y = data()
    models = [make_model() for _ in range(num_workers)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            store = connect_store(host.address)
            group = EpochGroup(store, epoch=1, rank=w, world_size=num_workers, timeout_s=20)
            opt = torch.optim.SGD(models[w].parameters(), lr=LR)
            clip_before_step(opt, MAX_NORM)
            sync = BucketedAllReduce(models[w], bucket_bytes=128, optimizer=opt)
            sync.bind(group)
            for s in range(STEPS):
                mine = torch.arange(s * BATCH, (s + 1) * BATCH).tensor_split(num_workers)[w]
                assert run_step(
                    models[w], sync, x[mine], y[mine], step=s, global_batch=BATCH
                ).decision.committed
            sync.close()
            group.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    host.close()
    assert not errors, errors
    return models


def single(clip_shards: int = 0) -> nn.Module:
    """One process on the whole batch; ``clip_shards`` > 0: each shard's gradient clipped alone
    and then summed (what clipping before the all-reduce would do)."""
    x, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        idx = torch.arange(s * BATCH, (s + 1) * BATCH)
        opt.zero_grad()
        if clip_shards:
            total = [torch.zeros_like(p) for p in model.parameters()]
            for part in idx.tensor_split(clip_shards):
                model.zero_grad()
                (nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum") / BATCH).backward()
                nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                for t, p in zip(total, model.parameters(), strict=True):
                    t += p.grad
            for t, p in zip(total, model.parameters(), strict=True):
                p.grad = t
        else:
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            assert float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)) > MAX_NORM
        opt.step()
    return model


def test_replicas_clip_the_reduced_gradient() -> None:
    models, ref, per_shard = replicas(3), single(), single(clip_shards=3)
    for m in models:
        for a, b in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    gap = max(
        float((a - b).detach().abs().max())
        for a, b in zip(ref.parameters(), per_shard.parameters(), strict=True)
    )
    assert gap > 1e-3  # (clipping each shard would have trained other weights)
