"""Where a pipeline stage's reports go: its progress, records, result and failure (``StageOutput``).

A stage reports through its link to the pipeline's host (``roles/stage_link.StageLink``),
wherever it runs: the host (``roles/stage_host.py``) writes what it hears into its run directory
(``stage<G>.status.json``, ``stage<G>.json``, ``stage<G>.safetensors``, ``stage<G>.failure.json``;
``G`` the stage process, ``pipeline/replicas.py``) and the records through the metrics sink into
the report directory, so the launcher reads one format for stages on its own machine and on
others.  The protocol keeps the stage's parts (``roles/stage_parts.py``) free of any transport.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["StageOutput"]


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
