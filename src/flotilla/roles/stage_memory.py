"""What a pipeline stage holds, measured while it runs, against its device's memory budget.

The partitioner plans each stage's memory from the profile (``pipeline/plan.CostModel``); this
measures it with instruments of its own, independent of that model:

- **activations**: the bytes autograd saves during each forward (``instrument.SavedBytes`` through
  saved-tensor hooks: weights excluded, each storage once), plus the stage's input and output,
  summed over the microbatches in flight; the runtime keeps the peak
  (``StageResult.peak_activation_bytes``; ``RuntimeOptions.track_memory``);
- **weights and optimizer**: the bytes of the stage's parameters, their gradients (one per
  trainable parameter: each exists from its backward until the update) and every tensor of the
  optimizer's state, plus the extra weight versions the stash held at its peak.

After every step the sum is checked against the budget of the stage's device
(``cluster.workers[i].memory_bytes``): ``strategy.memory_check: warn`` logs one warning the first
time it is over; ``fail`` stops the stage with one line (exit code 6, as out of memory: the job
stops, a restart would not fit either); ``off`` measures nothing.  The stage's result file carries
the figures (``memory``) and the summary puts them beside the plan's prediction.
"""

from __future__ import annotations

from typing import Any

import torch

from flotilla.core.errors import OutOfMemory
from flotilla.core.log import get_logger
from flotilla.pipeline.plan import format_bytes
from flotilla.pipeline.runtime import StageRuntime

__all__ = ["MEMORY_CHECKS", "StageMemory"]

MEMORY_CHECKS = ("warn", "fail", "off")

log = get_logger("pipeline-stage")


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


class StageMemory:
    """The measured memory of one stage (module doc)."""

    def __init__(self, runtime: StageRuntime, budget_bytes: int, mode: str, name: str) -> None:
        if mode not in MEMORY_CHECKS:
            raise ValueError(f"strategy.memory_check must be one of {', '.join(MEMORY_CHECKS)}, got {mode!r}")
        self.runtime, self.budget_bytes, self.mode, self.name = runtime, budget_bytes, mode, name
        self.peak_bytes = 0
        self._warned = False

    def weight_bytes(self) -> int:
        """Parameters, their gradients, the optimizer's state and the stash's extra versions."""
        rt = self.runtime
        params = list(rt.module.parameters())
        weights = sum(_nbytes(p) for p in params)
        # every trainable parameter's gradient exists from its backward until the update (between
        # steps it may be freed: zero_grad(set_to_none=True))
        grads = sum(_nbytes(p.grad) if p.grad is not None else _nbytes(p) for p in params if p.requires_grad)
        state = sum(
            _nbytes(v) for slots in rt.optimizer.state.values() for v in slots.values() if torch.is_tensor(v)
        )
        return weights * rt.stash.peak_copies + grads + state

    def figures(self) -> dict[str, Any]:
        """The result file's ``memory`` section (bytes)."""
        activations, weights = self.runtime.result.peak_activation_bytes, self.weight_bytes()
        return {
            "activation_bytes": activations,
            "weight_bytes": weights,
            "peak_bytes": max(self.peak_bytes, activations + weights),
            "budget_bytes": self.budget_bytes,
        }

    def check(self) -> None:
        """After a step: the peak so far against the budget (warn once, or fail: module doc)."""
        if self.mode == "off":
            return
        activations, weights = self.runtime.result.peak_activation_bytes, self.weight_bytes()
        self.peak_bytes = max(self.peak_bytes, activations + weights)
        if self.peak_bytes <= self.budget_bytes:
            return
        line = (
            f"stage {self.name!r} holds {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes: "
            f"activations {format_bytes(activations)}, weights and "
            f"optimizer {format_bytes(weights)}), over its device's budget of "
            f"{format_bytes(self.budget_bytes)} (cluster.workers memory_bytes; strategy.memory_check: "
            f"{self.mode})"
        )
        if self.mode == "fail":
            raise OutOfMemory(line)
        if not self._warned:
            self._warned = True
            log.warning("%s", line)
