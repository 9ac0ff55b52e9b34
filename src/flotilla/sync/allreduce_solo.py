"""The commit of ``allreduce`` in a one-member view (``sync/allreduce.py``): the local gradients
are the reduced ones, so no bucket and no collective runs; the decisions and the arithmetic are
the bucketed path's (an unused parameter gets a zero gradient there too).

With a fused Adam/AdamW (what CUDA parameters get, ``trainer/optim.py``) the step is launched with
the device-side non-finite flag, which makes the kernel skip it (weights, moments and step
counts unchanged), and the flag is read afterwards: the same outcome as checking first, without
the host waiting for the GPU before the update (docs/gpu.md, "A step on a GPU").

``job.precision: fp16``: the same kernel that checks the gradients unscales them (``1/S``); a
finite loss with non-finite gradients is an overflow (``sync/scaler.py``): skipped, and the
scaler settled from it (alone, this member's verdict is the agreed one).
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.sync.base import Outcome, Proposal
from flotilla.sync.buffers import ReplicaBuffers
from flotilla.sync.scaler import OVERFLOW_CODE, OVERFLOW_REASON, ScaleSlot
from flotilla.sync.state import gradients_finite, guards_on_device, loss_finite, nonfinite_flag

__all__ = ["DISCARD_REASONS", "commit_alone", "discard_reason", "fill_unused_gradients"]

DISCARD_REASONS = {
    False: "a replica failed during the step",
    True: "non-finite loss or gradient on a replica",
}


def discard_reason(code: float) -> str:
    """Why a step with the agreed failure ``code`` was discarded ("" if it committed)."""
    if code == 0.0:
        return ""
    return OVERFLOW_REASON if code == OVERFLOW_CODE else DISCARD_REASONS[code >= 2.0]


def fill_unused_gradients(params: list[nn.Parameter]) -> None:
    """A parameter unused in backward gets a zero gradient (as its zeroed bucket slice does)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def commit_alone(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    buffers: ReplicaBuffers,
    proposal: Proposal,
    *,
    failed: bool,
    scale: ScaleSlot | None = None,
) -> Outcome:
    """Decide and (if committed) apply one member's step; ``failed``: a local fault this step;
    ``scale``: the strategy's loss scaler, if any (fp16: the module doc)."""
    grads = [p.grad for p in params if p.grad is not None]
    scaler = scale.scaler if scale is not None else None
    inv = 1.0 / scaler.scale if scaler is not None else 1.0
    if not failed and proposal.local_ok and optimizer is not None and guards_on_device(optimizer, params):
        found = nonfinite_flag(grads, proposal.loss_check, inv_scale=inv)
        if found is not None:
            fill_unused_gradients(params)
            optimizer.found_inf = found  # type: ignore[attr-defined]  # (read by torch's fused step)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
            code = 0.0
            if bool(found.item()):
                code = OVERFLOW_CODE if scaler is not None and loss_finite(proposal) else 2.0
            return _outcome(buffers, proposal, code, scale)
    if scaler is not None:
        grads_ok = scaler.unscale_(grads)
        loss_ok = proposal.local_ok and loss_finite(proposal)
        code = max(2.0 if not loss_ok else 0.0 if grads_ok else OVERFLOW_CODE, float(failed))
    else:
        finite = proposal.local_ok and loss_finite(proposal) and gradients_finite(grads)
        code = 2.0 if not finite else float(failed)
    if code == 0.0 and optimizer is not None:
        fill_unused_gradients(params)
        optimizer.step()
    return _outcome(buffers, proposal, code, scale)


def _outcome(buffers: ReplicaBuffers, proposal: Proposal, failed: float, scale: ScaleSlot | None) -> Outcome:
    """The step's outcome (failure code 2: non-finite, 1: another local fault, ``OVERFLOW_CODE``:
    an fp16 overflow); a discarded step restores the model's buffers; the scaler is settled."""
    if scale is not None:
        scale.settle_code(failed)
    committed = failed == 0.0
    if not committed:
        buffers.restore()
    return Outcome(
        committed=committed,
        pending_epoch=proposal.pending_epoch,
        stop=proposal.stop,
        switch=proposal.switch,
        local_ok=failed < 2.0,
        reason=discard_reason(failed),
    )
