"""The sum of one pipeline stage's step with the same stage of the other pipeline instances
(``strategy.replicas``; ``StageEngine._guard`` calls it before the stages' verdict).

Two all-reduces over the stage's replica group: first one float64 SUM of [loss flag, the last
stage's loss share, "a newer generation seen", then per trainable parameter "has a gradient
here"]; then one SUM per dtype of the gradients of every parameter some instance has a gradient
for (zeros where this one has none).  A parameter no instance has a gradient for keeps none, so
every instance applies the same update.  The runtime scaled every microbatch's loss by its share
of the GLOBAL batch, so the summed gradients are the global batch's mean gradient and the summed
loss its mean loss.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.comm.collective import Group

__all__ = ["sum_with_replicas"]


def sum_with_replicas(
    group: Group, module: nn.Module, *, loss: float, flagged: bool, seen: bool
) -> tuple[bool, float, bool]:
    """Sum ``module``'s gradients (in place), ``loss`` and the flags over ``group``; returns
    (some instance flagged a non-finite loss, the summed loss, some instance saw a newer
    generation)."""
    trained = [p for p in module.parameters() if p.requires_grad]
    head = [1.0 if flagged else 0.0, loss, 1.0 if seen else 0.0]
    flags = torch.tensor(head + [0.0 if p.grad is None else 1.0 for p in trained], dtype=torch.float64)
    group.allreduce(flags, "sum")
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for i, p in enumerate(trained):
        if flags[3 + i] > 0:
            by_dtype.setdefault(p.dtype, []).append(p)
    for params in by_dtype.values():
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.allreduce(flat, "sum")
        offset = 0
        for p in params:
            part = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            offset += p.numel()
    return bool(flags[0] > 0), float(flags[1]), bool(flags[2] > 0)
