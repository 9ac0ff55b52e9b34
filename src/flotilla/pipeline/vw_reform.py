"""A lost virtual worker re-formed from other devices (pure; HetPipe, SPEC §2, ``docs/hetpipe.md``).

When a VW is lost because one of its devices is gone for good (revoked), its other devices
survive, and devices no VW uses may be free (left out by the placement or the partitioner, or
newcomers).  :func:`reform` forms a VW again from them, with the partitioner the placement uses
(``pipeline/vw_placement.virtual_worker``: contiguous layer ranges, memory respected, slowest
stage minimised, PipeDream at the VW's depth):

- the lost VW's **surviving devices** are kept (they are held, and paid for, already);
- **free devices** are added one at a time, the one with the most memory first (ties: the
  fastest, then the order given), while the group cannot hold the model **or** the job would be
  no faster with it: under WSP every VW moves at the slowest one's pace (``vw_placement``'s cost
  model), so a slow VW formed again could slow every other down -- the job's predicted
  throughput with it (``k + 1`` VWs, each at its share of the batch) must beat the throughput of
  the ``k`` VWs that train now without it -- unless those ``k`` cannot hold their share (fewer VWs,
  larger shares: they run over their devices' memory), when any VW that holds its own share
  helps.  As few devices are added as do that, so the rest stay free for the next VW to re-form;
- the first group that does is the new VW (the devices its cut leaves unused stay free:
  :attr:`Reformed.released`); when even every free device added does not, the answer is why (one
  line: the partitioner's, or the two throughputs), and the VW waits for more devices.

The group's devices keep the order they were given in (survivors first, in their VW's order,
then the devices added, in the order added): a pipeline's stages follow it.  Who calls it: the
simulator (``sim/hetpipe.py``), when a VW is evicted and whenever a device arrives while a VW
waits; ``flotilla run`` with ``strategy.reform`` (``sync/hetpipe_place.reform_vw`` through
``launch/pipeline_reform.py``), before a lost VW would come back.  No I/O, no clock, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flotilla.cluster.spec import ClusterSpec, DeviceSpec
from flotilla.core.errors import ConfigError
from flotilla.pipeline.plan import PartitionOptions, PlanError
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.vw_placement import VirtualWorker, WaveSettings, job_estimate, virtual_worker

__all__ = ["Reformed", "reform"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Reformed:
    """The VW formed again (``vw``: its devices in pipeline order, planned at its share of the
    batch), the free devices it took (``added``), those of its group its cut leaves unused
    (``released``: free again), and the job's predicted throughput with and without it."""

    vw: VirtualWorker
    added: tuple[str, ...]
    released: tuple[str, ...]
    samples_per_s: float
    without_samples_per_s: float


def _added_order(free: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Free devices in the order they are added: most memory, then fastest, then as given."""
    position = {d.name: i for i, d in enumerate(free)}
    return sorted(free, key=lambda d: (-d.memory_bytes, -d.speed, position[d.name]))


def reform(
    survivors: Sequence[DeviceSpec],
    free: Sequence[DeviceSpec],
    others: Sequence[Sequence[DeviceSpec]],
    cluster: ClusterSpec,
    profile_for: Callable[[int], ModelProfile],
    batch_size: int,
    options: PartitionOptions,
    settings: WaveSettings,
) -> Reformed | str:
    """A VW over ``survivors`` plus as few of ``free`` as hold the model and speed the job up
    (module doc), or why none does.  ``others``: the devices of the VWs that train now;
    ``profile_for(share)``: the model's layer profile at a VW's share of a batch of
    ``batch_size``; ``cluster`` gives the links between the devices (it may hold others too)."""
    names = [d.name for d in (*survivors, *free, *(d for o in others for d in o))]
    if len(set(names)) != len(names):
        raise ValueError(f"a device may be a survivor, free or another VW's, once: {names}")
    k = len(others)
    now_profile = profile_for(max(1, batch_size // max(1, k)))
    after_profile = profile_for(max(1, batch_size // (k + 1)))

    def plan(devices: Sequence[DeviceSpec], profile: ModelProfile) -> VirtualWorker:
        return virtual_worker(devices, cluster, profile, options, settings)

    try:
        after = [plan(o, after_profile) for o in others]
    except (PlanError, ConfigError) as exc:
        raise ValueError(f"a VW that trains now cannot be planned: {exc}") from None
    try:
        now = [plan(o, now_profile) for o in others]
    except (PlanError, ConfigError):
        # (the VWs that train now hold more than their devices' memory at their share of a batch --
        # fewer VWs, larger shares: a VW formed again lightens them, whatever its pace)
        now = []
    without = job_estimate(now, now_profile, cluster, settings).throughput_samples_per_s if now else 0.0
    group, pool = list(survivors), _added_order(free)
    why = "no device left to form it from"
    while True:
        if group:
            try:
                vw = plan(group, after_profile)
            except (PlanError, ConfigError) as exc:
                why = str(exc)
            else:
                with_it = job_estimate(
                    [*after, vw], after_profile, cluster, settings
                ).throughput_samples_per_s
                if with_it > without:
                    return Reformed(
                        vw=vw, added=tuple(d.name for d in group[len(survivors) :]),
                        released=tuple(vw.plan.unused_devices), samples_per_s=with_it,
                        without_samples_per_s=without,
                    )  # fmt: skip
                why = (
                    f"the job would be slower with it ({with_it:.4g} samples/s) than without "
                    f"({without:.4g}): a slow VW paces every VW under WSP"
                )
        if not pool:
            held = ", ".join(d.name for d in group) or "none"
            return f"{len(group)} device(s) ({held}) form no VW: {why}"
        group.append(pool.pop(0))
