"""Experiment trackers: the run's metrics written live where users compare runs (issue 36 item 1).

``report.trackers`` names them:

- ``tensorboard``: the tensorboard package's event-file writer (:class:`TensorBoardBackend`), under
  ``<report>/tensorboard`` (install ``flotilla[tracking]``);
- ``mlflow``: MLflow's own client (``mlflow-skinny``, install ``flotilla[mlflow]``) into
  ``report.mlflow_uri`` (default: a file store ``<report>/mlruns``; for a local path MLflow 3
  needs ``MLFLOW_ALLOW_FILE_STORE=true``, which this process sets for itself), experiment
  ``report.mlflow_experiment``, one MLflow run per flotilla run named after the report directory.
  Metrics are buffered and sent in batches (``log_batch``) at most every ``MLFLOW_FLUSH_S``
  seconds, by a thread of the backend (the coordinator only queues them: a slow server never holds
  up a heartbeat); names MLflow refuses have those characters replaced by ``_``; the
  configuration is logged as flattened parameters and as ``config.md``, the markers as
  ``events.txt``; the MLflow run ends ``FINISHED``.

Unset, TensorBoard is used when its package is installed and skipped silently otherwise; a tracker
named and not installed: the run goes on without it after one line naming the extra to install.

The coordinator writes them, as it receives the records (``roles/metrics_sink.py``):

- ``train/loss`` (the mean over the workers of a step, written once every live worker passed it),
  ``train/samples_per_s`` (their sum), ``cluster/workers_in_view`` (the step's world size);
- ``worker/<name>/loss``, ``worker/<name>/samples_per_s``, ``worker/<name>/step_s`` per record,
  written with its step's job-level series (one event per step);
- ``eval/<metric>`` for every result of every evaluation (``test_accuracy``, ``test_loss``, the
  task's own), at its step;
- ``events/<kind>`` (a running count) and the text ``events`` for revocations, members lost and
  rejoined, and strategy switches, at the step the job had reached;
- the resolved configuration once, as the text ``config`` (and MLflow parameters).

Steps are the job's steps; wall time is the writer's (TensorBoard's "relative" axis).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.log import get_logger

__all__ = [
    "TRACKERS",
    "MLflowBackend",
    "StepMeans",
    "TensorBoardBackend",
    "Tracker",
    "flatten",
    "make_tracker",
]

TRACKERS = ("tensorboard", "mlflow")
EXTRA = {
    "tensorboard": "pip install 'flotilla[tracking]' (the tensorboard package)",
    "mlflow": "pip install 'flotilla[mlflow]' (the mlflow-skinny package)",
}
PACKAGE = {"tensorboard": "tensorboard", "mlflow": "mlflow"}

log = get_logger("report")


class StepMeans:
    """Per-step accumulation of the workers' records: a step's mean loss, summed rate and largest
    world size, and the per-worker series of that step, released once every live worker is past
    it (:meth:`ready`), so that a step is ONE tracker event (:class:`TensorBoardBackend`)."""

    def __init__(self) -> None:
        self._acc: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        self._values: dict[int, dict[str, float]] = defaultdict(dict)
        self._arrived: dict[int, float] = {}

    def add(
        self,
        step: int,
        loss: float,
        samples_per_s: float,
        world_size: int,
        values: Mapping[str, float] | None = None,
        *,
        now: float | None = None,
    ) -> None:
        """One record of ``step``; ``values``: its worker's own series (a worker that reports a
        step twice -- a rejoin under the same name -- keeps its last values, while the step's
        mean counts both records); ``now``: when it arrived (wall clock; the step's event is
        stamped with its last record's arrival, not with its release)."""
        a = self._acc[step]
        a[0] += loss
        a[1] += 1
        a[2] += samples_per_s
        a[3] = max(a[3], float(world_size))
        if values:
            self._values[step].update(values)
        self._arrived[step] = time.time() if now is None else now

    def ready(self, below: int | None) -> list[tuple[int, dict[str, float], float]]:
        """``(step, series, arrival)`` of the steps below ``below`` (None: all of them), oldest
        first, each once: ``train/loss`` (the mean over the records), ``train/samples_per_s`` (their sum),
        ``cluster/workers_in_view`` (the largest world size, when known) and the per-worker
        series added with the records."""
        done = sorted(s for s in self._acc if below is None or s < below)
        out = []
        for s in done:
            loss, n, rate, world = self._acc.pop(s)
            series = {"train/loss": loss / n, "train/samples_per_s": rate}
            if world:
                series["cluster/workers_in_view"] = int(world)
            series.update(self._values.pop(s, {}))
            out.append((s, series, self._arrived.pop(s)))
        return out


TB_HANDOFF_S = 1.0  # an event waits at most this long (plus a heartbeat) for TensorBoard's writer...
TB_HANDOFF_EVENTS = 512  # ... or until this many are held


class TensorBoardBackend:
    """TensorBoard event files, written by the tensorboard package's own ``EventFileWriter`` (what
    ``torch.utils.tensorboard.SummaryWriter`` writes through).  The values of one step go in ONE
    event (a summary holds several values): the step's job-level series and every worker's
    series of that step (:class:`StepMeans`).  ``SummaryWriter.add_scalar`` writes an event per value, and
    each event costs a protobuf, a pure-Python CRC (without TensorFlow) and a queued write: 59 us
    of the coordinator's CPU per value against 23 us grouped by three (measured here); at a few
    milliseconds per step that took CPU from the workers beside it (a 3-ms-step worker ran 6.5 %
    slower, docs/benchmarks.md).  Events are handed to the
    writer's thread in bursts (every ``TB_HANDOFF_S`` or ``TB_HANDOFF_EVENTS``), not one by one:
    each hand-off wakes that thread, hundreds of times a second otherwise."""

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


class Tracker:
    """Every configured backend behind the few calls the coordinator makes; a backend that fails
    is logged once and dropped (tracking never stops a run)."""

    def __init__(self, backends: Sequence[Any]) -> None:
        self.backends = list(backends)
        self._counts: dict[str, int] = defaultdict(int)

    def _each(self, call: str, *args: Any) -> None:
        for b in list(self.backends):
            self._each_one(b, call, *args)

    def _each_one(self, b: Any, call: str, *args: Any) -> None:
        try:
            getattr(b, call)(*args)
        except Exception as exc:  # a tracker's own failure (disk, server): drop it, train on
            log.warning(
                "tracker %s failed (%s: %s); the run goes on without it",
                type(b).__name__,
                type(exc).__name__,
                exc,
            )
            self.backends.remove(b)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._each("scalars", {tag: value}, step)

    def scalars(self, values: Mapping[str, float], step: int, wall_time: float | None = None) -> None:
        """Several series at one step (one event where the backend can group them), stamped
        ``wall_time`` (default: now)."""
        self._each("scalars", values, step, wall_time)

    def tick(self) -> None:
        """Let buffering backends write what has waited long enough (:meth:`TensorBoardBackend.tick`)."""
        for b in list(self.backends):
            if hasattr(b, "tick"):
                self._each_one(b, "tick")

    def text(self, tag: str, text: str, step: int) -> None:
        self._each("text", tag, text, step)

    def params(self, config: dict[str, Any]) -> None:
        """The resolved configuration, flattened to ``section.key`` parameters."""
        self._each("params", flatten(config))

    def event(self, kind: str, text: str, step: int) -> None:
        """A marker: the running count of ``kind`` and a line in the ``events`` text."""
        self._counts[kind] += 1
        self.scalar(f"events/{kind}", self._counts[kind], step)
        self.text("events", f"step {step}: {kind}: {text}", step)

    def close(self) -> None:
        self._each("close")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"job": {"batch_size": 48}}`` -> ``{"job.batch_size": "48"}`` (lists as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _installed(name: str, names: Sequence[str] | None) -> bool:
    if importlib.util.find_spec(PACKAGE[name]) is not None:
        return True
    if names is not None:  # named: say what to install, then go on without it
        log.warning("tracker %s is not installed: %s; the run goes on without it", name, EXTRA[name])
    return False


def make_tracker(
    names: Sequence[str] | None,
    report_dir: str | Path | None,
    *,
    mlflow_uri: str | None = None,
    mlflow_experiment: str = "flotilla",
) -> Tracker | None:
    """The trackers ``report.trackers`` asks for (module doc), or None."""
    if report_dir is None:
        return None
    report = Path(report_dir)
    wanted = ["tensorboard"] if names is None else list(names)
    backends: list[Any] = []
    if "tensorboard" in wanted and _installed("tensorboard", names):
        backends.append(TensorBoardBackend(report / "tensorboard"))
    if "mlflow" in wanted and _installed("mlflow", names):
        uri = mlflow_uri or (report / "mlruns").resolve().as_uri()
        try:
            backends.append(MLflowBackend(uri, mlflow_experiment, report.resolve().name))
        except Exception as exc:  # an unreachable server, a store it refuses: one line, train on
            log.warning("tracker mlflow: %s: %s; the run goes on without it", uri, exc)
    return Tracker(backends) if backends else None


def config_text(config: dict[str, Any]) -> str:
    """The resolved configuration as a YAML block (TensorBoard renders markdown)."""
    import yaml

    return "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```"
