"""What a pipeline stage brings to the one loop besides its engine (``trainer/stage_engine.py``):
its duties, records and faults (its membership: ``roles/stage_membership.py``).  ``roles/stage.py``
assembles them.

- :class:`StageRecords`: one ``metrics.jsonl`` record per step and stage (``step`` 1-based: the
  steps done; the loss only on the last stage; a skipped non-finite step says so; fp16: the
  ``loss_scale`` the step ran with and its ``overflow``, a skipped one not committed), the last
  stage's periodic evaluations (``evals.jsonl``, fields of ``report/headline.eval_fields``), and
  the status the launcher polls for its progress display (``stage<G>.status.json``), all through
  the stage's output (``roles/stage_output.py``: files, or messages to the pipeline's host).
- :class:`StageDuties`: restore from the per-stage checkpoint (fp16: the loss scale too: it is in
  each stage's checkpoint), checkpoint at flush boundaries,
  evaluate through the pipeline, and at the end write ``stage<G>.safetensors`` (its weights) and
  ``stage<G>.json`` (timeline window for the Gantt chart, peaks, emulation figures, losses,
  evaluations, the weights' digest); on a non-finite value the same files (the weights are the
  last finite ones) and one line in the status file (``state: nonfinite``, ``message``) for the
  launcher.  ``G`` is the stage process (``pipeline/replicas.py``).  With replicas, every
  instance holds the same weights (its gradients are summed with the others'), so the lead
  instance (the lowest live one) alone checkpoints, records its evaluations and writes the
  weights; every instance evaluates (so none waits for the lead's evaluation in its next sum);
  every process writes its result file.
- :func:`stage_faults`: a stage has no synchronisation phase, so a ``sync`` fault (the legacy
  ``FLOTILLA_FAULT_CRASH=NAME@STEP``) fires at the boundary after step STEP, i.e. once STEP steps
  are done -- what the stage's old crash hook did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.core.errors import CollectiveError, ConfigError
from flotilla.core.faults import FaultPlan
from flotilla.core.log import get_logger
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.pipeline.instrument import StageResult
from flotilla.pipeline.replicas import StagePlace
from flotilla.pipeline.schedule import Schedule, format_action
from flotilla.report.gantt import entry_step, gantt_window
from flotilla.report.headline import eval_fields
from flotilla.roles.stage_memory import StageMemory
from flotilla.roles.stage_output import StageOutput
from flotilla.sync.base import SyncStrategy
from flotilla.trainer import optim
from flotilla.trainer.parts import UnitWhere
from flotilla.trainer.pipeline_checkpoint import (
    load_stage,
    restore_loss_scale,
    restore_reshaped,
    restore_stage,
    stage_checkpointer,
)
from flotilla.trainer.pipeline_job import StageJob
from flotilla.trainer.pipeline_setup import PipelineParts
from flotilla.trainer.stage_engine import StageEngine
from flotilla.trainer.step import StepResult

__all__ = ["Reshape", "StageDuties", "StageRecords", "stage_faults"]

log = get_logger("pipeline-stage")


def stage_faults(plan: FaultPlan, name: str) -> FaultPlan:
    """``plan`` with this stage's ``sync`` faults moved to the ``boundary`` phase (module doc)."""
    faults = []
    for f in plan.faults:
        if f.worker == name and f.phase == "sync":
            if f.action == "fail":
                raise ConfigError(
                    f"fault for stage {name}: action 'fail' needs a sync phase; stages have none"
                )
            f = replace(f, phase="boundary")
        faults.append(f)
    return FaultPlan(tuple(faults))


