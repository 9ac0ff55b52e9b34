"""One data-parallel training step (or commit unit) over any :class:`~flotilla.sync.base.SyncStrategy`,
with the atomic-commit rule (SPEC §4, §7), and the job's loss.

``run_unit`` is the only code path that changes a replica's parameters: for each minibatch of the
unit ``begin_step``, forward, backward (all-reduce buckets are reduced while it runs), then
``local_step`` between minibatches and ``synchronize`` at the end, which applies the update only
if it commits.  The worker loop and the tests both call it, so the tests prove the real thing.

Non-finite guard: a unit whose loss (or, for a strategy that does not check its reduced
gradients itself, a local gradient) is not finite proposes ``local_ok=False``; the strategy then
discards it everywhere (a barrier strategy) or does not push it (``ps``), and the loop decides
what happens next (``trainer/boundary.py``: stop the job, or skip the step).

The loss is the sum of the task's loss over the local samples (``loss_fn``, see
:func:`summed_loss`; summed cross-entropy by default) divided by ``global_batch``: the SUM of every
worker's gradients is then exactly the global-batch mean gradient however the batch is split,
and an epoch's short last batch makes a proportionally short step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.sync.base import Outcome, Proposal, SyncStrategy
from flotilla.sync.state import all_finite

__all__ = ["LossFn", "Minibatch", "StepResult", "nonfinite_gradient", "run_step", "run_unit", "summed_loss"]


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
    nonfinite: str = ""  # what was not finite on this worker ("loss", "gradient of <name>"), or ""


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


def nonfinite_gradient(model: nn.Module) -> str:
    """The name of the first parameter whose gradient holds a NaN or an infinity, or ""."""
    for name, p in model.named_parameters():
        if p.grad is not None and not all_finite((p.grad,)):
            return f"gradient of {name}"
    return ""


def run_unit(
    model: nn.Module,
    sync: SyncStrategy,
    batches: Sequence[Minibatch],
    *,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    proposal: Proposal = Proposal(),
    loss_fn: LossFn | None = None,
    check_gradients: bool = False,
) -> StepResult:
    """Compute the unit's minibatches, synchronise once and (if committed) apply the update.

    ``check_gradients``: also check this worker's gradients for non-finite values before
    synchronising (for strategies that do not check the reduced ones themselves).  A broken
    group is data (``decision.broken``); nothing was applied then."""
    if emulator is not None:
        emulator.reset_counters()
    loss_sum, n = 0.0, 0
    for i, mb in enumerate(batches):
        loss_sum += _forward_backward(model, sync, mb, global_batch, emulator, loss_fn)
        n += int(mb.y.shape[0])
        if i < len(batches) - 1:
            sync.local_step()
    nonfinite = "" if math.isfinite(loss_sum) else "loss"
    if not nonfinite and check_gradients:
        nonfinite = nonfinite_gradient(model)
    if nonfinite:
        proposal = replace(proposal, local_ok=False)
    decision = sync.synchronize(proposal)
    compute_s, emulated_s = emulator.reset_counters() if emulator is not None else (0.0, 0.0)
    loss = loss_sum / n if n else math.nan  # (n == 0: more workers than samples in a last batch)
    return StepResult(
        decision=decision,
        loss=loss,
        num_samples=n,
        compute_s=compute_s,
        emulated_s=emulated_s,
        nonfinite=nonfinite,
    )


def run_step(
    model: nn.Module,
    sync: SyncStrategy,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    step: int,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    proposal: Proposal = Proposal(),
) -> StepResult:
    """One minibatch per commit: :func:`run_unit` of ``[(step, x, y)]``."""
    return run_unit(
        model, sync, (Minibatch(step, x, y),), global_batch=global_batch, emulator=emulator, proposal=proposal
    )
