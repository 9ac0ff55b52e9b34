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

The strategy may ask for the model's layer profile at a share of a batch not measured yet (fewer
instances train: larger shares).  Measuring it runs the model, which may take long; it is done on
a thread of its own (:class:`Profiles`), never on the watch's: a try that needs it waits for it up
to ``PROFILE_WAIT_S``, then the instance waits (``profiling ...``), and the next poll after the
profile is in tries it again (:meth:`Reformer.arrivals`) -- the watch keeps finding deaths and
silences meanwhile.
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
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.split import layer_ends_of
from flotilla.sync.stage_plug import PlaceContext, PlannedInstance, StagePlug
from flotilla.trainer.pipeline_job import StageJob

if TYPE_CHECKING:
    from flotilla.launch.pipeline_instances import InstanceWatch

__all__ = ["PROFILE_WAIT_S", "DeviceFeed", "Profiles", "Reformer", "Reshape", "may_come_back", "stuck_line"]

log = get_logger("pipeline-job")

PROFILE_WAIT_S = 0.2  # (how long a try waits for a profile being measured: a cached one is at once)

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


class Profiling(FlotillaError):
    """The profile asked for is being measured (:class:`Profiles`): ask again once it is in."""


class Profiles:
    """``profile_for(share)`` measured on a thread of its own per share (module doc): a call
    returns the profile once it is in (it waits up to ``wait_s`` for it), raises
    :class:`Profiling` meanwhile, or what measuring it raised."""

    def __init__(self, profile_for: Callable[[int], ModelProfile], wait_s: float = PROFILE_WAIT_S) -> None:
        self._profile_for, self.wait_s = profile_for, wait_s
        self._lock = threading.Lock()
        self._made: dict[int, ModelProfile | FlotillaError] = {}
        self._making: dict[int, threading.Event] = {}
        self._unseen: set[int] = set()  # (shares come in since asked: :meth:`came_in`)

    def __call__(self, share: int) -> ModelProfile:
        with self._lock:
            done = self._making.get(share)
            if done is None and share not in self._made:
                done = self._making[share] = threading.Event()
                threading.Thread(target=self._make, args=(share, done), name="profile", daemon=True).start()
        if done is not None and not done.wait(self.wait_s):
            raise Profiling(f"profiling the model at a share of {share} samples (in the background)")
        with self._lock:
            got = self._made[share]
            self._unseen.discard(share)  # (this very try has it)
        if isinstance(got, FlotillaError):
            raise got
        return got

    def _make(self, share: int, done: threading.Event) -> None:
        try:
            got: ModelProfile | FlotillaError = self._profile_for(share)
        except FlotillaError as exc:
            got = exc
        except Exception as exc:  # (the task's own code ran: its error is the answer, not a crash)
            got = FlotillaError(f"profiling the model at a share of {share} samples failed: {exc}")
        with self._lock:
            self._made[share] = got
            del self._making[share]
            self._unseen.add(share)
        done.set()

    def busy(self) -> bool:
        """Whether a profile is being measured."""
        with self._lock:
            return bool(self._making)

    def came_in(self) -> bool:
        """Whether a profile came in since the last call (a waiting instance is worth a try)."""
        with self._lock:
            fresh = bool(self._unseen)
            self._unseen.clear()
            return fresh


class Reformer:
    """The devices gone in an attempt and the instances formed again (module doc)."""

    def __init__(self, plug: StagePlug, ctx: PlaceContext, worker: Callable[[str], Any]) -> None:
        # (``worker(name)``: the cluster's worker of that name -- speed, type, node, memory --, or
        # the cluster's defaults for a name only a revocation schedule adds)
        self.profiles = Profiles(ctx.profile_for)
        self.plug, self.ctx, self.worker = plug, replace(ctx, profile_for=self.profiles), worker
        self._lock = threading.Lock()  # (arrivals come on the revocation driver's thread)
        self._arrived: list[tuple[str, bool]] = []  # (device, added: True; revoked while idle: False)
        self._charged: dict[int, str] = {}  # instance -> the process whose loss counted its device gone
        self.gone: set[str] = set()
        self.adds_pending: Callable[[], bool] = lambda: False  # (devices still to be added: the driver's)
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

    def pending(self) -> bool:
        """Whether a waiting instance may yet be formed: devices still to be added, or a profile
        being measured."""
        return self.adds_pending() or self.profiles.busy()

    def arrivals(self) -> bool:
        """Take the devices added since the last call (the watch's thread): one gone earlier is
        back, a new name joins the cluster (the cluster's defaults); True if any came, or a
        profile came in -- the waiting instances are worth another try."""
        profiled = self.profiles.came_in()
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
        return bool(names) or profiled

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
        except Profiling as exc:  # (asked again once it is in: arrivals)
            got = str(exc)
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
