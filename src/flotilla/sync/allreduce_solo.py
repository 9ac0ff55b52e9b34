"""The commit of ``allreduce`` in a one-member view (``sync/allreduce.py``): the local gradients
are the reduced ones, so no bucket and no collective runs; the decisions and the arithmetic are
the bucketed path's (an unused parameter gets a zero gradient there too).

With a fused Adam/AdamW (what CUDA parameters get, ``trainer/optim.py``) the step is launched with
the device-side non-finite flag, which makes the kernel skip it (weights, moments and step
counts unchanged), and the flag is read afterwards: the same outcome as checking first, without
the host waiting for the GPU before the update (docs/gpu.md, "A step on a GPU").
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.sync.base import Outcome, Proposal
from flotilla.sync.buffers import ReplicaBuffers
from flotilla.sync.state import gradients_finite, guards_on_device, loss_finite, nonfinite_flag

__all__ = ["DISCARD_REASONS", "commit_alone", "fill_unused_gradients"]

DISCARD_REASONS = {
    False: "a replica failed during the step",
    True: "non-finite loss or gradient on a replica",
}


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
) -> Outcome:
    """Decide and (if committed) apply one member's step; ``failed``: a local fault this step."""
    grads = [p.grad for p in params if p.grad is not None]
    if not failed and proposal.local_ok and optimizer is not None and guards_on_device(optimizer, params):
        found = nonfinite_flag(grads, proposal.loss_check)
        if found is not None:
            fill_unused_gradients(params)
            optimizer.found_inf = found  # type: ignore[attr-defined]  # (read by torch's fused step)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
            return _outcome(buffers, proposal, 2.0 if bool(found.item()) else 0.0)
    finite = proposal.local_ok and loss_finite(proposal) and gradients_finite(grads)
    code = 2.0 if not finite else float(failed)
    if code == 0.0 and optimizer is not None:
        fill_unused_gradients(params)
        optimizer.step()
    return _outcome(buffers, proposal, code)


def _outcome(buffers: ReplicaBuffers, proposal: Proposal, failed: float) -> Outcome:
    """The step's outcome (failure code 2: non-finite, 1: another local fault); a discarded step
    restores the model's buffers."""
    committed = failed == 0.0
    if not committed:
        buffers.restore()
    return Outcome(
        committed=committed,
        pending_epoch=proposal.pending_epoch,
        stop=proposal.stop,
        switch=proposal.switch,
        local_ok=failed < 2.0,
        reason="" if committed else DISCARD_REASONS[failed >= 2.0],
    )
