"""What the pipeline launcher reads from its stages' files, and when it restarts them.

The stages write ``stage<I>.status.json`` (progress), ``stage<I>.failure.json`` (why a stage
failed: its ``own`` cause or a broken ``group``) into the run directory; this module turns them
into the progress display's snapshot and the one line naming the failed stage.

Restarts (:class:`Restarts`): a stage that dies (any non-zero exit but a non-finite stop) ends the
attempt; the launcher kills the other stages and starts all of them again from the newest step
every stage checkpointed (from the start when there is none), at most ``job.max_restarts``
times, and only while the job makes progress: a second failure that did not get past the step
the previous one happened at is a deterministic fault, not a transient one, and ends the run.
A failure nobody caused -- the stages exited because their group broke and none failed of its
own cause within the grace: the network reset a connection, a stage froze -- restarts without
taking from ``job.max_restarts``, up to ``FREE_RESTARTS`` such restarts in a job (the progress
rule still holds: ``nobody_failed`` in its record; ``job.max_restarts: 0`` turns these off
too).  Each restart is recorded with when (``at_s``: seconds since the job started) and why
(the failed stage's line); a run that restarted any stage completes with ``degraded`` saying
so (:meth:`Restarts.degraded_note`), never as a bare success.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.config import WorkerSpec
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.supervisor import Child
from flotilla.pipeline.layout import Layout
from flotilla.report.summary import write_reports

__all__ = [
    "FREE_RESTARTS",
    "Restarts",
    "StageFailure",
    "broke_under",
    "clear_attempt_files",
    "job_step_of",
    "failure_line",
    "snapshot",
    "stop_line",
    "write_incomplete",
]

log = get_logger("pipeline-job")


FREE_RESTARTS = 32  # restarts after failures nobody caused, in a job, before they take the budget too


class StageFailure(FlotillaError):
    """An attempt ended because a stage failed: ``line`` names it, ``reached_step`` is the
    furthest step any stage had done; ``nobody_failed``: its group broke under it and no stage
    failed of its own cause (module doc)."""

    def __init__(self, line: str, child: Child, reached_step: int, *, nobody_failed: bool = False) -> None:
        super().__init__(line)
        self.line, self.child, self.reached_step = line, child, reached_step
        self.nobody_failed = nobody_failed


@dataclass
class Restarts:
    """The restarts of one pipeline job (module doc): the record the summary carries."""

    max_restarts: int
    records: list[dict[str, Any]] = field(default_factory=list)
    t0_unix: float = field(default_factory=time.time)  # the job's start (``at_s`` counts from it)

    @property
    def paid(self) -> int:
        """The restarts that took from ``max_restarts`` (not a free one: module doc)."""
        return sum(1 for r in self.records if not r.get("nobody_failed"))

    def free(self, nobody_failed: bool) -> bool:
        """Whether a restart after a failure nobody caused is free (``FREE_RESTARTS`` not spent;
        never with ``max_restarts`` 0: restarts are off)."""
        return nobody_failed and self.max_restarts > 0 and len(self.records) - self.paid < FREE_RESTARTS

    def allowed(self, reached_step: int, *, nobody_failed: bool = False) -> bool:
        """Whether one more restart is allowed after a failure at ``reached_step``."""
        if not self.free(nobody_failed) and self.paid >= self.max_restarts:
            return False
        return not self.records or reached_step > int(self.records[-1]["failed_at_step"])

    def give_up_note(self, reached_step: int, *, nobody_failed: bool = False) -> str:
        if not self.free(nobody_failed) and self.paid >= self.max_restarts:
            return f"gave up after {len(self.records)} restart(s) (job.max_restarts: {self.max_restarts})"
        return (
            f"gave up after {len(self.records)} restart(s): no progress since the last failure "
            f"(step {reached_step})"
        )

    def add(self, failure: StageFailure, resumed_from_step: int) -> dict[str, Any]:
        now = time.time()
        rec = {
            "stage": failure.child.name,
            "exit_code": failure.child.returncode,
            "reason": failure.line,
            "failed_at_step": failure.reached_step,
            "detected_at": now,  # (unix time: the launcher reaped the stage)
            "at_s": round(now - self.t0_unix, 3),  # (seconds since the job started)
            "resumed_from_step": resumed_from_step,
            "first_step_at": None,  # (unix time of the first step done after the restart)
            "nobody_failed": self.free(failure.nobody_failed),  # (free: not from max_restarts)
        }
        self.records.append(rec)
        return rec

    def degraded_note(self) -> str | None:
        """What a completed run went through (None: no stage was restarted): the summary's
        ``degraded``, as for a data-parallel run that lost members."""
        if not self.records:
            return None
        which = ", ".join(
            f"{r['stage']} (exit code {r['exit_code']} at step {r['failed_at_step']}, {r['at_s']:g} s)"
            for r in self.records
        )
        return f"restarted every stage {len(self.records)} time(s) after {which}: see restarts"

    def see(self, snap: dict[str, Any]) -> None:
        """The first step after the latest restart (from a progress snapshot)."""
        if not self.records or self.records[-1]["first_step_at"] is not None:
            return
        rec = self.records[-1]
        if any(int(row["step"]) > int(rec["resumed_from_step"]) for row in snap["workers"]):
            rec["first_step_at"] = time.time()
            rec["restart_to_first_step_s"] = round(rec["first_step_at"] - rec["detected_at"], 3)


def clear_attempt_files(run_dir: Path) -> None:
    """An attempt's status and failure files, every stage process's (a placed or re-formed
    instance's too), removed before the next attempt starts."""
    for suffix in ("status.json", "failure.json"):
        for path in run_dir.glob(f"stage*.{suffix}"):
            path.unlink(missing_ok=True)


def job_step_of(run_dir: Path) -> int:
    """The furthest step any stage process of the attempt reported (every status file)."""
    return max((_step_in(path) for path in run_dir.glob("stage*.status.json")), default=0)


def _step_in(path: Path) -> int:
    """The step a stage's status file reports (0: none readable)."""
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def reached_step(run_dir: Path, num_stages: int) -> int:
    """The furthest step any stage reported done."""
    return max((_step_in(run_dir / f"stage{i}.status.json") for i in range(num_stages)), default=0)


def broke_under(run_dir: Path, names: list[str], child: Child) -> bool:
    """Whether stage ``child`` failed because its group broke under it (``stage<I>.failure.json``
    says ``cause: group``), not of its own error."""
    try:
        info = json.loads((run_dir / f"stage{names.index(child.name)}.failure.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("cause") == "group"


def failure_line(run_dir: Path, names: list[str], failed: list[Child]) -> str:
    """The line naming the stage whose own error ended the run: a stage that failed of its own
    cause (``stage<I>.failure.json``: not a broken group), else the first that failed."""
    causes = []
    for c in failed:
        try:
            info = json.loads((run_dir / f"stage{names.index(c.name)}.failure.json").read_text())
        except (OSError, ValueError):
            info = {}
        causes.append((info.get("cause") == "group", c, info.get("line")))
    _, c, line = min(causes, key=lambda entry: entry[0])  # (stable: the first own failure)
    return f"pipeline stage {c.name} exited with code {c.returncode}: {line or c.log_tail()}"


def stop_line(run_dir: Path, stage_idx: int, child: Child) -> str:
    """The one line a stage that stopped on a non-finite value left in its status file."""
    try:
        message = json.loads((run_dir / f"stage{stage_idx}.status.json").read_text()).get("message")
    except (OSError, ValueError):
        message = None
    return str(message or f"pipeline stage {child.name} stopped on a non-finite value: {child.log_tail()}")


def snapshot(
    run_dir: Path, workers: list[WorkerSpec], start: float, layout: Layout | None = None
) -> dict[str, Any]:
    """A progress snapshot in the coordinator's format, from the stages' status files (``layout``:
    with several pipeline instances, each row names its instance and stage -- HetPipe's virtual
    workers run at their own pace)."""
    rows: list[dict[str, Any]] = []
    evals: list[Any] = []
    for i, w in enumerate(workers):
        if layout is not None and not layout.current(i):  # (its instance was formed again elsewhere)
            continue
        try:
            st = json.loads((run_dir / f"stage{i}.status.json").read_text())
        except (OSError, ValueError):
            st = {"step": 0, "loss": None, "state": "starting", "samples_per_s": 0.0}
        if st.get("eval"):
            evals = [st["eval"]]
        loss = st["loss"] if st["loss"] is not None else math.nan
        state = "training" if st["state"] in ("training", "done") else st["state"]
        where = layout.place(i) if layout is not None and layout.num_instances > 1 else None
        rows.append(
            {
                "name": w.name if where is None else f"{w.name} ({where.replica}.{where.stage})",
                "worker_id": i,
                "speed": w.speed,
                "state": state,
                "step": st["step"],
                "samples_per_s": st["samples_per_s"] if not rows else 0.0,  # (the first row's: the job's)
                "loss": loss,
                "membership_epoch": 1,
            }
        )
    return {
        "workers": rows,
        "evals": evals,
        "members": [w.name for w in workers],
        "epoch": 1,
        "elapsed_s": time.perf_counter() - start,
    }


def write_incomplete(
    report_dir: Path | None,
    run_dir: Path,
    num_stages: int,
    restarts: Restarts,
    why: str,
    wall_s: float,
    extra: dict[str, Any] | None = None,
) -> None:
    """A run that failed or was interrupted still leaves a summary, ``completed: false``
    (``extra``: fields known before it started, e.g. the placement of its instances)."""
    if report_dir is None:
        return
    summary = {
        "completed": False,
        "interrupted": why.startswith("interrupted"),
        "error": why,
        "strategy": "pipeline",
        "headline": None,
        "steps": reached_step(run_dir, num_stages),
        "wall_s": wall_s,
        "samples_per_s": 0.0,
        "num_workers": num_stages,
        "restarts": restarts.records,
        "degraded": restarts.degraded_note(),
        **(extra or {}),
    }
    try:
        write_reports(report_dir, summary)
    except Exception as exc:  # (the failure itself is what the caller must see)
        log.warning("could not write the incomplete run's summary: %s", exc)
