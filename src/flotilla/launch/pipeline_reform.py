"""A lost pipeline instance formed again on other devices (``flotilla run``; the strategy's
``reform`` hook, ``sync/stage_plug.py``: HetPipe's virtual workers, ``pipeline/vw_reform.py``).

When an instance was lost because one of its stage processes died of its own cause (killed,
crashed, found silent -- not a group that broke under it), :class:`Reformer` is asked, before
the instance comes back (``launch/pipeline_instances.InstanceWatch``), whether it comes back
elsewhere:

- the dead process's **device is gone** for the rest of the attempt (a revoked spot machine:
  the local launcher cannot tell a crash from a revocation, and a crash on the same device and
  cut would likely come again);
- the instance's **survivors** are its other devices (stage 0 first); the **free** devices are
  the cluster's that no instance holds (left out by the placement or a cut, released by an
  earlier re-form) and are not gone; the **others** are the instances that train;
- the strategy answers with the new instance (its devices and cut), why none can be formed yet
  (the instance waits; asked again whenever an instance is lost or comes back), or None (it
  does not re-form: the instance comes back on its own processes, nothing counted gone).

A new instance gets new stage processes, numbered after every existing one
(``StageJob.reformed``; named ``<device>~<process>``: ``pipeline/layout.process_name``); its old
ones are retired (:func:`may_come_back`, the watch's side).  Each re-form is recorded for the
summary (``instances_reformed``; an instance that never could be, with why:
``instances_not_reformed``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from flotilla.cluster.spec import DeviceSpec
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.pipeline.layout import Layout, device_of
from flotilla.pipeline.split import layer_ends_of
from flotilla.sync.stage_plug import PlaceContext, PlannedInstance, StagePlug
from flotilla.trainer.pipeline_job import StageJob

if TYPE_CHECKING:
    from flotilla.launch.pipeline_instances import InstanceWatch

__all__ = ["DeviceFeed", "Reformer", "Reshape", "may_come_back", "stuck_line"]

log = get_logger("pipeline-job")

Reshape = Callable[[int, "str | None", tuple[int, ...]], "tuple[tuple[str, ...], Layout] | str | None"]
"""``(instance, the stage process whose own failure lost it -- None: nobody's --, the instances
that train) -> the job's process names and layout with the instance formed again on new
processes, why it cannot come back yet, or None: on its own processes`` (the attempt's, over a
:class:`Reformer`: ``launch/pipeline_attempt.py``)."""


class DeviceFeed(Protocol):
    """Devices added mid-run (a :class:`Reformer` fed by a revocation schedule's ``add``s)."""

    def arrivals(self) -> bool:
        """Whether devices arrived since the last call (then worth another try)."""

    def pending(self) -> bool:
        """Whether devices may still arrive (an instance that waits for them keeps the job on)."""


def may_come_back(watch: InstanceWatch, instance: int) -> bool:
    """Whether lost ``instance`` may come back now (``InstanceWatch``, before it starts its
    newcomers): on its own processes, or formed again on new ones (``watch.reshape``: the
    watch's names and layout grow; the old processes retired)."""
    if watch.reshape is None:
        return True
    got = watch.reshape(instance, watch.lost_by.get(instance), watch.generation.instances)
    if isinstance(got, str):
        log.warning("pipeline instance %d cannot come back yet: %s", instance, got)
        watch.unable[instance] = got
        return False
    watch.unable.pop(instance, None)
    if got is not None:
        watch.names[:], watch.layout = list(got[0]), got[1]  # (in place: the supervisor reads them)
        watch.lost_by[instance] = None  # (formed again: a retry of its return takes the same)
        log.warning(
            "pipeline instance %d formed again on %s",
            instance,
            ", ".join(watch.names[g] for g in watch.layout.processes(instance)),
        )
    return True


def stuck_line(watch: InstanceWatch) -> str:
    """The job's one line when every instance is lost and none can come back (formed again)."""
    why = "; ".join(f"instance {k}: {w}" for k, w in sorted(watch.unable.items()))
    return "every pipeline instance is lost and none can come back" + (
        f" (formed again from the devices left: {why})" if why else ""
    )


class Reformer:
    """The devices gone in an attempt and the instances formed again (module doc)."""

    def __init__(self, plug: StagePlug, ctx: PlaceContext, worker: Callable[[str], Any]) -> None:
        # (``worker(name)``: the cluster's worker of that name -- speed, type, node, memory --, or
        # the cluster's defaults for a name only a revocation schedule adds)
        self.plug, self.ctx, self.worker = plug, ctx, worker
        self._lock = threading.Lock()  # (arrivals come on the revocation driver's thread)
        self._arrived: list[tuple[str, bool]] = []  # (device, added: True; revoked while idle: False)
        self._charged: dict[int, str] = {}  # instance -> the process whose loss counted its device gone
        self.gone: set[str] = set()
        self.pending: Callable[[], bool] = lambda: False  # (devices still to be added: the driver's)
        self.formed: dict[int, PlannedInstance] = {}  # instance -> its newest form
        self.records: list[dict[str, Any]] = []  # (the summary's instances_reformed)
        self.waiting: dict[int, str] = {}  # instance -> why it could not be formed again (last try)

    def arrive(self, name: str) -> None:
        """Device ``name`` was added (a revocation schedule's ``add``; the driver's thread): it is
        free from the next :meth:`arrivals` on.  Starts nothing (``RevocationDriver.spawn_worker``)."""
        with self._lock:
            self._arrived.append((name, True))

    def revoke(self, name: str) -> None:
        """Device ``name`` was revoked while no stage ran on it (the driver's thread): gone from
        the next :meth:`arrivals` on, so no instance is formed on it."""
        with self._lock:
            self._arrived.append((name, False))

    def arrivals(self) -> bool:
        """Take the devices added since the last call (the watch's thread): one gone earlier is
        back, a new name joins the cluster (the cluster's defaults); True if any came -- the
        waiting instances are worth another try."""
        with self._lock:
            events, self._arrived = self._arrived, []
        for name, added in events:
            if not added:
                self.gone.add(name)
                continue
            self.gone.discard(name)
            cluster = self.ctx.cluster
            if name not in {d.name for d in cluster.devices}:
                w = self.worker(name)
                device = DeviceSpec(
                    name=name, type=w.type, node=w.node, speed=w.speed, memory_bytes=w.memory_bytes
                )
                self.ctx = replace(self.ctx, cluster=replace(cluster, devices=(*cluster.devices, device)))
        names = [name for name, added in events if added]
        if names:
            log.info("devices added: %s (free for a lost instance to be formed again)", ", ".join(names))
        return bool(names)

    def reset(self) -> None:
        """A new attempt: every stage process starts on the placement's devices again (devices
        added earlier stay in the cluster, free)."""
        self.gone.clear()
        self.formed.clear()
        self.waiting.clear()
        self._charged.clear()

    def __call__(
        self, job: StageJob, instance: int, lost_by: str | None, live: Sequence[int]
    ) -> StageJob | str | None:
        """``job`` with ``instance`` formed again (module doc), why it cannot be yet, or None: it
        comes back on its own processes.  ``lost_by``: the stage process whose own failure lost
        it (None: nobody failed -- its group broke -- so it comes back as it was); ``live``: the
        instances that train now."""
        if lost_by is None:
            return None
        device, layout = device_of(lost_by), job.layout
        held = {
            r: tuple(device_of(job.stage_names[g]) for g in layout.processes(r))
            for r in range(layout.num_instances)
        }
        # (its device counted gone once, at the first try: one added back later is a survivor again)
        first = self._charged.get(instance) != lost_by
        gone = self.gone | {device} if first else self.gone
        survivors = tuple(d for d in held[instance] if d not in gone)
        busy = {d for devices in held.values() for d in devices}
        free = tuple(d.name for d in self.ctx.cluster.devices if d.name not in busy and d.name not in gone)
        others = tuple(held[r] for r in live if r != instance)
        try:
            got = self.plug.reform(self.ctx, survivors, free, others)
        except (ValueError, FlotillaError) as exc:  # (e.g. a training VW unplannable at the new share)
            got = f"it could not be planned: {exc}"
        if got is None:
            return None
        if first:
            self.gone.add(device)
            self._charged[instance] = lost_by
        if isinstance(got, str):
            self.waiting[instance] = got
            return got
        self.waiting.pop(instance, None)
        self._charged.pop(instance, None)
        self.formed[instance] = got
        start = job.num_processes
        self.records.append(
            {
                "instance": instance,
                "gone": device,
                "devices": list(got.devices),
                "processes": list(range(start, start + len(got.devices))),
                "layer_ends": list(layer_ends_of(got.plan)),
            }
        )
        speeds = tuple(float(self.worker(d).speed) for d in got.devices)
        return job.reformed(instance, got.devices, speeds, tuple(layer_ends_of(got.plan)))
