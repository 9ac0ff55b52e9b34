"""ONE training loop for every engine and strategy: Membership x Engine x SyncStrategy.

The worker role (``roles/worker.py``) and the pipeline stage role (``roles/stage.py``) build the
parts (``trainer/parts.py``) and call :meth:`Loop.run`.  Every decision is the pure loop machine's
(``trainer/loop_machine.py``): this executor carries out its effects (``trainer/loop_events.py``)
on the parts and answers its queries.  It knows no strategy kind or trait; what a strategy
declares reaches the machine once, as its terms (``sync.base.terms_of``).

Failure is data: a broken group comes back as ``Outcome.broken``, a ``CollectiveError`` while a
view forms as ``EnterFailed``, a refused move as ``MoveFailed``; the machine decides what follows.

Exit codes: 0 done / stopped / left; 3 the membership service was lost; 4 a non-finite value
stopped the job (``trainer/boundary.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flotilla.cluster.membership import View
from flotilla.core.errors import CollectiveError, FlotillaError
from flotilla.sync.base import SyncStrategy, terms_of
from flotilla.trainer import loop_events as ev
from flotilla.trainer import loop_machine as lm
from flotilla.trainer.boundary import BoundaryPolicy, SwitchAt
from flotilla.trainer.loop_actions import answer_poll, carry_out, enter_view
from flotilla.trainer.parts import Duties, Engine, Membership, Records, StrategyMaker, UnitWhere
from flotilla.trainer.step import StepResult

__all__ = ["EXIT_NONFINITE", "EXIT_ORPHANED", "Loop", "LoopParts"]

EXIT_ORPHANED, EXIT_NONFINITE = lm.EXIT_ORPHANED, lm.EXIT_NONFINITE


@dataclass(kw_only=True)
class LoopParts:
    membership: Membership
    engine: Engine
    strategies: StrategyMaker
    duties: Duties
    records: Records
    policy: BoundaryPolicy
    name: str = ""
    clock: Callable[[], float] = time.monotonic
    switch_requests: list[int] = field(default_factory=list)  # options asked for by a policy/test


class Loop:
    def __init__(self, parts: LoopParts) -> None:
        self.p = parts
        self.view: View | None = None
        self.strategy: SyncStrategy | None = None
        self.boundary_hooks: list[Callable[[Loop], None]] = []
        self._t0 = parts.clock()
        self.unit: tuple[StepResult, UnitWhere, float] | None = None  # the last unit run
        self.ignored: set[SwitchAt] = set()  # announced switches to options this worker lacks
        self.commits = 0  # units committed by this loop (cluster/rejoin.py reads it)

    @property
    def step(self) -> int:
        return self.p.engine.step

    def run(self) -> int:
        state, effects = lm.start(self.p.policy, self.p.membership.worker_id)
        try:
            while True:
                for effect in effects[:-1]:
                    carry_out(self, effect)
                answer = self._answer(effects[-1])
                if isinstance(answer, int):
                    return answer
                state, effects = lm.step(state, answer)
        finally:
            if self.strategy is not None:
                self.strategy.close()

    def sync(self) -> SyncStrategy:
        assert self.strategy is not None
        return self.strategy

    def _facts(self, view: View | None) -> ev.ViewFacts | None:
        if view is None:
            return None
        self.view = view
        rank = view.rank_of(self.p.membership.worker_id)
        return ev.ViewFacts(view.epoch, rank, view.world_size, joined=bool(view.joined))

    def _answer(self, e: ev.Effect) -> ev.Event | int:
        p, m = self.p, self.p.membership
        match e:  # (the queries of every unit first)
            case ev.RunUnit():
                return self._run_unit(e)
            case ev.Poll():
                return answer_poll(self, e)
            case ev.AskFirstView():
                entry = m.first_view()
                if entry is None:
                    return ev.FirstView(None)
                facts = self._facts(entry.view)
                return ev.FirstView(facts, entry.initial, p.engine.step, p.engine.has_state)
            case ev.Restore():
                p.engine.step, p.engine.has_state = p.duties.restore() or 0, True
                return ev.Restored(p.engine.step)
            case ev.Build(option=option):
                assert self.view is not None
                self.strategy = p.strategies(option, self.view)
                return ev.Built(terms_of(self.strategy))
            case ev.EnterView():
                return enter_view(self, e)
            case ev.Recover(failed=failed):
                return ev.ViewGiven(self._facts(m.recover(failed)))
            case ev.MoveTo(epoch=epoch):
                try:
                    return ev.Moved(self._facts(m.move_to(epoch)))
                except (CollectiveError, FlotillaError) as exc:
                    return ev.MoveFailed(str(exc))
            case ev.CatchUp():
                return ev.CaughtUp(self._facts(m.catch_up()))
            case ev.Exit(code=code):
                return code
            case ev.Finish(step=step, rank=rank, agreed=agreed):
                self.sync().mark_finished()
                return p.duties.finish(step, self.sync(), rank, agreed=agreed)
            case ev.Refuse(message=message):
                raise FlotillaError(message)
        raise TypeError(f"loop: {e!r} is not a query")

    def _run_unit(self, e: ev.RunUnit) -> ev.Event:
        assert self.view is not None
        sync, p = self.sync(), self.p
        where = UnitWhere(e.first_step, e.last_step, self.view, e.rank, split=sync.data_split())
        t0 = time.perf_counter()
        res = p.engine.run_unit(where, sync, e.proposal)
        self.unit = (res, where, time.perf_counter() - t0)
        pending = p.membership.pending_epoch() if e.ask_pending else 0
        return ev.UnitDone(res.decision, res.nonfinite, pending, p.clock() - self._t0, res.overflow)
