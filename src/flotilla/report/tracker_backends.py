"""The trackers' backends (``report/trackers.py`` says what is written and when): TensorBoard event
files through the tensorboard package's own writer, one event per step; MLflow through its own
client, in batches sent by a thread of its own.  Each takes ``scalars(values, step, wall_time)``,
``text``, ``params`` and ``close``; a failure raises, and ``trackers.Tracker`` drops the backend."""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flotilla.core.log import get_logger

__all__ = ["MLflowBackend", "TensorBoardBackend", "mlflow_name"]

log = get_logger("report")


TB_HANDOFF_S = 1.0  # an event waits at most this long (plus a heartbeat) for TensorBoard's writer...
TB_HANDOFF_EVENTS = 512  # ... or until this many are held


class TensorBoardBackend:
    """TensorBoard event files, written by the tensorboard package's own ``EventFileWriter`` (what
    ``torch.utils.tensorboard.SummaryWriter`` writes through).  The values of one step go in ONE
    event (a summary holds several values): the step's job-level series and every worker's
    series of that step (``trackers.StepMeans``).  ``SummaryWriter.add_scalar`` writes an event
    per value, and each event costs a protobuf, a pure-Python CRC (without TensorFlow) and a
    queued write: 59 us of the coordinator's CPU per value against 23 us grouped by three
    (measured here); at a few milliseconds per step that took CPU from the workers beside it (a
    3-ms-step worker ran 6.5 % slower, docs/benchmarks.md).  Events are handed to the writer's
    thread in bursts (every ``TB_HANDOFF_S`` or ``TB_HANDOFF_EVENTS``), which wakes it once per
    burst rather than per event (py-spy showed no measurable difference with one worker: the
    CRC, not the wake-ups, is its cost)."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.directory = directory
        self._writer = EventFileWriter(str(directory), max_queue_size=2 * TB_HANDOFF_EVENTS, flush_secs=5)
        self._held: list[Any] = []
        self._handed = time.monotonic()

    def _add(self, summary: Any, step: int, wall_time: float | None = None) -> None:
        when = time.time() if wall_time is None else wall_time
        self._held.append(self._event(wall_time=when, step=int(step), summary=summary))
        if len(self._held) >= TB_HANDOFF_EVENTS:
            self._hand_off()
        else:
            self.tick()

    def tick(self) -> None:
        """Hand held events over once the oldest has waited ``TB_HANDOFF_S`` (called with every
        event and by the coordinator at every heartbeat, so a stalled job's events still arrive)."""
        if self._held and time.monotonic() - self._handed >= TB_HANDOFF_S:
            self._hand_off()

    def _hand_off(self) -> None:
        held, self._held, self._handed = self._held, [], time.monotonic()  # (_handed: when the
        # held list was last emptied, so the oldest event held waits at most TB_HANDOFF_S)
        for event in held:
            self._writer.add_event(event)

    def scalars(self, values: Mapping[str, float], step: int, wall_time: float | None = None) -> None:
        value = self._summary.Value
        self._add(
            self._summary(value=[value(tag=t, simple_value=float(v)) for t, v in values.items()]),
            step,
            wall_time,
        )

    def text(self, tag: str, text: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        self._add(text_summary(tag, text), step)

    def params(self, flat: dict[str, str]) -> None:
        """(TensorBoard shows the configuration as the ``config`` text.)"""

    def close(self) -> None:
        self._hand_off()
        self._writer.flush()
        self._writer.close()


MLFLOW_FLUSH_S = 2.0  # buffered metrics go out at most this often (and at close)
_MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
MLFLOW_CLOSE_S = 30.0  # how long the end of a run waits for what is still queued
_MLFLOW_QUEUE = 100_000  # calls waiting for the sender; beyond: dropped, said once
_BAD_NAME = re.compile(r"[^\w/.\- :]")  # MLflow's allowed characters in metric and param names


def mlflow_name(name: str) -> str:
    """``name`` with the characters MLflow refuses replaced by ``_`` (a worker or metric name)."""
    return _BAD_NAME.sub("_", name)[:250]


class MLflowBackend:
    """One MLflow run through MLflow's own client (module doc).  The coordinator's calls only queue
    work: one thread of this backend talks to the store, so a slow or unreachable server never
    holds up a heartbeat; a store that fails is said once and the rest is dropped."""

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        if "://" not in uri or uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3: opt in to a path)
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
        self._pending: list[Any] = []
        self._last = time.monotonic()
        self._events: list[str] = []
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue(
            _MLFLOW_QUEUE
        )
        self.failed: str | None = None
        self._dropped = False
        self._thread = threading.Thread(target=self._send, name="mlflow", daemon=True)
        self._thread.start()

    def _put(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                log.warning("tracker mlflow: %s is not keeping up; dropping what does not fit", self.uri)

    def _send(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            if self.failed is not None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # the store's failure: say it once, train on
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("tracker mlflow failed (%s); the run goes on without it", self.failed)

    def scalars(self, values: Mapping[str, float], step: int, wall_time: float | None = None) -> None:
        from mlflow.entities import Metric

        now_ms = int((time.time() if wall_time is None else wall_time) * 1000)
        self._pending.extend(Metric(mlflow_name(t), float(v), now_ms, int(step)) for t, v in values.items())
        if len(self._pending) >= _MLFLOW_BATCH or time.monotonic() - self._last >= MLFLOW_FLUSH_S:
            self.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        if tag == "events":  # one file of every marker so far
            self._events.append(text)
            self._put(self._client.log_text, self.run_id, "\n".join(self._events) + "\n", "events.txt")
        else:
            self._put(self._client.log_text, self.run_id, text, f"{mlflow_name(tag)}.md")

    def params(self, flat: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_name(k), v[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self._put(lambda batch: self._client.log_batch(self.run_id, params=batch), items[i : i + 100])

    def flush(self) -> None:
        pending, self._pending, self._last = self._pending, [], time.monotonic()
        for i in range(0, len(pending), _MLFLOW_BATCH):
            batch = pending[i : i + _MLFLOW_BATCH]
            self._put(lambda b: self._client.log_batch(self.run_id, metrics=b), batch)

    def close(self) -> None:
        self.flush()
        self._put(self._client.set_terminated, self.run_id, "FINISHED")
        self._queue.put(None)
        self._thread.join(timeout=MLFLOW_CLOSE_S)
        if self._thread.is_alive():
            log.warning(
                "tracker mlflow: %s still busy after %.0f s; the rest is dropped", self.uri, MLFLOW_CLOSE_S
            )
        if self.failed is not None:
            raise RuntimeError(self.failed)
