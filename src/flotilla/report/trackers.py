"""Experiment trackers: the run's metrics written live where users compare runs (issue 36 item 1).

``report.trackers`` names them; today ``tensorboard`` (``torch.utils.tensorboard``'s
``SummaryWriter``, event files under ``<report>/tensorboard``; install ``flotilla[tracking]``).
Unset, TensorBoard is used when its package is installed and skipped silently otherwise; named
and not installed, the run goes on without it after one line naming the extra to install.

The coordinator writes them, as it receives the records (``roles/metrics_sink.py``):

- ``train/loss`` (the mean over the workers of a step, written once every live worker passed it),
  ``train/samples_per_s`` (their sum), ``cluster/workers_in_view`` (the step's world size);
- ``worker/<name>/loss``, ``worker/<name>/samples_per_s``, ``worker/<name>/step_s`` per record;
- ``eval/<metric>`` for every result of every evaluation (``test_accuracy``, ``test_loss``, the
  task's own), at its step;
- ``events/<kind>`` (a running count) and the text ``events`` for revocations, members lost and
  rejoined, and strategy switches, at the step the job had reached;
- the resolved configuration once, as the text ``config``.

Steps are the job's steps; wall time is the writer's (TensorBoard's "relative" axis).
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flotilla.core.log import get_logger

__all__ = ["TRACKERS", "StepMeans", "Tracker", "make_tracker"]

TRACKERS = ("tensorboard",)
EXTRA = {"tensorboard": "pip install 'flotilla[tracking]' (the tensorboard package)"}

log = get_logger("report")


class StepMeans:
    """Per-step accumulation of the workers' records: a step's mean loss, summed rate and largest
    world size, released once every live worker is past it (:meth:`ready`)."""

    def __init__(self) -> None:
        self._acc: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])

    def add(self, step: int, loss: float, samples_per_s: float, world_size: int) -> None:
        a = self._acc[step]
        a[0] += loss
        a[1] += 1
        a[2] += samples_per_s
        a[3] = max(a[3], float(world_size))

    def ready(self, below: int | None) -> list[tuple[int, float, float, int]]:
        """``(step, mean loss, summed samples/s, world size)`` of the steps below ``below``
        (None: all of them), oldest first, each once."""
        done = sorted(s for s in self._acc if below is None or s < below)
        out = []
        for s in done:
            loss, n, rate, world = self._acc.pop(s)
            out.append((s, loss / n, rate, int(world)))
        return out


class Tracker:
    """A TensorBoard writer behind the few calls the coordinator makes."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory), flush_secs=5)
        self._counts: dict[str, int] = defaultdict(int)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, step)

    def event(self, kind: str, text: str, step: int) -> None:
        """A marker: the running count of ``kind`` and a line in the ``events`` text."""
        self._counts[kind] += 1
        self._writer.add_scalar(f"events/{kind}", self._counts[kind], step)
        self._writer.add_text("events", f"step {step}: {kind}: {text}", step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def make_tracker(names: Sequence[str] | None, report_dir: str | Path | None) -> Tracker | None:
    """The tracker ``report.trackers`` asks for (module doc), or None."""
    if report_dir is None:
        return None
    wanted = list(TRACKERS) if names is None else list(names)
    if "tensorboard" not in wanted:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        if names is not None:  # named: say what to install, then go on without it
            log.warning(
                "tracker tensorboard is not installed: %s; the run goes on without it", EXTRA["tensorboard"]
            )
        return None
    return Tracker(Path(report_dir) / "tensorboard")


def config_text(config: dict[str, Any]) -> str:
    """The resolved configuration as a YAML block (TensorBoard renders markdown)."""
    import yaml

    return "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```"
