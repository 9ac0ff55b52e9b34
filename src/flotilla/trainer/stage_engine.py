"""The stage engine: one pipeline stage as an :class:`~flotilla.trainer.parts.Engine` of the one
loop (``trainer/loop.py``), so a stage is a worker like any other.

A unit of work is this stage's slice of the job's schedule (``pipeline/runtime.StageRuntime``
runs the slices of one action list, so microbatch indices, weight versions, the timeline, peaks
and losses are those of the whole job):

- flushing schedules (``gpipe``, ``1f1b``): a unit is ONE step -- one flush: the actions of that
  step's microbatches up to and including its ``OptimizerStep``.  The loop's boundaries then fall
  on flush boundaries, where checkpoints and evaluations see one consistent step on every stage;
- the asynchronous PipeDream schedule has no flush: a unit is the WHOLE remaining schedule
  (``StageSync.traits.steps_per_commit`` is the job's length), so its boundaries are the start and
  the end.  (HetPipe waves will be another unit.)

The strategy of a stage is :class:`StageSync`, a no-op: the schedule itself applies the updates
(``OptimizerStep``) and the stage group is the membership's (``StaticMembership``, namespace
``epoch/1/``).  It has no barrier, needs no group from the loop and is not a user-visible kind.

Non-finite guard (nothing non-finite is ever applied):
- flushing schedules: before a stage applies step k's update, every stage gives its verdict in
  one 2-element MAX all-reduce over the stage group (``trainer/stage_verdict.py``) -- the last
  stage whether step k's loss is finite, every stage whether its own gradients are -- so all
  stages skip step k's update together and the loop (``Outcome(local_ok=False)``) stops them all
  at the same step (exit code 4) or skips it (``job.nonfinite: skip``).  The all-reduce waits for
  the slowest stage's last backward, which the next step's first forward waits for anyway;
- PipeDream: the loss travels down the existing gradient messages: the last stage marks a
  minibatch whose loss is not finite and sends NaN gradients for it, each stage marks a minibatch
  whose received gradient is not finite and passes NaN on (``RuntimeOptions.check_grads_in``), so
  every stage learns of it before its own update of that minibatch, skips it and (``stop``) halts
  right after it.  A halted stage then waits in a barrier of the stage group until every stage
  has halted: it must not close its group while the NaN gradient it sent is still in flight to
  the stage before it (a closed peer breaks that stage's receive).  Limit: a gradient that first
  turns non-finite on a stage other than the last, with a finite loss, is not caught (no flush
  to agree at).

Pipeline instances side by side (``strategy.replicas`` > 1, flushing schedules only): the engine
is handed the ``replica_group`` of its stage across the instances.  Before the verdict, each stage
sums its gradients, loss flag and (last stage) loss with the same stage of the other instances
(``trainer/replica_sum.py``); the verdict then sees the same summed values on every instance, so
every stage of every instance applies, or skips, the same update: the instances stay bitwise
identical.

Tied parameters across stages (``pipeline/model_check.split_ties``; flushing schedules only,
``pipedream`` is refused by the launcher): after the verdict, each tied parameter's gradient is
summed over the stage group (a stage not holding it adds zeros) and every holder steps on the sum,
so the copies stay bitwise equal (DeepSpeed's ``TiedLayerSpec``).

Gradient clipping (``job.optimizer.clip_grad_norm``, flushing schedules only; ``pipedream`` is
refused by the configuration): after the verdict, every stage's squared gradient norm is summed in
one more all-reduce and each stage scales its gradients by the same coefficient (torch's
``clip_grad_norm_`` rule on the norm of the whole model's gradient).

fp16 (``job.precision``; flushing schedules only, the configuration refuses PipeDream's): the
engine's ``scaler`` (one per stage) makes the last stage scale every microbatch's loss before
backward (``StageRuntime.scale_loss``); each stage unscales its own gradients in the verdict, an
overflow on any stage is agreed by all (and by every instance), who skip the step (an
``Outcome`` not committed with ``local_ok``: not a non-finite step, ``StepResult.overflow``) and
settle their scale from the same verdict, so the scale stays equal on every stage.  The scale is
the stage's state (:meth:`StageEngine.export_state`: checkpoints, the state a re-formed or
returning instance receives); each step's record carries ``loss_scale`` and ``overflow``.

Evaluation (:meth:`StageEngine.evaluate`, at a flush boundary, every stage): one forward pass of
the eval data through the pipeline (``trainer/stage_eval.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from flotilla.cluster.membership import View
from flotilla.comm.collective import Group
from flotilla.core.errors import CollectiveError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.pipeline.model_check import SplitTie
from flotilla.pipeline.runtime import StageResult, StageRuntime
from flotilla.pipeline.schedule import Schedule
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.scaler import OVERFLOW_REASON, LossScaler
from flotilla.sync.state import export_state, import_state, model_digest
from flotilla.trainer.optim import scheduler_state
from flotilla.trainer.parts import UnitWhere
from flotilla.trainer.precision import refuse_fp16_stage
from flotilla.trainer.replica_sum import sum_with_replicas
from flotilla.trainer.stage_eval import EVAL_BATCH, evaluate_stage
from flotilla.trainer.stage_verdict import agree_on_step, clip_stage_gradients, sum_tied_gradients
from flotilla.trainer.step import StepResult
from flotilla.trainer.task_load import TaskData

__all__ = ["EVAL_BATCH", "StageEngine", "StageStrategies", "StageSync", "StepCallback"]


log = get_logger("stage-engine")

StepCallback = Callable[[int, "float | None", int, str, "dict[str, Any]"], None]
"""``(step, loss, samples, nonfinite, fields)`` after each of this stage's updates (``step``
0-based; ``loss``: the last stage's; ``nonfinite``: the non-finite value its update was skipped
for, or ""; ``fields``: fp16's ``loss_scale`` the step ran with and its ``overflow``, else {})."""


