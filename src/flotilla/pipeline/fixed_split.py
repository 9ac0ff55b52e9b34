"""The runtime's split when the number of stages is fixed (pure: no torch, no I/O; the stage
runtime, ``flotilla plan`` and the simulator call it, ``pipeline/split.py`` re-exports it).

- ``fixed_stage_plan(profile, devices, ...)``: stage i runs on ``devices[i]`` (one device per
  stage, in the given order).  A dynamic program over contiguous splits minimises the bottleneck
  stage time and then the sum of stage times, with the cost model of ``flotilla.pipeline.plan``
  (same formulas as ``partition``); a split whose stage does not fit its device's memory is never
  chosen, and when none fits a ``PlanError`` names each device and its shortfall.
- ``even_layer_ends``, ``layer_ends_of``: near-equal layer counts per stage; a plan's cuts.
"""

from __future__ import annotations

from flotilla.core.errors import ConfigError
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

__all__ = ["even_layer_ends", "fixed_stage_plan", "layer_ends_of"]


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
