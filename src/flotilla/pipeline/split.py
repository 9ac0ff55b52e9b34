"""Cut an ``nn.Sequential`` into pipeline stages, choose the cut points, find boundary shapes.

- ``split_sequential(model, layer_ends)``: stage i is ``nn.Sequential(model[start_i:end_i])``; the
  stage modules SHARE the layers of ``model`` (no copy), so the stages' parameters are exactly the
  model's, in order.
- ``fixed_stage_plan(profile, devices, ...)``: the runtime's partition when the number of stages is
  fixed (pure: ``pipeline/fixed_split.py``, which the simulator calls too; re-exported here).
- ``boundary_specs(model, sample, layer_ends)``: the per-sample shape and dtype of the tensor that
  crosses each stage boundary, found by one forward pass of a small sample.  Assumption: every
  activation has the batch dimension first and its other dimensions do not depend on the batch
  size (true for the zoo and the char transformer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.pipeline.fixed_split import even_layer_ends, fixed_stage_plan, layer_ends_of
from flotilla.pipeline.model_check import probing

__all__ = [
    "ActivationSpec",
    "boundary_specs",
    "even_layer_ends",
    "fixed_stage_plan",
    "layer_ends_of",
    "split_sequential",
]


@dataclass(frozen=True, slots=True)
class ActivationSpec:
    """Shape of ONE sample (no batch dimension) and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def for_batch(self, batch_size: int) -> tuple[int, ...]:
        return (batch_size, *self.shape)

    def bytes_for(self, batch_size: int) -> int:
        return batch_size * math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def _check_ends(num_layers: int, layer_ends: Sequence[int]) -> tuple[int, ...]:
    ends = tuple(int(e) for e in layer_ends)
    starts = (0, *ends[:-1])
    if not ends or ends[-1] != num_layers or any(a >= b for a, b in zip(starts, ends)):
        raise ConfigError(f"layer_ends must be strictly increasing and end at {num_layers}, got {list(ends)}")
    return ends


def split_sequential(model: nn.Sequential, layer_ends: Sequence[int]) -> list[nn.Sequential]:
    """Stage modules of ``model`` cut after layers ``layer_ends[i] - 1`` (layers are shared)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"pipeline models must be nn.Sequential, got {type(model).__name__}")
    ends = _check_ends(len(model), layer_ends)
    starts = (0, *ends[:-1])
    return [nn.Sequential(*(model[i] for i in range(j, k))) for j, k in zip(starts, ends)]


def boundary_specs(
    model: nn.Sequential, sample: torch.Tensor, layer_ends: Sequence[int]
) -> list[ActivationSpec]:
    """Per-sample shape/dtype of the output of each stage but the last (one forward of ``sample``,
    a microbatch, in eval mode; the model's buffers are restored: ``model_check.probing``)."""
    ends = _check_ends(len(model), layer_ends)
    with probing(model):
        return _specs(model, sample, ends)


def _specs(model: nn.Sequential, sample: torch.Tensor, ends: tuple[int, ...]) -> list[ActivationSpec]:
    specs, x = [], sample
    for idx, layer in enumerate(model):
        x = layer(x)
        if idx + 1 in ends[:-1]:
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != sample.shape[0]:
                raise ConfigError(
                    f"the output of layer {idx} must be one tensor with the batch dimension first"
                )
            specs.append(ActivationSpec(shape=tuple(int(d) for d in x.shape[1:]), dtype=x.dtype))
    return specs