class StageSync(SyncStrategy):
    """The no-op strategy of a pipeline stage (module doc)."""

    kind = "pipeline-stage"

    def __init__(self, steps_per_commit: int = 1, newcomers: bool = False) -> None:
        # newcomers: pipeline replicas, whose instances move to a new generation between units
        # (the loop then asks the membership for a pending one after each unit)
        self.traits = Traits(
            regime=Regime.GROUPS, steps_per_commit=steps_per_commit, takes_newcomers=newcomers
        )

    def begin_step(self, step: int) -> None:
        pass

    def synchronize(self, proposal: Proposal) -> Outcome:
        return Outcome.agreed_alone(proposal)


class StageStrategies:
    """The loop's ``StrategyMaker`` for a stage: option 0 only (stages do not switch)."""

    def __init__(self, steps_per_commit: int, newcomers: bool = False) -> None:
        self.steps_per_commit, self.newcomers = steps_per_commit, newcomers

    def __call__(self, option: int, view: View) -> SyncStrategy:
        if option != 0:
            raise FlotillaError(f"pipeline stages have no strategy option {option}")
        return StageSync(self.steps_per_commit, self.newcomers)

    def describe(self, option: int) -> str:
        return StageSync.kind

    def known(self, option: int) -> bool:
        return option == 0


