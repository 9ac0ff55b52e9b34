"""The record of a pipeline job's instances lost, brought back and regrouped, every attempt's
(``launch/pipeline_instances.InstanceWatch`` writes it; the summary's ``instances_lost``,
``instances_back``, ``instances_regrouped`` and ``degraded`` read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["InstanceLog"]


@dataclass
class InstanceLog:
    """Every attempt's losses and returns of pipeline instances (the summary's)."""

    lost: list[dict[str, Any]] = field(default_factory=list)
    returned: list[dict[str, Any]] = field(default_factory=list)
    # (newcomer rounds started so far, every attempt: a round's serial, its ``arrival``)
    arrivals: int = 0
    regrouped: list[dict[str, Any]] = field(default_factory=list)  # (groups re-formed, nobody lost)
    free_returns: int = 0  # (returns after a loss nobody caused: the budget untouched; FREE_RETURNS at most)

    def note(self) -> str | None:
        """What a completed run went through (None: no instance was lost)."""
        if not self.lost:
            return None
        parts = [f"instance {e['instance']} ({e['stage']}, exit code {e['exit_code']})" for e in self.lost]
        back = self.returned
        tail = f"; back: instance(s) {', '.join(str(e['instance']) for e in back)}" if back else ""
        return f"lost pipeline {', '.join(parts)}{tail}"