class StageRecords:
    """Metrics records, evaluations and the status file of one stage (module doc)."""

    def __init__(
        self, job: StageJob, place: StagePlace, sampler: GlobalBatchSampler, task: object, output: StageOutput
    ) -> None:
        self.name, self.stage_idx, self.replica = job.stage_names[place.index], place.stage, place.replica
        self.replicas = job.replicas
        self.sampler, self.task, self.output = sampler, task, output
        self.losses: list[float] = []  # the last stage's training losses, step by step (a resume's too)
        self.losses_from = 0  # the step of losses[0] (a process that started later, with no history)
        self.evals: list[dict[str, Any]] = []
        self.start, self.samples = time.perf_counter(), 0
        # the stage's emulator (set once its runtime exists): each step record carries the
        # compute and the emulated delay since the previous one, as a worker's records do
        self.emulator: SpeedEmulator | None = None
        self._last = (self.start, 0.0, 0.0)  # (time, compute_s, slept_s) at the previous record
        self.membership_epoch = 1  # (its stage group's epoch: a re-formed group's is higher)

    def step(
        self,
        step: int,
        loss: float | None,
        samples: int,
        nonfinite: str,
        fields: dict[str, Any] | None = None,
    ) -> None:
        """After this stage's update of ``step`` (0-based), or its skip (``nonfinite``; fp16:
        ``fields`` has ``loss_scale`` and ``overflow``)."""
        if loss is not None:
            self.losses.append(float(loss))
        self.samples += samples
        rec: dict[str, Any] = {
            "time_s": time.time(),
            "worker_id": self.name,
            "step": step + 1,
            "loss": loss,
            "samples": samples,
            "epoch": self.sampler.data_epoch(step),
            "membership_epoch": self.membership_epoch,
            "stage_idx": self.stage_idx,
        }
        if self.replicas > 1:
            rec["replica"] = self.replica
        if self.emulator is not None:  # (since the previous step's update: this step's actions)
            now, em = time.perf_counter(), self.emulator
            rec["step_s"] = now - self._last[0]
            rec["compute_s"] = em.compute_s - self._last[1]
            rec["emulated_s"] = em.slept_s - self._last[2]
            self._last = (now, em.compute_s, em.slept_s)
        if fields:
            rec.update(fields)
        if nonfinite:
            rec.update(committed=False, nonfinite=nonfinite)
        elif rec.get("overflow"):
            rec["committed"] = False
        self.output.metric(rec)
        self.status(step + 1, loss, "training")  # (the output keeps the newest: its link sends it)

    def unit(
        self, res: StepResult, where: UnitWhere, step_s: float, *, flush: bool, extra: dict, digest: Any
    ) -> None:
        """Records are written per step (:meth:`step`: a PipeDream unit holds many)."""

    def discarded(self, step: int, membership_epoch: int, why: str) -> None:
        log.warning("stage %s: step %d discarded: %s", self.name, step + 1, why)

    def flush(self) -> None:
        pass

    def evaluation(self, step: int, ev: dict[str, float]) -> None:
        """The last stage's periodic evaluation after ``step`` steps: ``evals.jsonl`` and status."""
        rec = {"kind": "eval", "time_s": time.time(), "step": step, **eval_fields(self.task, ev)}
        self.evals.append(rec)
        self.output.evaluation(dict(rec, worker_id=self.name, name=self.name))
        self.status(step, self.losses[-1] if self.losses else None, "training")

    def status(self, step: int, loss: float | None, state: str, message: str = "") -> None:
        elapsed = time.perf_counter() - self.start
        st: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "state": state,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
        }
        if self.evals:
            st["eval"] = self.evals[-1]
        if message:
            st["message"] = message
        self.output.status(st)


@dataclass(frozen=True)
class Reshape:
    """A resume from a checkpoint of another split: the old split's layers (sharing the model's
    parameters with this stage) and how that split's stages built their optimizers."""

    old_layers: nn.Sequential
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]


