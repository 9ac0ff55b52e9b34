"""One data-parallel training step (or commit unit) over any :class:`~flotilla.sync.base.SyncStrategy`,
with the atomic-commit rule (SPEC §4, §7), and the job's loss.

``run_unit`` is the only code path that changes a replica's parameters: for each minibatch of the
unit ``begin_step``, forward, backward (all-reduce buckets are reduced while it runs), then
``local_step`` between minibatches and ``synchronize`` at the end, which applies the update only
if it commits.  The worker loop and the tests both call it, so the tests prove the real thing.

Non-finite guard: a unit whose loss (or, for a strategy that does not check its reduced
gradients itself, a local gradient) is not finite proposes ``local_ok=False``; the strategy then
discards it everywhere (a barrier strategy) or does not push it (``ps``), and the loop decides
what happens next (``trainer/boundary.py``: stop the job, or skip the step).  On a GPU, a strategy
that ``checks_loss_on_device`` (``allreduce``) gets the loss as a device tensor instead
(``Proposal.loss_check``) and counts a non-finite one as ``local_ok=False`` itself, so the host
reads the loss only after the update was launched.

``job.precision: fp16`` (``sync/scaler.py``): the backward pass runs on the loss times the
replica's loss scale ``S``.  A strategy that agrees on the scale (``allreduce``, ``diloco``)
unscales and settles it itself from its vote; for the others (each worker's own update) this
module unscales the worker's gradients before they are applied, pushed or stepped (also before
each ``local_step`` inside a unit), skips an overflowed one (not applied: ``local_ok`` False to
the strategy, then reported as an overflow, ``Outcome.local_ok`` True with the overflow's reason)
and settles this worker's scale.  ``StepResult.overflow``: the unit (or a step of it) was skipped
for an overflow -- not a non-finite step (``trainer/boundary.py``).

The objective is the sum of the task's loss over the local samples divided by ``global_batch``
(``loss_fn``, see :func:`task_loss`; summed cross-entropy by default): the SUM of every worker's
gradients is then exactly the global-batch mean gradient however the batch is split, and an
epoch's short last batch makes a proportionally short step.  A task whose loss is a batch mean
is scaled by ``n / global_batch`` instead (no scaling at all when one worker holds the whole
batch: the plain loop's graph, no extra nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.data.tree import batch_len, split_batch
from flotilla.sync.base import Outcome, Proposal, SyncStrategy
from flotilla.sync.loss_scale import Verdict
from flotilla.sync.scaler import OVERFLOW_REASON, LossScaler, agrees_loss_scale
from flotilla.sync.state import all_finite, gradients_finite
from flotilla.trainer.precision import Autocast
from flotilla.trainer.task import cross_entropy_sum

__all__ = ["Minibatch", "StepResult", "TaskLoss", "nonfinite_gradient", "run_step", "run_unit", "task_loss"]


@dataclass(frozen=True, slots=True)
class TaskLoss:
    """The task's loss ``fn(output, target) -> scalar`` and how it reduces a batch: ``sums``
    (a sum over the samples) or a mean."""

    fn: Callable[[Any, Any], torch.Tensor]
    sums: bool


"""``(output, target) -> the SUM of the loss over the batch's samples`` (scalar tensor)."""


def task_loss(task: object) -> TaskLoss:
    """The task's ``loss_sum`` if it has one (exact summation, as the zoo's classification tasks),
    else its ``loss`` (a batch mean)."""
    exact = getattr(task, "loss_sum", None)
    if callable(exact):
        return TaskLoss(exact, sums=True)
    return TaskLoss(task.loss, sums=False)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Minibatch:
    """One minibatch of a unit: inputs and targets are tensors, or tuples/lists/dicts of tensors
    (``data/tree.py``)."""

    step: int
    x: Any
    y: Any


@dataclass(frozen=True, slots=True)
class StepResult:
    decision: Outcome
    loss: float  # mean loss over this worker's samples of the unit
    num_samples: int
    compute_s: float  # real compute measured on this worker
    emulated_s: float  # delay added by speed emulation
    nonfinite: str = ""  # what was not finite on this worker ("loss", "gradient of <name>"), or ""
    overflow: bool = False  # fp16: the unit (or a step of it) was skipped for an overflow
    loss_scale: float | None = None  # fp16: the loss scale the unit ran with (None: no scaling)


