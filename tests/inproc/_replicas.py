"""Thread harness: K data-parallel replicas on real gloo groups inside one process."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from flotilla.comm.collective import EpochGroup, Group
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.faults import FaultInjector, FaultPlan
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.sync.state import model_digest
from flotilla.trainer.step import run_step


def make_model(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_data(num: int = 512, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


class StepFaults:
    """``comm.collective.CollectiveFaults`` for replicas driven by hand: a fault plan's injector
    (worker names are ``str(worker)``), told of every step as the loop's engine would, and ``die``:
    the replica vanishes when it launches that step's second collective."""

    def __init__(self, plan: FaultPlan, worker: int, die_step: int | None) -> None:
        self.injector = FaultInjector(plan, str(worker))
        self.die_step, self.step, self.launches = die_step, -1, 0

    def unit_started(self, step: int) -> None:
        self.step, self.launches = step, 0
        self.injector.unit_started(step)

    def launching(self, group: Group) -> None:
        self.launches += 1
        if self.step == self.die_step and self.launches == 2:
            raise SystemExit  # this replica vanishes mid-step
        self.injector.launching(group)

    def voting(self, group: Group, tensor: Any) -> None:
        self.injector.voting(group, tensor)


def run_replicas(
    num_workers: int,
    num_steps: int,
    *,
    batch: int = 24,
    epoch: int = 1,
    plan: FaultPlan = FaultPlan(),
    on_abort: str = "redo",
    timeout_s: float = 10.0,
    die: tuple[int, int] | None = None,
    wire_dtype: torch.dtype | None = None,
) -> dict:
    """Run replicas; returns per-worker lists of (step, committed, digest) and final digests.

    ``plan``: faults by worker name ``str(worker)`` (``core/faults.py``; a ``fail`` at ``sync``
    fails that worker's vote); ``die=(worker, step)`` makes that worker stop participating in the
    middle of that step (after its first bucket).
    """
    host = StoreHost("127.0.0.1")
    x, y = make_data()
    out: dict = {"log": {w: [] for w in range(num_workers)}, "final": {}, "errors": {}}

    def worker(w: int) -> None:
        store = connect_store(host.address)
        faults = StepFaults(plan, w, die[1] if die is not None and die[0] == w else None)
        group = EpochGroup(
            store, epoch=epoch, rank=w, world_size=num_workers, timeout_s=timeout_s, faults=faults
        )
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sync = BucketedAllReduce(model, bucket_bytes=256, optimizer=opt, wire_dtype=wire_dtype)
        sync.bind(group)
        step = 0
        try:
            while step < num_steps:
                idx = torch.arange(step * batch, (step + 1) * batch) % x.shape[0]
                mine = idx.tensor_split(num_workers)[w]
                faults.unit_started(step)
                res = run_step(model, sync, x[mine], y[mine], step=step, global_batch=batch)
                if res.decision.broken:  # failure is data: the group broke, nothing applied
                    out["errors"][w] = res.decision.reason
                    out["log"][w].append((step, False, model_digest(model)))
                    break
                out["log"][w].append((step, res.decision.committed, model_digest(model)))
                if res.decision.committed or on_abort == "drop":
                    step += 1
        except SystemExit:
            out["errors"][w] = "died"
        finally:
            out["final"][w] = (step, model_digest(model))
            sync.close()
            group.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    host.close()
    assert not any(t.is_alive() for t in threads), "replica threads hung"
    return out