class StageDuties:
    """Restore, checkpoint, evaluate, finish and stop of one stage (module doc)."""

    def __init__(
        self,
        job: StageJob,
        engine: StageEngine,
        records: StageRecords,
        parts: PipelineParts,
        bundle: optim.OptimizerBundle,
        on_nonfinite: str = "stop",
        reshape: Reshape | None = None,
    ) -> None:
        self.job, self.engine, self.records, self.parts, self.bundle = job, engine, records, parts, bundle
        self.on_nonfinite, self.reshape = on_nonfinite, reshape
        self.memory: StageMemory | None = None  # (the stage's measured memory, set by its assembly)
        # the strategy's stage side (sync/stage_plug.py): after the last update, the fields it
        # adds to the result (or the error the run fails with)
        self.plug_finish: Callable[[], dict[str, Any]] | None = None
        self.stage_idx = engine.stage_idx
        self.index = job.layout.first(records.replica) + self.stage_idx  # (the stage process)
        # the lead instance (0, or the lowest survivor: roles/stage_replicas.py) checkpoints,
        # evaluates and writes the weights (every instance writes them where instances are
        # independent: the launcher takes the lowest survivor's)
        self.lead = records.replica == 0
        self.every_instance_writes = False
        ck = job.checkpoint
        points = job.config.get("strategy", {}).get("split_points")
        self.checkpointer = (
            stage_checkpointer(
                ck, self.stage_idx, list(job.ends_of(records.replica)), records.losses, points, engine.scaler
            )
            if ck is not None
            else None
        )

    def restore_lost(self, strategy: Any = None) -> int | None:
        return None  # (a stage's membership is static: its state is never lost to a view change)

    def restore(self) -> int | None:
        resume = self.job.resume
        if resume is None:  # (a newcomer of an instance coming back starts at its engine's first step)
            self.records.status(self.engine.first_step, None, "training")
            return self.engine.first_step or None
        if self.reshape is not None:  # the checkpoint has another split: re-partition its state
            losses, scheduler, scale = restore_reshaped(
                resume,
                self.reshape.old_layers,
                self.engine.runtime.module,
                self.bundle.optimizer,
                self.reshape.make_optimizer,
            )
            where = f"{resume.dir} ({len(resume.layer_ends)} stage(s), re-partitioned)"
            optim.restore_scheduler_regrouped(self.bundle, scheduler)
        else:
            ckpt = load_stage(resume.dir, self.stage_idx, resume.step, resume.fingerprint)
            losses = restore_stage(ckpt, self.engine.runtime.module, self.bundle.optimizer)
            optim.restore_scheduler(self.bundle, ckpt.scheduler)
            where, scale = str(ckpt.path), ckpt.meta.get("loss_scale")
        restore_loss_scale(self.engine.scaler, scale)
        self.records.losses[:] = losses
        self.records.status(resume.step, None, "training")
        log.info("stage %d resumed from %s at step %d", self.stage_idx, where, resume.step)
        return resume.step

    def local_checkpoint(self, step: int, strategy: SyncStrategy, rank: int) -> None:
        """A stage's state is all in its own checkpoint (every stage writes one)."""

    def checkpoint(self, step: int, strategy: SyncStrategy, *, agreed: bool) -> None:
        self.write_checkpoint(step)

    def after_update(self, done: int, nonfinite: str) -> None:
        """This stage applied its ``done``-th update: PipeDream (its unit the whole job) checkpoints
        right after every ``every_steps``-th, the last one left to the loop
        (``trainer/pipeline_checkpoint.py``); the copy is the host's time, not the emulated device's."""
        ck = self.job.checkpoint
        if self.engine.flushes or ck is None or nonfinite or done >= self.job.total_steps:
            return
        if done % ck.every_steps:
            return
        em = self.engine.runtime.emulator
        if em is not None:  # (inside the update: its compute so far stretched, the copy not)
            em.mark()
        self.write_checkpoint(done)
        if em is not None:
            em.begin()

    def write_checkpoint(self, step: int) -> None:
        """This stage's state as "after ``step`` steps" (the lead instance's; a flush boundary, or
        PipeDream's update of minibatch ``step - 1``: ``trainer/pipeline_checkpoint.py``)."""
        if self.checkpointer is not None and self.lead:
            rt = self.engine.runtime
            self.checkpointer.write(
                step, rt.module, rt.optimizer, scheduler=optim.scheduler_state(self.bundle.scheduler)
            )

    def evaluate(self, step: int, strategy: SyncStrategy) -> None:
        # (every instance evaluates its identical weights, the lead records it: the others would
        # otherwise wait for the lead's evaluation in their next replica sum, up to its timeout)
        try:
            ev = self.engine.evaluate(self.parts.task, self.parts.eval)
        except CollectiveError as exc:  # (the next unit finds the group broken and recovers)
            log.warning("stage %d: the evaluation at step %d is skipped: %s", self.stage_idx, step, exc)
            return
        if ev is not None and self.lead:
            self.records.evaluation(step, ev)
            log.info("evaluation at step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in ev.items()))

    def flush_checkpoints(self) -> None:
        """Wait for the checkpoint being written in the background (raises what it failed with)."""
        if self.checkpointer is not None:
            self.checkpointer.flush()

    def finish(self, step: int, strategy: SyncStrategy, rank: int, *, agreed: bool) -> int:
        self.flush_checkpoints()  # (the job is done only with its checkpoints on disk)
        result = self.engine.finish()
        extra = self.plug_finish() if self.plug_finish is not None else {}
        try:  # every stage finished: nobody tears the group down under a peer
            self.engine.group.barrier()
        except CollectiveError as exc:  # (every update was applied: the run stands)
            log.warning(
                "stage %d: the stage group broke at the end (%s): its files are written", self.stage_idx, exc
            )
        self._write_files(result, extra)
        last = self.records.losses[-1] if self.records.losses else None
        self.records.status(step, last, "done")
        return 0

    def nonfinite(self, step: int, what: str, own: bool = True) -> None:
        """One line (the same on every stage of a flushing schedule), the last finite weights."""
        e = self.engine
        at = e.nonfinite_step if e.nonfinite_step >= 0 else step  # 0-based, as the loop counts
        line = (
            f"non-finite {e.nonfinite or what} at step {at}: the job stops (job.nonfinite: "
            f"{self.on_nonfinite}); the model keeps the last finite weights"
        )
        log.error("%s", line)
        self.records.status(at, None, "nonfinite", line)  # (before the result: the launcher's signal)
        self._write_files(e.finish())
        try:
            self.flush_checkpoints()
        except Exception as exc:  # (the stop's own files are written: this is one more line)
            log.error("stage %d: the last checkpoint was not written: %s", self.stage_idx, exc)

    def _write_files(self, result: StageResult, extra: dict[str, Any] | None = None) -> None:
        out = result_json(result, self.engine.schedule, self.engine.runtime.emulator) | (extra or {})
        out["device"] = str(self.engine.runtime.device)
        out["transport"] = getattr(self.engine.group, "backend", "gloo")
        out["replica"] = self.records.replica
        out["digest"] = self.engine.digest()
        first = self.engine.first_step  # (the job's first, or where the instances re-formed last)
        last_stage = self.stage_idx == len(self.job.ends_of(self.records.replica)) - 1
        history = (
            {str(k): v for k, v in enumerate(self.records.losses, self.records.losses_from) if k < first}
            if last_stage
            else {}
        )
        out["step_losses"] = history | {str(first + int(k)): v for k, v in out["step_losses"].items()}
        out["first_step"] = first
        out["membership_epoch"] = self.records.membership_epoch  # (> 1: its stage group re-formed)
        out["evals"] = self.records.evals
        if self.memory is not None and self.memory.mode != "off":
            out["memory"] = self.memory.figures()
        writes = self.lead or self.every_instance_writes
        weights = self.engine.runtime.module.state_dict() if writes else None
        self.records.output.result(out, weights)


def result_json(res: StageResult, schedule: Schedule, emulator: SpeedEmulator | None) -> dict[str, Any]:
    """A stage's result file (``stage<I>.json``): figures and the timeline of the Gantt window."""
    lo, hi = gantt_window(schedule)
    entries = [
        [e.stage_idx, format_action(e.action), e.start_s, e.end_s]
        for e in res.timeline
        if lo <= entry_step(schedule, e.action) < hi
    ]
    return {
        "stage_idx": res.stage_idx,
        "wall_s": res.wall_s,
        "compute_s": emulator.compute_s if emulator is not None else res.compute_s,
        "slept_s": emulator.slept_s if emulator is not None else res.slept_s,
        "peak_in_flight": res.peak_in_flight,
        "peak_weight_copies": res.peak_weight_copies,
        "peak_activation_bytes": res.peak_activation_bytes,
        "step_losses": {str(k): v for k, v in sorted(res.step_losses.items())},
        "gantt_window": [lo, hi],
        "timeline": entries,
    }
