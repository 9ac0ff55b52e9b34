"""Where a pipeline stage's reports go: its progress, records, results and failure.

A stage reports the same things wherever it runs; only the way they reach the launcher differs:

- :class:`FileOutput` -- a stage started by ``flotilla run`` on the launcher's machine writes
  them as files into the run directory (``stage<G>.status.json``, ``stage<G>.json``,
  ``stage<G>.safetensors``, ``stage<G>.failure.json``) and appends its records to
  ``<report_dir>/metrics.jsonl`` and ``evals.jsonl``;
- ``roles/stage_link.StageLink`` -- a stage worker started on any host (``flotilla worker``)
  sends them to the pipeline's host (``roles/stage_host.py``), which writes the same files on
  its machine, so the launcher reads one format either way.

``G`` is the stage process (``pipeline/replicas.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from flotilla.core.atomic_io import atomic_write_json
from flotilla.elastic.checkpoint import export_model
from flotilla.report.metrics import EVALS_FILE, REQUIRED_EVAL_KEYS, MetricsWriter

__all__ = ["FileOutput", "StageOutput"]


class StageOutput(Protocol):
    """What a stage reports (module doc)."""

    def status(self, st: dict[str, Any]) -> None:
        """Progress: ``step``, ``loss``, ``state`` (training, done, nonfinite), ``samples_per_s``."""

    def metric(self, rec: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (a step of this stage)."""

    def evaluation(self, rec: dict[str, Any]) -> None:
        """One ``evals.jsonl`` record (a periodic evaluation, the lead instance's last stage)."""

    def result(self, out: dict[str, Any], weights: dict[str, torch.Tensor] | None) -> None:
        """The stage's result (``stage<G>.json``) and, from the lead instance, its weights."""

    def failure(self, cause: str, line: str) -> None:
        """Why this stage failed: ``own`` or ``group`` (its stage group broke under it)."""

    def close(self) -> None: ...


class FileOutput:
    """Files in the run directory, records in the report directory (module doc)."""

    def __init__(self, run_dir: Path, report_dir: Path | None, index: int) -> None:
        self.run_dir, self.report_dir, self.index = run_dir, report_dir, index
        self.writer = MetricsWriter(report_dir) if report_dir is not None else None

    def status(self, st: dict[str, Any]) -> None:
        atomic_write_json(self.run_dir / f"stage{self.index}.status.json", st)

    def metric(self, rec: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(rec)

    def evaluation(self, rec: dict[str, Any]) -> None:
        if self.report_dir is not None:
            with MetricsWriter(self.report_dir, filename=EVALS_FILE, required=REQUIRED_EVAL_KEYS) as w:
                w.write(rec)

    def result(self, out: dict[str, Any], weights: dict[str, torch.Tensor] | None) -> None:
        if weights is not None:
            export_model(self.run_dir / f"stage{self.index}.safetensors", weights)
        atomic_write_json(self.run_dir / f"stage{self.index}.json", out)

    def failure(self, cause: str, line: str) -> None:
        try:
            path = self.run_dir / f"stage{self.index}.failure.json"
            atomic_write_json(path, {"cause": cause, "line": line})
        except OSError:
            pass  # (the launcher falls back on the log)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
