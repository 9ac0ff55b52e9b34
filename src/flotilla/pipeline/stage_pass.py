"""One microbatch's pass on one weight version: the compute half of ``pipeline/runtime.StageRuntime``.

A pass runs either on the *live* weights (the module's own parameters: the stash plan found no
update between the forward and its backward) or on a *stashed* version v: ``functional_call`` on
fresh leaves detached from the stash's tensors of v, so the backward differentiates exactly the
weights the forward used, whatever updates happened in between.  ``backward_pass`` accumulates the
parameter gradients into ``.grad`` of the stage's parameters in both cases (live: autograd does it;
stashed: added by hand, in parameter order) and returns the gradient of the pass's input (None on
stage 0, whose input needs no gradient).

Invariants: a ``StagePass`` remembers the version its forward used (the runtime checks its
backward names the same one); stashed leaves require a gradient exactly where the parameter
does; nothing here touches the stash's contents or the communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from flotilla.pipeline.stash import WeightStash

__all__ = ["StagePass", "backward_pass", "stashed_forward", "tensor_finite", "weight_ptrs"]


@dataclass(slots=True)
class StagePass:
    """What a forward leaves for its backward: input (None on stage 0), output (the scaled loss on
    the last stage), the stashed leaves (None: live weights), version, digest, activation bytes."""

    inp: torch.Tensor | None
    out: torch.Tensor
    leaves: tuple[torch.Tensor, ...] | None
    version: int
    digest: str | None
    act_bytes: int


def stashed_forward(
    module: nn.Module, names: Sequence[str], stash: WeightStash, version: int, x: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run ``module`` on ``x`` with the stashed weights of ``version``; returns the output and the
    leaves (detached copies of the stash's tensors) the backward differentiates."""
    tensors = stash.tensors(version)
    leaves = tuple(t.detach().requires_grad_(p.requires_grad) for t, p in zip(tensors, stash.params))
    return functional_call(module, dict(zip(names, leaves)), (x,)), leaves


def backward_pass(
    ctx: StagePass, grad_out: torch.Tensor | None, params: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """Backward of ``ctx`` (``grad_out`` None: the output is the loss); parameter gradients are
    accumulated into ``params``' ``.grad``; returns the input's gradient (None without an input,
    or for an input that takes none: an integer activation).  A pass whose output needs no
    gradient (a frozen stage fed by data, an integer output) has no backward: nothing happens."""
    inp = ctx.inp if ctx.inp is not None and ctx.inp.requires_grad else None
    if not ctx.out.requires_grad:
        return torch.zeros_like(inp) if inp is not None else None
    if ctx.leaves is None:
        torch.autograd.backward(ctx.out, grad_out)
        return inp.grad if inp is not None else None
    leaves = ctx.leaves
    wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    inputs = ([inp] if inp is not None else []) + [leaves[i] for i in wanted]
    grads = torch.autograd.grad(ctx.out, inputs, grad_out, allow_unused=True)
    offset = 1 if inp is not None else 0
    for i, g in zip(wanted, grads[offset:]):
        if g is None:
            continue
        p = params[i]
        if p.grad is not None:
            p.grad.add_(g)
        elif g.stride() == p.stride():
            p.grad = g
        else:  # (in the parameter's layout, as autograd accumulates it: CUDA's fused optimizers need it)
            p.grad = torch.empty_like(p).copy_(g)
    return grads[0] if inp is not None else None


def weight_ptrs(stash: WeightStash) -> set[int]:
    """Storage addresses of every weight tensor (live and stashed): excluded from activation bytes."""
    return {p.untyped_storage().data_ptr() for p in stash.params} | {
        t.untyped_storage().data_ptr() for v in stash.stashed_versions for t in stash.tensors(v)
    }


def tensor_finite(t: torch.Tensor) -> bool:
    """All elements finite; the sum is the fast path (sync/state.all_finite has the reasoning)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
