"""The record of a pipeline job's instances lost, brought back and regrouped, every attempt's
(``launch/pipeline_instances.InstanceWatch`` writes it; the summary's ``instances_lost``,
``instances_back``, ``instances_regrouped`` and ``degraded`` read it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.core.log import get_logger
from flotilla.pipeline.replicas import Generation

__all__ = ["InstanceLog"]

log = get_logger("pipeline-job")


@dataclass
class InstanceLog:
    """Every attempt's losses and returns of pipeline instances (the summary's)."""

    lost: list[dict[str, Any]] = field(default_factory=list)
    returned: list[dict[str, Any]] = field(default_factory=list)
    # (newcomer rounds started so far, every attempt: a round's serial, its ``arrival``)
    arrivals: int = 0
    regrouped: list[dict[str, Any]] = field(default_factory=list)  # (groups re-formed, nobody lost)
    free_returns: int = 0  # (returns after a loss nobody caused: the budget untouched; FREE_RETURNS at most)

    def note_lost(
        self, instance: int, stage: str, code: int | None, reached_step: int, nxt: Generation, *, free: bool
    ) -> None:
        """Instance ``instance`` lost: stage process ``stage`` exited with ``code``; ``nxt``, the
        generation of the survivors; ``free``: its group broke under it (its return is free)."""
        self.lost.append(
            {
                "instance": instance,
                "stage": stage,
                "exit_code": code,
                "reached_step": reached_step,
                "at": time.time(),
                "survivors": list(nxt.instances),
                "nobody_failed": free,
            }
        )
        on = f"instances {', '.join(map(str, nxt.instances))} train on" if nxt.instances else "none trains"
        log.warning(
            "pipeline instance %d lost (stage %s exited with code %s, the job at step %d); %s "
            "(generation %d)%s",
            instance, stage, code, reached_step, on, nxt.number,
            "" if nxt.instances else ": the job waits for a lost instance to come back",
        )  # fmt: skip

    def note(self) -> str | None:
        """What a completed run went through (None: no instance was lost)."""
        if not self.lost:
            return None
        parts = [f"instance {e['instance']} ({e['stage']}, exit code {e['exit_code']})" for e in self.lost]
        back = self.returned
        tail = f"; back: instance(s) {', '.join(str(e['instance']) for e in back)}" if back else ""
        return f"lost pipeline {', '.join(parts)}{tail}"
