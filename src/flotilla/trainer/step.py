"""One data-parallel training step (or commit unit) over any :class:`~flotilla.sync.base.SyncStrategy`,
with the atomic-commit rule (SPEC §4, §7), and the job's loss.

``run_unit`` is the only code path that changes a replica's parameters: for each minibatch of the
unit ``begin_step``, forward, backward (all-reduce buckets are reduced while it runs), then
``local_step`` between minibatches and ``synchronize`` at the end, which applies the update only
if it commits.  The worker loop and the tests both call it, so the tests prove the real thing.

The loss is the sum of the task's loss over the local samples (``loss_fn``, see
:func:`summed_loss`; summed cross-entropy by default) divided by ``global_batch``: the SUM of every
worker's gradients is then exactly the global-batch mean gradient however the batch is split,
and an epoch's short last batch makes a proportionally short step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.sync.base import Outcome, SyncStrategy

__all__ = ["LossFn", "Minibatch", "StepResult", "run_step", "run_unit", "summed_loss"]


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(output, target) -> the SUM of the loss over the batch's samples`` (scalar tensor)."""


def summed_loss(task: object) -> LossFn:
    """The task's loss summed over a batch: its ``loss_sum`` if it has one (exact summation, as
    the zoo's classification tasks), else ``loss`` (a batch mean) times the batch size."""
    exact = getattr(task, "loss_sum", None)
    if callable(exact):
        return exact
    mean = task.loss  # type: ignore[attr-defined]

    def total(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mean(output, target) * int(target.shape[0])

    return total


@dataclass(frozen=True, slots=True)
class Minibatch:
    step: int
    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepResult:
    decision: Outcome
    loss: float  # mean loss over this worker's samples of the unit
    num_samples: int
    compute_s: float  # real compute measured on this worker
    emulated_s: float  # delay added by speed emulation


def _forward_backward(
    model: nn.Module,
    sync: SyncStrategy,
    mb: Minibatch,
    global_batch: int,
    emulator: SpeedEmulator | None,
    loss_fn: LossFn | None,
) -> float:
    """Sum of the losses of ``mb``'s samples (nan-free 0.0 if it is empty)."""
    sync.begin_step(mb.step)
    if emulator is not None:
        emulator.start()
    loss_sum = 0.0
    if int(mb.y.shape[0]):
        out = model(mb.x)
        if loss_fn is None:
            loss_t = nn.functional.cross_entropy(out, mb.y, reduction="sum")
        else:
            loss_t = loss_fn(out, mb.y)
        if emulator is not None:
            emulator.mark()  # stretch the forward pass
        (loss_t / global_batch).backward()
        loss_sum = loss_t.item()
    if emulator is not None:
        emulator.mark()  # stretch the rest of backward
    return loss_sum


def run_unit(
    model: nn.Module,
    sync: SyncStrategy,
    batches: Sequence[Minibatch],
    *,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    pending_epoch: int = 0,
    stop: bool = False,
    loss_fn: LossFn | None = None,
) -> StepResult:
    """Compute the unit's minibatches, synchronise once and (if committed) apply the update.

    Raises :class:`~flotilla.core.errors.CollectiveError` if the group broke; nothing was applied.
    """
    if emulator is not None:
        emulator.reset_counters()
    loss_sum, n = 0.0, 0
    for i, mb in enumerate(batches):
        loss_sum += _forward_backward(model, sync, mb, global_batch, emulator, loss_fn)
        n += int(mb.y.shape[0])
        if i < len(batches) - 1:
            sync.local_step()
    decision = sync.synchronize(pending_epoch=pending_epoch, stop=stop)
    compute_s, emulated_s = emulator.reset_counters() if emulator is not None else (0.0, 0.0)
    loss = loss_sum / n if n else math.nan  # (n == 0: more workers than samples in a last batch)
    return StepResult(decision=decision, loss=loss, num_samples=n, compute_s=compute_s, emulated_s=emulated_s)


def run_step(
    model: nn.Module,
    sync: SyncStrategy,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    step: int,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    pending_epoch: int = 0,
    stop: bool = False,
) -> StepResult:
    """One minibatch per commit: :func:`run_unit` of ``[(step, x, y)]``."""
    return run_unit(
        model,
        sync,
        (Minibatch(step, x, y),),
        global_batch=global_batch,
        emulator=emulator,
        pending_epoch=pending_epoch,
        stop=stop,
    )
