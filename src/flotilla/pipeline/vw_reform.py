"""A lost virtual worker re-formed from other devices (pure; HetPipe, SPEC §2, ``docs/hetpipe.md``).

When a VW is lost because one of its devices is gone for good (revoked), its other devices
survive, and devices no VW uses may be free (left out by the placement or the partitioner, or
newcomers).  :func:`reform` forms a VW again from them, with the partitioner the placement uses
(``pipeline/vw_placement.virtual_worker``: contiguous layer ranges, memory respected, slowest
stage minimised, PipeDream at the VW's depth):

- the lost VW's **surviving devices** are kept (they are held, and paid for, already);
- while they cannot hold the model, **free devices** are added one at a time, the one with the
  most memory first (ties: the fastest, then the order given) -- as few as hold the model, so
  the rest stay free for the next VW to re-form;
- the first group that holds the model is the new VW (the devices its cut leaves unused stay
  free: :attr:`Reformed.released`); when even every free device added does not, the answer is
  why (one line, the partitioner's), and the VW waits for more devices.

The group's devices keep the order they were given in (survivors first, in their VW's order,
then the devices added, in the order added): a pipeline's stages follow it.  Who calls it: the
simulator (``sim/hetpipe.py``), when a VW is evicted and whenever a device arrives while a VW
waits; the runtime's launcher does not yet (a VW comes back on its own devices only:
``docs/hetpipe.md``).  No I/O, no clock, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.cluster.spec import ClusterSpec, DeviceSpec
from flotilla.core.errors import ConfigError
from flotilla.pipeline.plan import PartitionOptions, PlanError
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.vw_placement import VirtualWorker, WaveSettings, virtual_worker

__all__ = ["Reformed", "reform"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Reformed:
    """The VW formed again (``vw``: its devices in pipeline order), the free devices it took
    (``added``), and those of its group its cut leaves unused (``released``: free again)."""

    vw: VirtualWorker
    added: tuple[str, ...]
    released: tuple[str, ...]


def _added_order(free: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Free devices in the order they are added: most memory, then fastest, then as given."""
    position = {d.name: i for i, d in enumerate(free)}
    return sorted(free, key=lambda d: (-d.memory_bytes, -d.speed, position[d.name]))


def reform(
    survivors: Sequence[DeviceSpec],
    free: Sequence[DeviceSpec],
    cluster: ClusterSpec,
    profile: ModelProfile,
    options: PartitionOptions,
    settings: WaveSettings,
) -> Reformed | str:
    """A VW over ``survivors`` plus as few of ``free`` as hold the model (module doc), or why
    none does.  ``cluster`` gives the links between the devices (it may hold others too)."""
    names = [d.name for d in (*survivors, *free)]
    if len(set(names)) != len(names):
        raise ValueError(f"a device may be a survivor or free, once: {names}")
    group = list(survivors)
    pool = _added_order(free)
    why = "no device left to form it from"
    while True:
        if group:
            try:
                vw = virtual_worker(group, cluster, profile, options, settings)
            except (PlanError, ConfigError) as exc:
                why = str(exc)
            else:
                added = tuple(d.name for d in group[len(survivors) :])
                return Reformed(vw=vw, added=added, released=tuple(vw.plan.unused_devices))
        if not pool:
            held = ", ".join(d.name for d in group) or "none"
            return f"{len(group)} device(s) ({held}) cannot hold the model: {why}"
        group.append(pool.pop(0))
