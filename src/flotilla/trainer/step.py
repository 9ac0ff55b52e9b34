"""One data-parallel training step with the atomic-commit rule (SPEC §4, §7).

``run_step`` is the only code path that changes a replica's parameters in the ``allreduce``
strategy: forward, backward (buckets reduced while it runs), vote, and only then write-back and
optimizer step.  The worker loop and the tests both call it, so the tests prove the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.sync.allreduce import BucketedAllReduce, Decision


@dataclass(frozen=True, slots=True)
class StepResult:
    decision: Decision
    loss: float  # mean loss over this worker's samples
    num_samples: int
    compute_s: float  # real compute measured on this worker
    emulated_s: float  # delay added by speed emulation


def run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sync: BucketedAllReduce,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    step: int,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    pending_epoch: int = 0,
    stop: bool = False,
) -> StepResult:
    """Compute, synchronise and (if every worker agrees) apply one step.

    The local loss is ``sum(CE) / global_batch`` so the SUM all-reduce gives the global mean.
    Raises :class:`~flotilla.core.errors.CollectiveError` if the group broke; nothing was applied.
    """
    optimizer.zero_grad(set_to_none=True)
    sync.begin_step(step)
    if emulator is not None:
        emulator.reset_counters()
        emulator.start()
    n = int(y.shape[0])
    if n:
        out = model(x)
        loss_sum = nn.functional.cross_entropy(out, y, reduction="sum")
        if emulator is not None:
            emulator.mark()  # stretch the forward pass
        (loss_sum / global_batch).backward()
        loss = loss_sum.item() / n
    else:  # more workers than samples in this (last) batch
        loss = float("nan")
    if emulator is not None:
        emulator.mark()  # stretch the rest of backward
    decision = sync.synchronize(pending_epoch=pending_epoch, stop=stop)
    if decision.committed:
        sync.write_back()
        optimizer.step()
    compute_s, emulated_s = emulator.reset_counters() if emulator is not None else (0.0, 0.0)
    return StepResult(decision=decision, loss=loss, num_samples=n, compute_s=compute_s, emulated_s=emulated_s)
