"""Evaluation through a pipeline (``StageEngine.evaluate``, at a flush boundary, every stage):
one forward pass of the eval data in batches of ``EVAL_BATCH`` (stage 0 reads the inputs, each
stage sends its activations to the next on ``TAG_EVAL``, eval mode, no gradients); the last
stage runs the task's ``evaluate_task`` over its layers fed by the received activations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flotilla.comm.collective import Group
from flotilla.core.errors import FlotillaError
from flotilla.pipeline.runtime import StageRuntime
from flotilla.pipeline.split import ActivationSpec
from flotilla.pipeline.stage_comm import TAG_EVAL
from flotilla.trainer.task_load import TaskData, evaluate_task

__all__ = ["EVAL_BATCH", "evaluate_stage"]

EVAL_BATCH = 1024  # samples per evaluation batch (evaluate_task's default)


def evaluate_stage(
    runtime: StageRuntime, group: Group, num_stages: int, task: Any, data: TaskData
) -> dict[str, float] | None:
    """One forward pass of ``data`` through the pipeline (every stage calls this at the same
    boundary, on its stage group); the last stage returns the task's evaluation, the others None."""
    stage_idx = runtime.stage_idx

    def recv(batch_size: int) -> torch.Tensor:
        spec: ActivationSpec | None = runtime.in_spec
        if spec is None:
            raise FlotillaError(f"stage {stage_idx}: no input activation spec for the evaluation")
        buf = torch.empty(spec.for_batch(batch_size), dtype=spec.dtype, device=runtime.device)
        group.recv(buf, stage_idx - 1, TAG_EVAL).wait()
        return buf

    module, n = runtime.module, data.num_samples
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            if num_stages == 1:
                return evaluate_task(task, module, data, batch=EVAL_BATCH)
            if stage_idx == num_stages - 1:
                return evaluate_task(task, _Tail(module, recv), data, batch=EVAL_BATCH)
            sends = []
            for lo in range(0, n, EVAL_BATCH):
                hi = min(lo + EVAL_BATCH, n)
                x = data.batch(range(lo, hi))[0].to(runtime.device) if stage_idx == 0 else recv(hi - lo)
                out = module(x).contiguous()
                sends.append((group.send(out, stage_idx + 1, TAG_EVAL), out))
            for handle, _ in sends:
                handle.wait()
            return None
    finally:
        module.train(was_training)


class _Tail(nn.Module):
    """The last stage as a model for ``evaluate_task``: its input comes from the stage before."""

    def __init__(self, stage: nn.Module, recv: Callable[[int], torch.Tensor]) -> None:
        super().__init__()
        self.stage = stage
        self._recv = recv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stage(self._recv(int(x.shape[0])))
        return out
