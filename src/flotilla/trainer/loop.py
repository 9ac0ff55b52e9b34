"""ONE training loop for every engine and strategy: Membership x Engine x SyncStrategy.

The worker role (``roles/worker.py``) and the pipeline stage role (``roles/stage.py``) only build
the parts (``trainer/parts.py``) and call :meth:`Loop.run`.  Per unit::

    proposal = (pending epoch, stop, switch request)      # from the membership and the role
    result   = engine.run_unit(where, strategy, proposal)  # compute + strategy.synchronize
    boundary = decide(policy, state, report)               # pure: trainer/boundary.py
    execute boundary: records, checkpoint, evaluation, recover / change view / switch / stop

Groups: a strategy whose ``traits.groups`` is ``PER_VIEW`` is bound to the view's group (the
membership builds it) and, when a view forms, the members agree on the most advanced state
(``trainer/state_sync.py``).  ``PER_STEP`` strategies build their own groups by namespace through
``StrategyContext.groups``.  A strategy with a barrier carries the proposal in its vote, so every
member changes view, stops or switches at the same step; without one, a worker stops (or leaves)
on its own and switches only at steps fixed in advance (``BoundaryPolicy.switch_plan``).  Without
a barrier an elastic strategy moves to a newer view at its next boundary; a fixed-membership one
(``partial_reduce``) only reports a broken view and takes the next one between units, never
waiting for it (``Membership.catch_up``): a live worker is never left out of a failure round.

Failure is data: a broken group comes back as ``Outcome.broken``; the loop releases the group
(so peers blocked on it fail at once), asks the membership for the next view and redoes (or
drops) the unit.  A ``CollectiveError`` while entering a view is handled the same way.

Exit codes: 0 done / stopped / left; 3 the membership service was lost; 4 a non-finite value
stopped the job (``trainer/boundary.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from flotilla.cluster.membership import View
from flotilla.core.errors import CollectiveError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.sync.base import Proposal, SyncStrategy
from flotilla.sync.plan import StateLost
from flotilla.trainer.boundary import (
    Action,
    Boundary,
    BoundaryPolicy,
    LoopState,
    StopReason,
    UnitReport,
    decide,
)
from flotilla.trainer.parts import Duties, Engine, Membership, Records, StrategyMaker, UnitWhere
from flotilla.trainer.state_sync import agree_state
from flotilla.trainer.step import StepResult

__all__ = ["EXIT_NONFINITE", "EXIT_ORPHANED", "Loop", "LoopParts"]

log = get_logger("loop")

EXIT_ORPHANED = 3
EXIT_NONFINITE = 4
PhaseHook = Callable[[int, str], None]


@dataclass(kw_only=True)
class LoopParts:
    membership: Membership
    engine: Engine
    strategies: StrategyMaker
    duties: Duties
    records: Records
    policy: BoundaryPolicy
    name: str = ""
    on_phase: PhaseHook | None = None  # fault injection from a test's fault plan (core/faults.py)
    clock: Callable[[], float] = time.monotonic
    switch_requests: list[int] = field(default_factory=list)  # options asked for by a policy/test


class Loop:
    def __init__(self, parts: LoopParts) -> None:
        self.p = parts
        self.view: View | None = None
        self.strategy: SyncStrategy | None = None
        self.option = 0
        self.state = LoopState()
        self.boundary_hooks: list[Callable[[Loop], None]] = []
        self._t0 = parts.clock()
        self._stayed = 0  # the last view epoch a barrier-free move to failed for (logged once)

    # ------------------------------------------------------------------ entry point
    def run(self) -> int:
        try:
            entry = self.p.membership.first_view()
            if entry is None:
                return 0
            if entry.initial:
                self.p.engine.step = self.p.duties.restore() or 0
                self.p.engine.has_state = True
            self.view = entry.view
            if not self._start(entry.view):
                return 0
            return self._train()
        finally:
            if self.strategy is not None:
                self.strategy.close()

    @property
    def rank(self) -> int:
        assert self.view is not None
        return self.view.rank_of(self.p.membership.worker_id)

    @property
    def step(self) -> int:
        return self.p.engine.step

    def _sync(self) -> SyncStrategy:
        assert self.strategy is not None
        return self.strategy

    # ------------------------------------------------------------------ views and strategies
    def _start(self, view: View) -> bool:
        """Build the job's strategy in the first view (recovering if that view breaks): the job's
        own, or the last one its switch plan names for a step up to the one we start at."""
        planned = [s for s in self.p.policy.switch_plan if s.step <= self.step]
        self.option = max(planned, key=lambda s: s.step).option if planned else 0
        self.strategy = self.p.strategies(self.option, view)
        if not self.strategy.traits.elastic and not self.p.engine.has_state:
            raise FlotillaError(
                f"strategy {self.strategy.kind} has a fixed membership: "
                "this worker joined after the job started"
            )
        return self._enter(view, wanted=True, start=True)

    def _enter(self, view: View | None, *, wanted: bool, start: bool = False) -> bool:
        """Make ``view`` current: bind its group and agree on the state; on a failure, recover
        into the next view.  False: this worker is out (or the job is over)."""
        while view is not None:
            self.view = view
            try:
                if self._sync().traits.per_view_group:
                    self._sync().bind(self.p.membership.group(view))
                    self._agree_state(view, wanted)
                    # a donor may be ahead (it committed a step whose vote broke for others)
                    self.state = replace(self.state, step=self.p.engine.step)
                if start:
                    self._sync().start()
                    start = False
                    self._adopt_joined_step()
                self._log_view()
                return True
            except CollectiveError as exc:
                log.warning("view %d could not form (%s); waiting for the next one", view.epoch, exc)
                self.p.membership.close_group()
                view, wanted = self.p.membership.recover(frozenset()), True
        return False

    def _adopt_joined_step(self) -> None:
        """A worker whose strategy joined mid-run at a later step (``ps``: the shards' global
        clock, ``PSSync.start_step``) trains from there."""
        at = getattr(self._sync(), "start_step", 0)
        if at > self.p.engine.step and not self.p.engine.has_state:
            log.info("worker %d starts at step %d (joined mid-run)", self.p.membership.worker_id, at)
            self.p.engine.step = at

    def _agree_state(self, view: View, wanted: bool) -> None:
        """Agree on the state to train from; if every replica of it is gone, every member falls
        back to the job's newest checkpoint (the steps after it are redone) or the job stops."""
        group = self.p.membership.group(view)
        try:
            agree_state(group, self.p.engine, epoch=view.epoch, wanted=wanted, strategy=self.strategy)
        except StateLost as exc:
            step = self.p.duties.restore_lost(self.strategy)
            if step is None:
                raise
            log.warning("%s: resuming from the job's newest checkpoint, at step %d", exc, step)
            self.p.engine.step, self.p.engine.has_state = step, True
            agree_state(group, self.p.engine, epoch=view.epoch, wanted=wanted, strategy=self.strategy)

    def _log_view(self) -> None:
        assert self.view is not None
        log.info(
            "worker %d adopted view %d (rank %d of %d) at step %d",
            self.p.membership.worker_id,
            self.view.epoch,
            self.rank,
            self.view.world_size,
            self.step,
        )

    def _switch(self, option: int) -> bool:
        old = self._sync()
        old.close()
        assert self.view is not None
        self.option = option
        self.strategy = self.p.strategies(option, self.view)
        log.info(
            "worker %d switched strategy %s -> %s at step %d",
            self.p.membership.worker_id, old.kind, self.strategy.kind, self.step,
        )  # fmt: skip
        return self._enter(self.view, wanted=True, start=True)

    # ------------------------------------------------------------------ training
    def _train(self) -> int:
        total = self.p.policy.total_steps
        k = self._sync().traits.steps_per_commit
        self.state = LoopState(step=self.step, units=self.step // k, last_checkpoint_step=self.step)
        while self.step < total:
            m, sync = self.p.membership, self._sync()
            if m.orphaned:
                log.error("coordinator lost: exiting")
                return EXIT_ORPHANED
            if not sync.traits.barrier and self._stops_alone():
                return 0
            if not sync.traits.barrier and not sync.traits.elastic and not self._catch_up():
                return 0
            res, where, step_s = self._run_unit()
            b = decide(self.p.policy, self.state, self._report(res, where))
            self._record(res, where, step_s, b)
            outcome = self._execute(b, res)
            if outcome is not None:
                return outcome
            if not sync.traits.barrier and sync.training_done():
                log.info("worker %d: done at step %d (its partners finished)", m.worker_id, self.step)
                break
        self._sync().mark_finished()
        return self.p.duties.finish(self.step, self._sync(), self.rank)

    def _stops_alone(self) -> bool:
        m = self.p.membership
        if m.stop_requested:
            log.info("stop requested by the coordinator at step %d", self.step)
        elif m.leave_requested:
            log.info("worker %d leaves at step %d (SIGTERM)", m.worker_id, self.step)
        return m.stop_requested or m.leave_requested

    def _catch_up(self) -> bool:
        """Without a barrier and with fixed membership nobody meets in a view: a broken epoch is
        reported and the next view taken between units, without waiting for the others
        (``Membership.catch_up``).  False: this worker is out of the job."""
        view = self.p.membership.catch_up()
        if view is None:
            log.info("worker %d is out of the job at step %d", self.p.membership.worker_id, self.step)
            return False
        if self.view is None or view.epoch != self.view.epoch:
            self.view = view
            self._log_view()
        return True

    def _stay(self, epoch: int, exc: Exception) -> bool:
        """Without a barrier nobody meets in a view: a move that fails (the epoch is broken: the
        request counted as this worker's report) is retried at the next boundary while this
        worker trains on in its view.  Waiting here for the failure round to close could wait on
        a member that itself waits on this worker (``ps``: in the consistency gate) until the
        coordinator's grace declared them both out."""
        if epoch != self._stayed:
            here = self.view.epoch if self.view is not None else -1
            wid = self.p.membership.worker_id
            log.info("worker %d: view %d not ready (%s); training on in view %d", wid, epoch, exc, here)
            self._stayed = epoch
        return True

    def _proposal(self) -> Proposal:
        m, sync = self.p.membership, self._sync()
        switch = self.p.switch_requests.pop(0) if self.p.switch_requests and sync.traits.barrier else 0
        if not sync.traits.barrier:
            return Proposal(switch=0)
        return Proposal(pending_epoch=m.pending_epoch(), stop=m.stop_requested, switch=switch)

    def _run_unit(self) -> tuple[StepResult, UnitWhere, float]:
        assert self.view is not None
        k = self._sync().traits.steps_per_commit
        last = min(self.step + k, self.p.policy.total_steps) - 1
        where = UnitWhere(
            first_step=self.step,
            last_step=last,
            view=self.view,
            rank=self.rank,
            split=self._sync().data_split(),
        )
        if self.p.on_phase is not None:
            self.p.on_phase(self.step, "compute")
        t0 = time.perf_counter()
        res = self.p.engine.run_unit(where, self._sync(), self._proposal())
        return res, where, time.perf_counter() - t0

    def _report(self, res: StepResult, where: UnitWhere) -> UnitReport:
        d = res.decision
        return UnitReport(
            first_step=where.first_step,
            last_step=where.last_step,
            rank=where.rank,
            epoch=where.view.epoch,
            committed=d.committed,
            broken=d.broken,
            local_ok=d.local_ok,
            pending_epoch=d.pending_epoch if self._sync().traits.barrier else self._alone_epoch(),
            stop=d.stop,
            switch=d.switch,
            now_s=self.p.clock() - self._t0,
        )

    def _alone_epoch(self) -> int:
        """Without a barrier an elastic strategy moves to a newer view on its own."""
        return self.p.membership.pending_epoch() if self._sync().traits.elastic else 0

    def _record(self, res: StepResult, where: UnitWhere, step_s: float, b: Boundary) -> None:
        d = res.decision
        if d.broken:
            log.warning("step %d discarded: %s", where.first_step, d.reason)
            self.p.records.discarded(where.first_step, where.view.epoch, d.reason)
            return
        sync = self._sync()
        digest = self.p.engine.digest if sync.traits.per_view_group else None
        self.p.records.unit(
            res, where, step_s, flush=b.flush_records, extra=sync.record_fields(), digest=digest
        )

    def _execute(self, b: Boundary, res: StepResult) -> int | None:
        """Carry out a boundary; an exit code ends the loop."""
        self.state = b.state
        self.p.engine.step = b.state.step
        if b.action is Action.ADVANCE:
            self.p.engine.after_commit()
        if b.local_checkpoint:  # (first: rank 0's checkpoint then implies its local state)
            self.p.duties.local_checkpoint(self.step, self._sync(), self.rank)
        if b.checkpoint:
            self.p.duties.checkpoint(self.step, self._sync())
        if b.evaluate:
            self.p.duties.evaluate(self.step, self._sync())
        if self.p.on_phase is not None:
            self.p.on_phase(self.step, "boundary")
        if b.stop in (StopReason.NONFINITE, StopReason.NONFINITE_LIMIT):
            self.p.records.flush()
            own = bool(res.nonfinite)
            self.p.duties.nonfinite(self.step, res.nonfinite or "loss or gradient on another member", own)
            return EXIT_NONFINITE
        if b.stop is StopReason.REQUESTED:
            log.info("stop requested by the coordinator at step %d", self.step)
            return 0
        if b.recover:
            self.p.membership.close_group()
            if not self._enter(self.p.membership.recover(res.decision.failed), wanted=True):
                return 0
        if b.change_view and not self._change_view(b.change_view):
            log.info("worker %d left at step %d", self.p.membership.worker_id, self.step)
            return 0
        if b.switch_to and b.switch_to != self.option and not self._switch(b.switch_to):
            return 0
        for hook in list(self.boundary_hooks):
            hook(self)
        return None

    def _change_view(self, epoch: int) -> bool:
        self.p.membership.close_group()
        try:
            view = self.p.membership.move_to(epoch)
        except (CollectiveError, FlotillaError) as exc:
            if not self._sync().traits.barrier:
                return self._stay(epoch, exc)
            log.warning("transition to view %d failed: %s", epoch, exc)
            view = self.p.membership.recover(frozenset())
        if view is None:
            return False
        return self._enter(view, wanted=bool(view.joined))