def _forward_backward(
    model: nn.Module,
    sync: SyncStrategy,
    mb: Minibatch,
    global_batch: int,
    emulator: SpeedEmulator | None,
    loss_fn: TaskLoss | None,
    accumulate: int = 1,
    autocast: Autocast = nullcontext,
    scale: float | None = None,
) -> torch.Tensor | float:
    """Sum of the losses of ``mb``'s samples (nan-free 0.0 if it is empty), in ``accumulate``
    passes (``job.accumulate``: ``mb`` split into that many nearly equal parts, at most one per
    sample; the gradients add up, the strategy reduces after the last pass)."""
    sync.begin_step(mb.step)
    if emulator is not None:
        emulator.start()
    n = batch_len(mb.y)
    parts = min(accumulate, n)
    if parts <= 1:
        return _pass(model, mb.x, mb.y, n, global_batch, emulator, loss_fn, autocast, scale)
    xs, ys = split_batch(mb.x, parts), split_batch(mb.y, parts)
    loss_sum: torch.Tensor | float = 0.0
    for i, (x, y) in enumerate(zip(xs, ys)):
        sync.defer_reduction(i < parts - 1)
        loss_sum += _pass(model, x, y, batch_len(y), global_batch, emulator, loss_fn, autocast, scale)
    return loss_sum


def _pass(
    model: nn.Module,
    x: Any,
    y: Any,
    n: int,
    global_batch: int,
    emulator: SpeedEmulator | None,
    loss_fn: TaskLoss | None,
    autocast: Autocast = nullcontext,
    scale: float | None = None,
) -> torch.Tensor | float:
    """One forward/backward of ``n`` samples; the sum of their losses (module doc's scaling): on a
    GPU a float64 tensor there, not read by the host here; else a float (0.0 for no samples).  The
    forward pass and the loss run in ``autocast`` (``job.precision``), the backward pass not; with
    a loss ``scale`` (fp16) the backward pass starts from the float32 loss times it."""
    mb = Minibatch(-1, x, y)
    loss_sum: torch.Tensor | float = 0.0
    if n:
        with autocast():
            out = model(mb.x)
            if loss_fn is None:
                loss_t, sums = cross_entropy_sum(out, mb.y), True
            else:
                loss_t, sums = loss_fn.fn(out, mb.y), loss_fn.sums
        if emulator is not None:
            emulator.mark()  # stretch the forward pass
        # (on a GPU the loss stays there, read after the update is launched; elsewhere reading
        # it now costs nothing and a Python float is cheaper to carry than a tensor)
        on_host = loss_t.device.type == "cpu"
        if scale is not None:
            share = loss_t.float() / global_batch if sums else loss_t.float() * (n / global_batch)
            (share * scale).backward()
            loss_sum = _loss_sum(loss_t, n, sums, on_host)
        elif sums:
            (loss_t / global_batch).backward()
            loss_sum = loss_t.item() if on_host else loss_t.detach().double()
        else:  # a batch mean: its share n / global_batch of the global mean
            (loss_t if n == global_batch else loss_t * (n / global_batch)).backward()
            loss_sum = loss_t.item() * n if on_host else loss_t.detach().double() * n
    if emulator is not None:
        if emulator.stretches and isinstance(loss_sum, torch.Tensor):
            loss_sum.item()  # (a slower device is emulated from the real compute: wait for it)
        emulator.mark()  # stretch the rest of backward
    return loss_sum


def _loss_sum(loss_t: torch.Tensor, n: int, sums: bool, on_host: bool) -> torch.Tensor | float:
    """The sum of the samples' losses from the task's loss (a sum, or a batch mean of ``n``)."""
    k = 1 if sums else n
    return loss_t.item() * k if on_host else loss_t.detach().double() * k


def nonfinite_gradient(model: nn.Module) -> str:
    """The name of the first parameter whose gradient holds a NaN or an infinity, or ""."""
    if gradients_finite([p.grad for p in model.parameters() if p.grad is not None]):
        return ""  # (the common case: one check for all of them)
    for name, p in model.named_parameters():
        if p.grad is not None and not all_finite((p.grad,)):
            return f"gradient of {name}"
    return ""


