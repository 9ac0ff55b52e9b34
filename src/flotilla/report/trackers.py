"""Experiment trackers: the run's metrics written live where users compare runs (issue 36 item 1).

``report.trackers`` names them:

- ``tensorboard``: the tensorboard package's event-file writer (``report/tracker_backends.py``), under
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
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.log import get_logger
from flotilla.report.tracker_backends import MLflowBackend, TensorBoardBackend

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
