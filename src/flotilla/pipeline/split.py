"""Cut an ``nn.Sequential`` into pipeline stages, choose the cut points, find boundary shapes.

- ``split_sequential(model, layer_ends)``: stage i is ``nn.Sequential(model[start_i:end_i])``; the
  stage modules SHARE the layers of ``model`` (no copy), so the stages' parameters are exactly the
  model's, in order.
- ``fixed_stage_plan(profile, devices, ...)``: the runtime's partition when the number of stages is
  fixed and stage i runs on ``devices[i]`` (one device per stage, in the given order).  A dynamic
  program over contiguous splits minimises the bottleneck stage time and then the sum of stage
  times, with the cost model of ``flotilla.pipeline.plan`` (same formulas as ``partition``); a
  split whose stage does not fit its device's memory is never chosen, and when none fits a
  ``PlanError`` names each device and its shortfall.
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
from flotilla.pipeline.model_check import probing
from flotilla.pipeline.plan import (
    CostModel,
    Devices,
    LinkModel,
    PartitionOptions,
    PipelinePlan,
    PlanError,
    cluster_parts,
    evaluate_plan,
    memory_shortfalls,
)
from flotilla.pipeline.profile import ModelProfile

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


def layer_ends_of(plan: PipelinePlan) -> tuple[int, ...]:
    """The ``layer_ends`` of a plan's stages."""
    return tuple(stage.layer_end for stage in plan.stages)


def even_layer_ends(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Near-equal numbers of layers per stage (the first stages get the extra ones)."""
    if not 1 <= num_stages <= num_layers:
        raise ConfigError(
            f"num_stages must be in [1, {num_layers}] for {num_layers} layers, got {num_stages}"
        )
    base, extra = divmod(num_layers, num_stages)
    ends, total = [], 0
    for i in range(num_stages):
        total += base + (1 if i < extra else 0)
        ends.append(total)
    return tuple(ends)


def fixed_stage_plan(
    profile: ModelProfile,
    devices: Devices,
    links: LinkModel | None = None,
    options: PartitionOptions | None = None,
) -> PipelinePlan:
    """Best contiguous split of the layers into ``len(devices)`` stages, stage i on ``devices[i]``
    (a ``ClusterSpec``'s devices in declaration order, or a list with ``links``)."""
    devices, links = cluster_parts(devices, links)
    options = options or PartitionOptions()
    p, num_layers = len(devices), profile.num_layers
    if not 1 <= p <= num_layers:
        raise ConfigError(f"need between 1 and {num_layers} devices (one per stage), got {p}")
    model = CostModel(profile, links, options)

    def stage_cost(s: int, j: int, k: int) -> float | None:
        if model.memory_bytes(j, k, 1, p - s, p) > devices[s].memory_bytes:
            return None
        comm = model.comm_s(k, [devices[s]], [devices[s + 1]]) if s + 1 < p else 0.0
        return model.stage_s(model.compute_s(j, k, [devices[s]]), comm)

    # best[s][j]: (bottleneck, total, next cut) for layers [j, L) on stages s..p-1
    best: list[dict[int, tuple[float, float, int]]] = [dict() for _ in range(p)]
    for j in range(p - 1, num_layers):
        cost = stage_cost(p - 1, j, num_layers)
        if cost is not None:
            best[p - 1][j] = (cost, cost, num_layers)
    for s in range(p - 2, -1, -1):
        for j in range(s, num_layers - (p - s) + 1):
            options_here = []
            for k in range(j + 1, num_layers - (p - s - 1) + 1):
                rest, cost = best[s + 1].get(k), stage_cost(s, j, k)
                if rest is not None and cost is not None:
                    options_here.append((max(cost, rest[0]), cost + rest[1], k))
            if options_here:
                best[s][j] = min(options_here)
    names = [(d.name,) for d in devices]
    if 0 not in best[0]:
        even = evaluate_plan(profile, devices, links, options, even_layer_ends(num_layers, p), names)
        raise PlanError(
            f"no split of {num_layers} layers over {p} stage(s) fits in memory; with an even split, "
            + "; ".join(memory_shortfalls(even, devices) or ["(memory model mismatch)"])
        )
    ends, j = [], 0
    for s in range(p):
        j = best[s][j][2]
        ends.append(j)
    return evaluate_plan(profile, devices, links, options, ends, names)


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
