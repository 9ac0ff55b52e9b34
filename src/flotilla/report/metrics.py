"""Run metrics: the per-step records (``metrics.jsonl``), their writer and readers, report constants.

Invariants:

- ``metrics.jsonl`` holds one JSON object per line, one per worker per step, with at least
  ``REQUIRED_METRIC_KEYS``.  Each record is appended with a single ``write(2)`` on an
  ``O_APPEND`` descriptor, so several worker processes may share one file without interleaving
  lines; a reader skips a torn last line left by a killed writer;
- ``evals.jsonl`` holds one record per periodic evaluation (``time_s``, ``step``, ``test_<name>``
  for the loss and every task metric, ``headline``/``headline_mode``: ``flotilla.report.headline``),
  appended as each arrives, so a watcher (e.g. a time-to-accuracy benchmark) can follow a live run;
  the same records end up in ``summary.json``'s ``evals``.

The run summary is ``flotilla.report.summary``; the plots drawn from these records are
``flotilla.report.plots``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from flotilla.core.log import get_logger

__all__ = [
    "EVALS_FILE",
    "EVAL_PLOT",
    "LOSS_PLOT",
    "METRICS_FILE",
    "REQUIRED_EVAL_KEYS",
    "REQUIRED_METRIC_KEYS",
    "REQUIRED_SUMMARY_KEYS",
    "SUMMARY_FILE",
    "THROUGHPUT_PLOT",
    "MetricsWriter",
    "read_jsonl",
    "read_metrics",
    "read_run_records",
    "require_keys",
    "to_jsonable",
]

METRICS_FILE = "metrics.jsonl"
EVALS_FILE = "evals.jsonl"
REQUIRED_EVAL_KEYS = ("time_s", "step")
SUMMARY_FILE = "summary.json"
LOSS_PLOT = "loss_vs_time.png"
EVAL_PLOT = "eval_vs_time.png"
THROUGHPUT_PLOT = "throughput_vs_time.png"
REQUIRED_METRIC_KEYS = (
    "time_s",
    "worker_id",
    "step",
    "loss",
    "samples",
    "epoch",
    "membership_epoch",
)
REQUIRED_SUMMARY_KEYS = ("steps", "wall_s", "samples_per_s", "num_workers")
SPOOL_GLOB = "records-*.jsonl"  # a worker's own records once the coordinator is gone (ring mode)

_log = get_logger("report")


def to_jsonable(value: Any) -> Any:
    """numpy/torch scalars and arrays to plain Python; mappings and sequences recursively."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy arrays/scalars, torch tensors
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON: {value!r}")


def require_keys(record: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    """ValueError naming the keys of ``keys`` that ``record`` lacks (``what`` names the record)."""
    absent = [k for k in keys if k not in record]
    if absent:
        raise ValueError(f"{what} is missing required key(s) {absent}; required: {list(keys)}")


class MetricsWriter:
    """Appends metric records to ``<report_dir>/metrics.jsonl`` (or ``filename``, records needing
    ``required`` keys); thread-safe, a context manager."""

    def __init__(
        self, report_dir: str | Path, *, filename: str = METRICS_FILE, required: tuple[str, ...] | None = None
    ) -> None:
        self.path = Path(report_dir) / filename
        self._required = REQUIRED_METRIC_KEYS if required is None else required
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (needs the required keys; ValueError names a missing one)."""
        self.append(self.encode(record))

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """The line ``write`` would append (checks the record; writes nothing)."""
        require_keys(record, self._required, f"{self.path.name} record")
        return (json.dumps(to_jsonable(record), sort_keys=True) + "\n").encode()

    def append(self, line: bytes) -> None:
        """Append a line made by ``encode``."""
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"MetricsWriter for {self.path} is closed")
            written = os.write(self._fd, line)
        if written != len(line):  # regular files do not short-write short lines in practice
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(report_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<report_dir>/metrics.jsonl`` in file order (torn lines are skipped)."""
    return read_jsonl(Path(report_dir) / METRICS_FILE)


def read_run_records(report_dir: str | Path) -> list[dict[str, Any]]:
    """Every training-step record of a run: ``metrics.jsonl`` (what the coordinator received while
    it lived) followed by each worker's spool ``records-<name>.jsonl`` (what it wrote once the
    coordinator was gone); evaluation records and records without a ``step`` are left out."""
    root = Path(report_dir)
    records = read_jsonl(root / METRICS_FILE, missing_ok=True)
    for path in sorted(root.glob(SPOOL_GLOB)):
        records += read_jsonl(path)
    return [r for r in records if r.get("kind", "train") == "train" and "step" in r]


def read_jsonl(path: str | Path, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON-lines file in order, skipping torn or malformed lines (a line being
    written by a live run); ``[]`` for a missing file with ``missing_ok``."""
    p = Path(path)
    if missing_ok and not p.exists():
        return []
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            _log.warning("skipping malformed line %d of %s", lineno, p.name)
    return records