def stretch_optimizer_steps(
    optimizer: torch.optim.Optimizer, emulator: SpeedEmulator, device: torch.device
) -> None:
    """Make ``emulator`` stretch every ``optimizer.step()`` too: an emulated device's update is
    its compute as much as its forward and backward (SPEC §8), as a pipeline stage's is
    (``pipeline/runtime.py``).  The step is measured from after the hooks registered before
    (gradient clipping) to its end, on a GPU once its kernels finished; an optimizer whose step
    calls its base class's (which torch hooks again) is measured once, outermost.  Nothing is registered
    when the emulator never sleeps (speed 1, no transient slowdowns)."""
    if not emulator.stretches:
        return
    cuda = device.type == "cuda"
    depth = [0]  # (an optimizer subclass whose step calls its base's runs the hooks again inside)

    def before(*_: Any) -> None:
        depth[0] += 1
        if depth[0] > 1:
            return
        if cuda:
            torch.cuda.synchronize(device)
        emulator.begin()

    def after(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] > 0:
            return
        if cuda:
            torch.cuda.synchronize(device)
        emulator.mark()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def run_unit(
    model: nn.Module,
    sync: SyncStrategy,
    batches: Sequence[Minibatch],
    *,
    global_batch: int,
    emulator: SpeedEmulator | None = None,
    proposal: Proposal = Proposal(),
    loss_fn: TaskLoss | None = None,
    check_gradients: bool = False,
    accumulate: int = 1,
    autocast: Autocast = nullcontext,
    scaler: LossScaler | None = None,
) -> StepResult:
    """Compute the unit's minibatches, synchronise once and (if committed) apply the update.

    ``check_gradients``: also check this worker's gradients for non-finite values before
    synchronising (for strategies that do not check the reduced ones themselves).  ``scaler``:
    fp16's loss scaler (module doc).  A broken group is data (``decision.broken``); nothing was
    applied then."""
    if emulator is not None:
        emulator.reset_counters()
    own = scaler if scaler is not None and not agrees_loss_scale(sync) else None  # (settled here)
    ran_scale = scaler.scale if scaler is not None else None
    if scaler is not None:
        scaler.begin_unit()
    loss_t: torch.Tensor | float = 0.0
    n, overflowed = 0, False
    for i, mb in enumerate(batches):
        scale = scaler.scale if scaler is not None else None
        mb_loss = _forward_backward(
            model, sync, mb, global_batch, emulator, loss_fn, accumulate, autocast, scale
        )
        loss_t = loss_t + mb_loss
        n += batch_len(mb.y)
        if i < len(batches) - 1:
            if own is not None and not math.isfinite(float(mb_loss)):
                _drop_gradients(model)  # (a non-finite loss: the unit is a non-finite one, below)
                continue
            if own is not None and not _unscaled(model, own):
                overflowed = True  # (this step is skipped: its gradients never reach the strategy)
                continue
            sync.local_step()
    # Read on the host after the update was launched where the strategy checks the loss itself
    # on the device (a GPU's queue then never drains mid-step), else now.
    on_device = isinstance(loss_t, torch.Tensor)
    deferred = sync.checks_loss_on_device and not check_gradients and own is None and on_device
    nonfinite, overflow_now, partial = "", False, False
    if deferred:
        proposal = replace(proposal, loss_check=loss_t)
    else:
        loss_sum = float(loss_t)
        nonfinite = "" if math.isfinite(loss_sum) else "loss"
        if not nonfinite and own is not None:
            overflow_now = not _unscaled(model, own)
            # (a unit of several minibatches -- a WSP wave, whose earlier ones were applied locally
            # -- drops only this one, as it drops an earlier one that overflowed: the rest goes out)
            partial = overflow_now and len(batches) > 1
        elif not nonfinite and check_gradients:
            nonfinite = nonfinite_gradient(model)
        if nonfinite or (overflow_now and not partial):
            proposal = replace(proposal, local_ok=False)
    decision = sync.synchronize(proposal)
    if deferred:
        loss_sum = float(loss_t)
        nonfinite = "" if math.isfinite(loss_sum) else "loss"
    if overflow_now and not partial and not decision.broken:  # (not applied, not pushed: an overflow)
        decision = replace(decision, local_ok=True, reason=OVERFLOW_REASON)
    elif own is not None and not overflow_now:
        own.settle(Verdict.GOOD if decision.committed else Verdict.OTHER)
    overflowed = overflowed or overflow_now or (scaler is not None and scaler.last is Verdict.OVERFLOW)
    if nonfinite:  # (a non-finite loss makes the unit a non-finite one, whatever overflowed in it)
        overflowed = False
    compute_s, emulated_s = emulator.reset_counters() if emulator is not None else (0.0, 0.0)
    loss = loss_sum / n if n else math.nan  # (n == 0: more workers than samples in a last batch)
    return StepResult(
        decision=decision,
        loss=loss,
        num_samples=n,
        compute_s=compute_s,
        emulated_s=emulated_s,
        nonfinite=nonfinite,
        overflow=overflowed,
        loss_scale=ran_scale,
    )


def _unscaled(model: nn.Module, scaler: LossScaler) -> bool:
    """Unscale this worker's gradients; on an overflow drop them (the step is skipped: the next
    minibatch's backward starts afresh), back the scale off and say so (False)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if scaler.unscale_(grads):
        return True
    _drop_gradients(model)
    scaler.settle(Verdict.OVERFLOW)
    return False


def _drop_gradients(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


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
