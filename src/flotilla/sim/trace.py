"""A spot trace replayed onto a simulated cluster (pure; ``docs/simulator.md``).

The runtime's replay (``cluster/revocation_trace.replay_trace``: the same parse, the same slot
rule) decides which trace *slot* is revoked or arrives when; a slot is then a **group** of
devices, so that a trace of a few dozen nodes drives a cluster of thousands:

- the trace starts ``k`` slots (its nodes alive at ``start_ms``, at most ``max_slots``); the
  cluster's devices, in order, are split into ``k`` groups of ``ceil(n / k)`` (the last may be
  smaller): slot ``i`` is group ``i``;
- a slot the trace adds later (``spot-j``) is a group of as many new devices
  (``spot-j/<m>``, of the cluster's first class: ``SimCluster.spare``);
- a slot's revocation revokes every device of its group at that instant; its arrival brings
  them all.

``time_scale`` is the runtime's: trace seconds per simulated second.
"""

from __future__ import annotations

import math

from flotilla.cluster.revocation_trace import (
    TraceAction,
    TraceEvent,
    TraceReplay,
    initial_nodes,
    replay_trace,
)
from flotilla.sim.model import Change, SimCluster

__all__ = ["trace_changes"]


def trace_changes(
    cluster: SimCluster,
    events: tuple[TraceEvent, ...],
    *,
    time_scale: float = 1.0,
    start_ms: int = 0,
    max_slots: int | None = None,
) -> tuple[list[Change], int]:
    """The device-level changes of ``events`` on ``cluster`` (see the module doc), and the group
    size.  Raises the runtime's ``TraceError`` when no node is alive at ``start_ms``."""
    devices = [d.name for d in cluster.devices()]
    cap = max_slots or max(len(devices), 1)
    probe = TraceReplay(events=events, time_scale=time_scale, max_workers=cap, start_ms=start_ms)
    k = len(initial_nodes(probe))
    group = math.ceil(len(devices) / k) if k else len(devices)
    slots = [f"slot-{i}" for i in range(k)]
    members = {slot: devices[i * group : (i + 1) * group] for i, slot in enumerate(slots)}
    changes: list[Change] = []
    for sc in replay_trace(probe, slots):
        names = members.get(sc.worker)
        if names is None:  # a slot beyond the initial ones: a group of new devices
            names = members[sc.worker] = [f"{sc.worker}/{m}" for m in range(group)]
        kill = sc.action is TraceAction.REMOVE
        changes += [Change(sc.at_s, kill, name) for name in names]
    return changes, group
