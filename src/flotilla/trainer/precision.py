"""Mixed precision and compilation of the user's model (``job.precision``, ``job.compile``; issue 34).

- ``precision: bf16``: the forward pass and the loss run under ``torch.autocast`` in bfloat16
  (CUDA and CPU alike); weights, gradients, the reduced gradients and the optimizer's state stay
  float32 (the master weights are the model's own parameters), so every strategy's update rule
  and every transfer are unchanged.  bfloat16 has float32's exponent range: no loss scaling is
  needed.
- ``precision: fp16``: the same in float16, whose range is small: the loss is multiplied by a
  dynamic loss scale before backward and the gradients unscaled before any update reads them
  (``sync/scaler.py``, ``sync/loss_scale.py``: ``GradScaler``'s rule, settled from the agreed
  verdict of every unit so replicas' scales stay equal); an overflow skips the step, it is not a
  non-finite step.  The replica strategies take it, and pipeline stages with a flushing schedule
  (``gpipe``, ``1f1b``: the last stage scales the loss, every stage unscales its own gradients
  and the stages' verdict at each flush settles every stage's scale alike,
  ``trainer/stage_verdict.py``); PipeDream's schedule (``pipedream``, ``hetpipe``) is refused
  when the configuration is validated (``sync/loss_scale.stage_fp16_refusal``).
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

from flotilla.core.errors import ConfigError
from flotilla.sync.loss_scale import FP16_KINDS, ScaleRule, stage_fp16_refusal
from flotilla.sync.scaler import LossScaler

__all__ = ["FP16_KINDS", "Autocast", "autocast_of", "compile_model", "loss_scaler_of", "refuse_fp16_stage"]

Autocast = Callable[[], AbstractContextManager[object]]


def autocast_of(precision: str, device: torch.device) -> Autocast:
    """A factory of the context the forward pass and loss run in: ``nullcontext`` for fp32."""
    if precision == "fp32":
        return nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.float16)
    raise ValueError(f"job.precision must be one of fp32, bf16, fp16; got {precision!r}")


def loss_scaler_of(precision: str, rule: ScaleRule | None = None) -> LossScaler | None:
    """fp16's loss scaler (a fresh one: ``GradScaler``'s defaults unless ``rule``), else None."""
    return LossScaler(rule) if precision == "fp16" else None


def refuse_fp16_stage(precision: str, kind: str, schedule: str) -> None:
    """The configuration's refusal (``config/schema.py``) as a ConfigError, for stages built
    without a validated run configuration: ``fp16`` with a schedule that has no flush
    (PipeDream's, which ``hetpipe`` always runs) in one line naming the field and what takes
    fp16."""
    why = stage_fp16_refusal(kind, schedule) if precision == "fp16" else ""
    if why:
        raise ConfigError(f"job.precision: {why}")


def compile_model(model: nn.Module, enabled: bool, backend: str) -> nn.Module:
    """Compile ``model`` in place (module doc) when ``enabled``; returns it."""
    if enabled:
        model.compile(backend=backend)
    return model
