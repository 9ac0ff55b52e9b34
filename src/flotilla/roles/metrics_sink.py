"""The coordinator's metrics sink: per-worker counters, metrics/evals files, the PS clock spread.

Heartbeats bring batches of metrics records; each batch is ingested at most once (by its batch
number).  A record is checked and converted whole before anything changes: a malformed record is
dropped (and logged), never half-counted.  Strategy ps: the records' clocks feed the clock spread
(``report/clock_spread.py``: every worker's clock at the same instant, not each one's latest
report).  Evaluation records are stored and written to ``evals.jsonl`` in the shape of
``report/headline.py`` (``normalize_eval``: no ``test_accuracy: None``, the headline named).
Not thread-safe: the coordinator calls it under its lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.core.log import get_logger
from flotilla.report.clock_spread import ClockSpread
from flotilla.report.headline import normalize_eval
from flotilla.report.metrics import EVALS_FILE, REQUIRED_EVAL_KEYS, MetricsWriter
from flotilla.report.trackers import StepMeans, Tracker

log = get_logger("coordinator")

_BAD_RECORD = (TypeError, ValueError, ArithmeticError, AttributeError, OSError)


@dataclass(slots=True)
class WorkerInfo:
    """What the coordinator knows of a worker besides its membership state."""

    worker_id: int
    name: str
    speed: float
    pid: int
    step: int = 0
    loss: float = float("nan")
    samples_per_s: float = 0.0
    membership_epoch: int = 0
    last_batch: int = -1  # heartbeat batch sequence number last ingested
    samples: int = 0
    busy_s: float = 0.0  # time spent in steps: sum of its records' interval_s (else step_s)
    steps_per_s: float = 0.0  # its training rate, smoothed over records (an announced switch's lead)
    last_record_step: int | None = None  # the step of its last training record (None: none yet)
    own_s: float = 0.0  # its own time per unit (compute + emulated slowness), smoothed: its device's pace
    clock: int | None = None  # strategy ps: the clock of its latest record
    first_clock: int | None = None  # strategy ps: the clock of its first record (> 0: joined mid-run)
    device: str = ""  # where it computes, from its records ("cpu", "cuda:0")
    transport: str = ""  # its groups' backend, from its records ("gloo", "nccl")

    def row(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "name": self.name,
            "speed": self.speed,
            "step": self.step,
            "loss": self.loss,
            "samples_per_s": self.samples_per_s,
            "membership_epoch": self.membership_epoch,
            "samples": self.samples,
            "busy_s": self.busy_s,
            "clock": self.clock,
            "first_clock": self.first_clock,
            "device": self.device,
            "transport": self.transport,
        }


class MetricsSink:
    def __init__(
        self, report_dir: str | Path | None, *, clock_spread: bool, tracker: Tracker | None = None
    ) -> None:
        self.evals: list[dict[str, Any]] = []
        self.tracker = tracker  # (report/trackers.py: TensorBoard)
        self._means = StepMeans()
        self.top_step = 0  # the furthest step any record reached (where events are marked)
        self._metrics = MetricsWriter(report_dir) if report_dir is not None else None
        self._evals = (
            MetricsWriter(report_dir, filename=EVALS_FILE, required=REQUIRED_EVAL_KEYS)
            if report_dir is not None
            else None
        )
        self.clocks = ClockSpread() if clock_spread else None

    def expect(self, worker_id: int) -> None:
        if self.clocks is not None:
            self.clocks.expect(worker_id)

    def close_clock(self, worker_id: int, *, keep: bool) -> None:
        if self.clocks is not None:
            self.clocks.close(worker_id, keep=keep)

    def ingest_batch(self, info: WorkerInfo, batch: int, records: list[Any]) -> bool:
        """Ingest a heartbeat's batch once; True if it carried a training record."""
        if batch <= info.last_batch:  # a re-sent batch (lost reply) is not ingested twice
            return False
        info.last_batch = batch
        trained = False
        for rec in records:
            try:
                trained = self._ingest(info, rec) or trained
            except _BAD_RECORD as exc:
                log.warning("worker %d: metrics record dropped (%s)", info.worker_id, exc)
        return trained

    def _ingest(self, info: WorkerInfo, rec: dict[str, Any]) -> bool:
        if rec.get("kind") == "eval":
            evaluation = normalize_eval(rec)
            self.evals.append(evaluation)
            self._track_eval(evaluation)
            if self._evals is not None:
                try:
                    self._evals.write(dict(evaluation, worker_id=info.worker_id, name=info.name))
                except ValueError as exc:  # a malformed record is not fatal
                    log.warning("eval record from worker %d not written: %s", info.worker_id, exc)
            return False
        line = (
            self._metrics.encode(dict(rec, worker_id=info.worker_id, name=info.name))
            if self._metrics is not None
            else None
        )
        # (a pipeline stage that holds no loss -- every stage but the last -- records ``loss: None``)
        has_loss = rec.get("loss", info.loss) is not None
        step, loss = (
            int(rec.get("step", info.step)),
            float(rec.get("loss", info.loss) if has_loss else math.nan),
        )
        rate = float(rec.get("samples_per_s", info.samples_per_s))
        membership_epoch = int(rec.get("membership_epoch", info.membership_epoch))
        samples = int(rec.get("samples", 0))
        # time in steps since the previous record (records may be every Nth step)
        busy_s = float(rec.get("interval_s", rec.get("step_s", 0.0)))
        if self.clocks is not None and "clock" in rec:
            if self.clocks.add(info.worker_id, rec.get("time_s"), rec["clock"]):  # type: ignore[arg-type]
                info.clock = rec["clock"]
            if info.first_clock is None:
                info.first_clock = int(rec["clock"])
        own = float(rec.get("compute_s", 0.0)) + float(rec.get("emulated_s", 0.0))
        if own > 0:
            info.own_s = own if info.own_s <= 0 else 0.8 * info.own_s + 0.2 * own
        # (a rate needs a previous record: a joiner's first one is at the step it joined at, not
        # that many steps after step 0)
        if busy_s > 0 and step > info.step and info.last_record_step is not None:
            now = (step - info.step) / busy_s
            info.steps_per_s = now if info.steps_per_s <= 0 else 0.7 * info.steps_per_s + 0.3 * now
        info.step, info.loss, info.samples_per_s = step, loss, rate
        if isinstance(rec.get("device"), str):
            info.device = rec["device"][:32]
        if isinstance(rec.get("transport"), str):
            info.transport = rec["transport"][:16]
        info.last_record_step = step
        info.membership_epoch = membership_epoch
        info.samples += samples
        info.busy_s += busy_s
        if line is not None and self._metrics is not None:
            self._metrics.append(line)
        self.top_step = max(self.top_step, step)
        if self.tracker is not None and rec.get("committed", True) and has_loss:
            self._track_unit(info, rec, step, loss, rate)
        return True

    # ------------------------------------------------------------------ trackers
    def _track_unit(self, info: WorkerInfo, rec: dict[str, Any], step: int, loss: float, rate: float) -> None:
        assert self.tracker is not None
        who = f"worker/{info.name}"
        values = {f"{who}/loss": loss, f"{who}/samples_per_s": rate}
        if "step_s" in rec:
            values[f"{who}/step_s"] = float(rec["step_s"])
        # (written with the step's job-level series, as one event: report/trackers.py)
        self._means.add(step, loss, rate, int(rec.get("world_size", 0)), values)

    def _track_eval(self, evaluation: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        step = int(evaluation.get("step", self.top_step))
        values = {
            f"eval/{key}": float(value)
            for key, value in evaluation.items()
            if key.startswith("test_") and isinstance(value, int | float) and not isinstance(value, bool)
        }
        if values:
            self.tracker.scalars(values, step)

    def flush_steps(self, below: int | None) -> None:
        """Write the series of the steps every live worker passed (None: all), a step at a time,
        each stamped with its last record's arrival; called at every heartbeat, it also lets a
        buffering tracker write what has waited (``Tracker.tick``)."""
        if self.tracker is None:
            return
        for step, series, arrived in self._means.ready(below):
            self.tracker.scalars(series, step, arrived)
        self.tracker.tick()

    def event(self, kind: str, text: str, step: int | None = None) -> None:
        """A marker (revocation, member lost or back, strategy switch) at ``step`` (None: the
        furthest step any record reached)."""
        if self.tracker is not None:
            self.tracker.event(kind, text, self.top_step if step is None else int(step))

    def close(self) -> None:
        for writer in (self._metrics, self._evals):
            if writer is not None:
                writer.close()
        if self.tracker is not None:
            self.flush_steps(None)
            self.tracker.close()
            self.tracker = None