class StageEngine:
    """One stage's units of the job's schedule (module doc).  ``first_step``: the job's step the
    schedule's minibatch 0 is (a resumed run's schedule covers the remaining steps)."""

    def __init__(
        self,
        runtime: StageRuntime,
        schedule: Schedule,
        group: Group,
        *,
        first_step: int = 0,
        stage_names: tuple[str, ...] = (),
        scheduler: Any = None,
        halt_on_nonfinite: bool = True,
        clip_grad_norm: float | None = None,
        ties: Sequence[SplitTie] = (),
        replica_group: Group | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        """``scaler``: fp16's loss scale of this stage (module doc; a flushing schedule's)."""
        self.runtime, self.schedule, self.group = runtime, schedule, group
        self.replica_group = replica_group
        if replica_group is not None and not schedule.kind.flushes:
            raise FlotillaError("pipeline replicas need a flushing schedule (gpipe or 1f1b), not pipedream")
        self.first_step = self.step = first_step
        self.stage_idx, self.num_stages = runtime.stage_idx, schedule.num_stages
        self.names = stage_names or tuple(str(i) for i in range(self.num_stages))
        self.scheduler, self.halt_on_nonfinite = scheduler, halt_on_nonfinite
        self.clip_grad_norm = clip_grad_norm
        self.ties = tuple(ties)
        self._not_counted = {id(t.param) for t in self.ties if t.stages[0] != self.stage_idx}
        self.flushes = schedule.kind.flushes
        self.has_state = True
        self.on_step: StepCallback | None = None
        # with pipeline replicas: "a newer generation of instances was announced" (polled before
        # each update, agreed with the verdict: every stage of every instance then moves to it
        # after the same step, ``move_agreed``; roles/stage_replicas.py)
        self.announced: Callable[[], bool] | None = None
        self.move_agreed = False
        self._wall_before = 0.0
        self.nonfinite, self.nonfinite_step = "", -1  # the first non-finite value and its step
        self._skipped: dict[int, str] = {}  # local minibatch -> the non-finite value it was skipped for
        self.scaler = scaler
        self._overflowed: set[int] = set()  # fp16: local minibatches skipped for an overflow
        self._scales: dict[int, float] = {}  # fp16: local minibatch -> the scale it ran with
        if scaler is not None:
            refuse_fp16_stage("fp16", "pipeline", schedule.kind.value)  # (a flush per step)
            runtime.scale_loss = scaler.scale_loss
        self._started = False
        self._unit_samples = 0
        runtime.update_guard = self._guard
        runtime.on_step = self._stepped
        if not self.flushes:
            runtime.options = replace(runtime.options, check_grads_in=True)

    @property
    def steps_per_unit(self) -> int:
        """1 for a flushing schedule, the whole job for PipeDream (module doc)."""
        return 1 if self.flushes else self.first_step + self.schedule.num_minibatches

    # ------------------------------------------------------------------ Engine
    def run_unit(self, where: UnitWhere, strategy: SyncStrategy, proposal: Proposal) -> StepResult:
        lo, hi = where.first_step - self.first_step, where.last_step - self.first_step
        if lo != self.step - self.first_step or not 0 <= lo <= hi < self.schedule.num_minibatches:
            raise FlotillaError(f"stage {self.stage_idx}: unit [{where.first_step}, {where.last_step}] "
                                f"is not the next part of its schedule (at step {self.step})")  # fmt: skip
        strategy.begin_step(where.first_step)
        em = self.runtime.emulator
        before = (em.compute_s, em.slept_s) if em is not None else (0.0, 0.0)
        self._unit_samples = 0
        ran = self.scaler.scale if self.scaler is not None else None
        try:
            self._start()
            stop = self._ends[hi] if self.flushes else len(self.runtime.actions)
            if not self.runtime.advance(stop) and not self.flushes:
                self.group.barrier()  # the halt is agreed: see below
        except CollectiveError as exc:
            return StepResult(Outcome.group_failed(str(exc)), math.nan, 0, 0.0, 0.0)
        what = next((self._skipped[k] for k in range(lo, hi + 1) if k in self._skipped), "")
        decision = strategy.synchronize(replace(proposal, local_ok=not what))
        overflow = any(k in self._overflowed for k in range(lo, hi + 1))
        if overflow and decision.committed:  # (skipped, not non-finite: ``trainer/boundary.py``)
            decision = replace(decision, committed=False, reason=OVERFLOW_REASON)
        after = (em.compute_s, em.slept_s) if em is not None else (0.0, 0.0)
        losses = [self.runtime.step_losses.get(k) for k in range(lo, hi + 1)]
        known = [v for v in losses if v is not None]
        return StepResult(
            decision=decision,
            loss=sum(known) / len(known) if known else math.nan,
            num_samples=self._unit_samples,
            compute_s=after[0] - before[0],
            emulated_s=after[1] - before[1],
            nonfinite=what,
            overflow=overflow,
            loss_scale=ran,
        )

    def after_commit(self) -> None:
        """Nothing: the scheduler steps after each update (a PipeDream unit holds many)."""

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        extra = {"step": self.step, "scheduler": scheduler_state(self.scheduler)}
        if self.scaler is not None:
            extra["loss_scale"] = self.scaler.state_dict()
        return export_state(self.runtime.module, self.runtime.optimizer, extra)

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        extra = import_state(self.runtime.module, self.runtime.optimizer, meta, tensors)
        self.step = int(extra["step"])
        if self.scheduler is not None and extra.get("scheduler") is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
            for group, lr in zip(self.runtime.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        if self.scaler is not None and extra.get("loss_scale") is not None:
            self.scaler.load_state_dict(extra["loss_scale"])

    def rebase(
        self, *, step: int, schedule: Schedule, data: Any, group: Group, replica_group: Group | None
    ) -> None:
        """Go on from ``step`` on new groups after the pipeline instances re-formed
        (``pipeline/replicas.py``): ``schedule`` covers the remaining steps, ``data`` is this
        instance's new share of every batch.  The next unit starts the schedule afresh (the old
        group's posted receives went with it)."""
        if not self.flushes:
            raise FlotillaError("pipeline replicas need a flushing schedule (gpipe or 1f1b), not pipedream")
        if self._started:
            self._wall_before += self.runtime.elapsed_s()
        self.first_step = self.step = step
        self.schedule, self.group, self.replica_group = schedule, group, replica_group
        self.runtime.group, self.runtime.data = group, data
        self.runtime.optimizer.zero_grad(set_to_none=True)  # (a broken unit's partial gradients)
        self._skipped, self._overflowed, self._scales = {}, set(), {}
        self._started = False
        self.move_agreed = False

    def digest(self) -> str:
        return model_digest(self.runtime.module)

    def average(self, group: Group) -> None:
        raise FlotillaError("a pipeline stage does not switch strategy (its weights are its own)")

    def finish(self) -> StageResult:
        """The run's instrumentation (after the last unit; waits for the sends in flight)."""
        self._start()
        result = self.runtime.end()
        result.wall_s += self._wall_before  # (the runs before the instances re-formed)
        if self.replica_group is not None:
            try:  # (no instance closes its groups under another's last sum)
                self.replica_group.barrier()
            except CollectiveError as exc:  # (every update was applied: the run stands)
                log.warning("stage %d: another pipeline instance ended badly (%s)", self.stage_idx, exc)
        return result

    # ------------------------------------------------------------------ units
    def _start(self) -> None:
        if not self._started:
            self.group.barrier()  # start together: the measured wall time is training, not start-up skew
            self.runtime.begin(self.schedule)
            self._ends = self.runtime.unit_ends()
            self._started = True

    def _guard(self, v: int) -> str:
        """Before this stage applies local step ``v``'s update: why not, or "" (module doc)."""
        local = self.runtime.nonfinite_of(v)
        if self.flushes:
            what = self._agree(v, local)
            if what == OVERFLOW_REASON:
                self._overflowed.add(v)
                return what
        elif local == "loss":
            what = f"loss on stage {self.names[self.stage_idx]}"
        else:
            what = f"gradient received from stage {self.names[self.stage_idx + 1]}" if local else ""
        if what:
            self._skipped[v] = what
            if not self.nonfinite:
                self.nonfinite, self.nonfinite_step = what, self.first_step + v
            if self.halt_on_nonfinite and not self.flushes:
                self.runtime.halted = True
        return what

    def _agree(self, v: int, local: str) -> str:
        """A flushing schedule's verdict on local step ``v`` (``trainer/stage_verdict.py``) after
        the sum over the instances; fp16's scale settled from it; an agreed update's tied sums
        and clipping."""
        # (never at the schedule's last step: a move needs a step left to train in it)
        left = v < self.schedule.num_minibatches - 1
        seen = self.announced() if self.announced is not None and left else False
        if self.replica_group is not None:
            local, seen = self._sum_replicas(v, local, seen)
        verdict = agree_on_step(
            self.group, self.runtime.module, stage_idx=self.stage_idx, names=self.names, local=local,
            seen=seen if self.announced is not None else None, scaler=self.scaler,
        )  # fmt: skip
        self.move_agreed = self.move_agreed or verdict.moved
        if not verdict.what and self.ties:
            sum_tied_gradients(self.group, self.runtime.module, self.ties)
        if not verdict.what and self.clip_grad_norm is not None:
            clip_stage_gradients(self.group, self.runtime.module, self.clip_grad_norm, self._not_counted)
        if self.scaler is not None:  # (after the last collective of the step: a step a broken group
            # makes every stage redo settles the scale once)
            self._scales[v] = self.scaler.scale
            self.scaler.settle(verdict.scale)  # (the same verdict on every stage: the same scale)
        return verdict.what

    def _sum_replicas(self, v: int, local: str, seen: bool = False) -> tuple[str, bool]:
        """Sum this stage's gradients, loss flag, (last stage) loss and "a newer generation seen"
        of local step ``v`` with the same stage of the other instances (``trainer/replica_sum.py``);
        the loss flag and the seen flag of the sums."""
        assert self.replica_group is not None
        last = self.stage_idx == self.num_stages - 1
        loss = self.runtime.step_losses.get(v, 0.0) if last else 0.0
        flagged, total, seen_any = sum_with_replicas(
            self.replica_group, self.runtime.module, loss=loss, flagged=bool(local), seen=seen
        )
        if last:
            self.runtime.step_losses[v] = total
        return ("loss" if flagged else ""), seen_any

    def _stepped(self, v: int, loss: float | None, samples: int) -> None:
        skipped, overflow = self._skipped.get(v, ""), v in self._overflowed
        if not skipped and not overflow and self.scheduler is not None:
            self.scheduler.step()
        self._unit_samples += samples
        fields: dict[str, Any] = {}
        if self.scaler is not None:
            fields = {"loss_scale": self._scales.pop(v, self.scaler.scale), "overflow": overflow}
        if self.on_step is not None:
            self.on_step(self.first_step + v, loss, samples, skipped, fields)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, task: Any, data: TaskData) -> dict[str, float] | None:
        """One forward pass of ``data`` through the pipeline (every stage calls this at the same
        boundary; ``trainer/stage_eval.py``); the last stage returns the task's evaluation, the
        others None."""
        self._start()
        return evaluate_stage(self.runtime, self.group, self.num_stages, task, data)
