"""Mixed precision and compilation of the user's model (``job.precision``, ``job.compile``; issue 34).

- ``precision: bf16``: the forward pass and the loss run under ``torch.autocast`` in bfloat16
  (CUDA and CPU alike); weights, gradients, the reduced gradients and the optimizer's state stay
  float32 (the master weights are the model's own parameters), so every strategy's update rule
  and every transfer are unchanged.  bfloat16 has float32's exponent range: no loss scaling is
  needed (``fp16`` would need a scaler whose skipped steps every replica agrees on: not built).
- ``compile: true``: ``nn.Module.compile`` (``torch.compile`` in place: the module, its parameter
  objects and its ``state_dict`` keys stay what they were, so checkpoints, digests, state
  transfer and the exported model do not see it) with ``compile_backend`` (``inductor``; tests use
  ``aot_eager`` on the CPU).  A pipeline compiles each stage's layers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

__all__ = ["Autocast", "autocast_of", "compile_model"]

Autocast = Callable[[], AbstractContextManager[object]]


def autocast_of(precision: str, device: torch.device) -> Autocast:
    """A factory of the context the forward pass and loss run in: ``nullcontext`` for fp32."""
    if precision == "fp32":
        return nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"job.precision must be one of fp32, bf16; got {precision!r}")


def compile_model(model: nn.Module, enabled: bool, backend: str) -> nn.Module:
    """Compile ``model`` in place (module doc) when ``enabled``; returns it."""
    if enabled:
        model.compile(backend=backend)
    return model
