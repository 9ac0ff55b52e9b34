"""HetPipe's virtual workers placed for a run (``placement: np | ed | hd | auto``): the launcher's
``place`` hook (``sync/stage_plug.py``) over the pure placement (``pipeline/vw_placement.py``).

Each VW's pipeline is cut by the partitioner over its own devices without replicated stages (a
stage process runs on one device); a device the cut leaves unused, or that the placement leaves
out, is not started.  The task's layers are profiled on one VW's share of a batch: the number of
VWs is the placement's, so the profile is taken again at the chosen count's share and the
placement chosen again with it (at most three rounds; the count rarely moves twice).  The report
``flotilla plan`` prints is the last round's: every policy's VWs, memory per stage against each
device's budget, predicted throughputs and the choice (``pipeline/vw_report.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.pipeline.vw_placement import Placement, WaveSettings, choose
from flotilla.pipeline.vw_reform import reform
from flotilla.pipeline.vw_report import format_choice
from flotilla.sync.stage_plug import PlaceContext, Placed, PlannedInstance

__all__ = ["place_vws", "reform_vw"]

log = get_logger("hetpipe")


def place_vws(settings: Any, ctx: PlaceContext) -> Placed:
    """The VWs of ``settings.placement`` over ``ctx.cluster`` (module doc); ConfigError (one
    line, the placement's reason) when it cannot hold the model."""
    waves = WaveSettings(
        s_local=settings.s_local, clock_distance=settings.clock_distance, ps_shards=settings.ps_shards
    )
    options = replace(ctx.options, allow_replication=False)  # (a stage process: one device)
    count = max(1, len(ctx.cluster.nodes))
    for _ in range(3):
        profile = ctx.profile_for(max(1, ctx.batch_size // count))
        choice = choose(ctx.cluster, profile, settings.placement, options, waves)
        chosen = choice.chosen
        if len(chosen.vws) == count:
            break
        count = len(chosen.vws)
    else:
        log.warning(
            "placement %s: %d VW(s) chosen from a profile at %d VWs' share (the count kept moving): "
            "the stages' memory may be off by that share",
            chosen.policy, len(chosen.vws), count,
        )  # fmt: skip
    if ctx.batch_size < len(chosen.vws):
        raise ConfigError(
            f"strategy.placement: {chosen.policy} forms {len(chosen.vws)} virtual workers, each "
            f"taking a share of every batch; job.batch_size ({ctx.batch_size}) must be >= that"
        )
    instances = tuple(
        PlannedInstance(devices=tuple(stage.devices[0] for stage in vw.plan.stages), plan=vw.plan)
        for vw in chosen.vws
    )
    unused = sorted({d.name for d in ctx.cluster.devices} - {n for i in instances for n in i.devices})
    for k, inst in enumerate(instances):
        cuts = ", ".join(
            f"{n} layers {s.layer_start}-{s.layer_end - 1}"
            for n, s in zip(inst.devices, inst.plan.stages, strict=True)
        )
        log.info("placement %s: VW %d: %s", chosen.policy, k, cuts)
    if unused:
        log.info("placement %s leaves %s unused", chosen.policy, ", ".join(unused))
    return Placed(
        instances=instances,
        profile=profile,
        summary=_summary(settings.placement, chosen, instances, unused),
        report=format_choice(choice, ctx.cluster, waves, settings.placement, profile, options),
    )


def reform_vw(
    settings: Any,
    ctx: PlaceContext,
    survivors: tuple[str, ...],
    free: tuple[str, ...],
    others: tuple[tuple[str, ...], ...],
) -> PlannedInstance | str:
    """A lost VW formed again from its ``survivors`` and ``free`` devices beside the ``others``
    that train (``pipeline/vw_reform.reform``: the placement's partitioner, without replicated
    stages), or why none can be formed yet."""
    waves = WaveSettings(
        s_local=settings.s_local, clock_distance=settings.clock_distance, ps_shards=settings.ps_shards
    )
    options = replace(ctx.options, allow_replication=False)  # (a stage process: one device)
    by = {d.name: d for d in ctx.cluster.devices}
    got = reform(
        [by[n] for n in survivors],
        [by[n] for n in free],
        [[by[n] for n in o] for o in others],
        ctx.cluster,
        ctx.profile_for,
        ctx.batch_size,
        options,
        waves,
    )
    if isinstance(got, str):
        return got
    plan = got.vw.plan
    devices = tuple(stage.devices[0] for stage in plan.stages)
    log.info(
        "hetpipe: a VW formed again on %s (%s added; predicted %.4g samples/s with it, %.4g without)",
        ", ".join(devices), ", ".join(got.added) or "none", got.samples_per_s, got.without_samples_per_s,
    )  # fmt: skip
    return PlannedInstance(devices=devices, plan=plan)


def _summary(
    configured: str, chosen: Placement, instances: tuple[PlannedInstance, ...], unused: list[str]
) -> dict[str, Any]:
    return {
        "configured": configured,
        "policy": chosen.policy,
        "vws": [
            {"devices": list(i.devices), "layer_ends": [s.layer_end for s in i.plan.stages]}
            for i in instances
        ],
        "unused": unused,
        "predicted_samples_per_s": round(chosen.throughput_samples_per_s, 3),
    }
