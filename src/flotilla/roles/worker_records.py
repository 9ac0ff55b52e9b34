"""What the worker role writes and reads besides its loop: metrics records (written once, for every
strategy) and the worker's options.

Records (sent through the coordinator link, summed by ``report/``): a training record per commit
unit with ``time_s, step, loss, samples, interval_s, epoch, membership_epoch, rank, world_size,
committed, speed, compute_s, emulated_s, step_s, samples_per_s, pid`` (and ``slowdown_factor``
where the emulation applies a transient slowdown: ``cluster/emulation.py``), plus the strategy's own
fields (PS: ``clock, pull_wait_s, pulled, read_c_global``) and, for replicas, a ``digest`` of the
parameters every ``report.digest_every_steps`` steps; a ``discarded`` record for a step lost to a
failed collective; ``kind: eval`` records.

With ``report.metrics_every_steps`` N > 1, committed units are recorded every Nth step, and at
the last step, a stop or a membership change; a record's ``samples``/``interval_s`` then also
count the committed steps held since the previous record, so sums over records count every
committed sample.  A unit that did not commit is always recorded, with its own samples only: the
held ones wait for the next committed record, unless the worker stops here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flotilla.config import RunConfig
from flotilla.core.faults import FaultPlan
from flotilla.core.log import get_logger
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.report.headline import eval_fields
from flotilla.roles.link import CoordinatorLink
from flotilla.sync.base import Outcome
from flotilla.trainer.boundary import SwitchAt
from flotilla.trainer.parts import UnitWhere
from flotilla.trainer.step import StepResult

__all__ = ["Recorder", "WorkerOptions"]

log = get_logger("worker")


class Recorder:
    """Builds and sends one worker's records (module doc)."""

    def __init__(
        self,
        link: CoordinatorLink,
        cfg: RunConfig,
        sampler: GlobalBatchSampler,
        *,
        t0_unix: float,
        speed: float,
        task: object = None,
        emulation: Callable[[], dict[str, Any]] | None = None,
        device: str = "",
        transport: str = "",
    ) -> None:
        """``device``: where the worker computes (``cpu``, ``cuda:0``), ``transport``: its groups'
        backend (``gloo``, ``nccl``); both in every training record."""
        self.link, self.sampler, self.t0_unix, self.speed = link, sampler, t0_unix, speed
        self.placement = {k: v for k, v in (("device", device), ("transport", transport)) if v}
        self.emulation = emulation  # per-step fields of the emulation (SpeedEmulator.record_fields)
        self.task = task  # its headline metric names the evaluation records (report/headline.py)
        self.every = cfg.report.metrics_every_steps
        self.digest_every = cfg.report.digest_every_steps
        self._unrecorded = (0, 0.0)  # samples and step time of committed units not recorded yet

    def unit(
        self,
        res: StepResult,
        where: UnitWhere,
        step_s: float,
        *,
        flush: bool,
        extra: dict[str, Any],
        digest: Callable[[], str] | None,
    ) -> None:
        """Record a unit (or hold it: module doc); ``flush`` forces a committed unit out."""
        d: Outcome = res.decision
        step = where.last_step
        held = (0, 0.0)
        if d.committed or d.stop:
            held, self._unrecorded = self._unrecorded, (0, 0.0)
        samples, interval_s = held[0] + res.num_samples, held[1] + step_s
        if d.committed and step % self.every and not (flush or d.stop):
            self._unrecorded = (samples, interval_s)
            return
        rec = {
            "time_s": time.time() - self.t0_unix,
            "step": step,
            "loss": res.loss,
            "samples": samples,
            "interval_s": interval_s,
            "epoch": self.sampler.data_epoch(step),
            "membership_epoch": where.view.epoch,
            "rank": where.data_split[0],  # (the split of the unit's data)
            "world_size": where.data_split[1],
            "committed": d.committed,
            "speed": self.speed,
            "compute_s": res.compute_s,
            "emulated_s": res.emulated_s,
            "step_s": step_s,
            "samples_per_s": res.num_samples / step_s if step_s > 0 else 0.0,
            "pid": os.getpid(),
            **self.placement,
            **(self.emulation() if self.emulation is not None else {}),
            **extra,
        }
        if digest is not None and self.digest_every and d.committed and (step + 1) % self.digest_every == 0:
            rec["digest"] = digest()
        if res.nonfinite:
            rec["nonfinite"] = res.nonfinite
        self.link.record(rec)

    def flush(self) -> None:
        self.link.flush()

    def discarded(self, step: int, membership_epoch: int, why: str) -> None:
        self.link.record(
            {
                "time_s": time.time() - self.t0_unix,
                "step": step,
                "loss": float("nan"),
                "samples": 0,
                "epoch": self.sampler.data_epoch(step),
                "membership_epoch": membership_epoch,
                "committed": False,
                "discarded": why[:200],
                "pid": os.getpid(),
                "speed": self.speed,
                "samples_per_s": 0.0,
            }
        )

    def evaluation(self, step: int, ev: dict[str, float]) -> None:
        self.link.record(
            {
                "kind": "eval",
                "step": step,
                "time_s": time.time() - self.t0_unix,
                **eval_fields(self.task, ev),
            }
        )


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    coordinator: str  # tcp://host:port of the coordinator
    secret: bytes
    name: str | None = None
    speed: float | None = None  # overrides the configured speed of this worker
    faults: FaultPlan | None = None  # tests: faults to inject (core/faults.py)
    view_wait_s: float = 120.0
    coordinator_wait_s: float = 120.0  # until the coordinator answers (a scheduler starts all at once)
    # switching (tests and policies): extra strategies by option number 1..n, steps fixed in
    # advance (no barrier needed), and requests carried by the next vote (barrier strategies)
    switch_options: tuple[tuple[str, Any], ...] = ()
    switch_plan: tuple[SwitchAt, ...] = ()
    switch_requests: list[int] = field(default_factory=list)
    boundary_hooks: tuple[Callable[[Any], None], ...] = ()
