"""The loop's view changes for a strategy WITHOUT a barrier (``ps``): a move to a newer view that
fails (its epoch is broken: the coordinator is waiting for every member's report) never waits
for the failure round -- the worker trains on in its view and asks again at the next boundary.

Why (found by ``tests/multiproc/test_ps_churn.py -m slow``, about 1 run in 5): after a PS worker
was killed, a slow survivor waited in that round for the others' reports while the others waited
for it in the SSP gate; after the coordinator's 30-s grace both fast survivors were declared out.
With a barrier (``allreduce``) the members meet in the view, so the loop still recovers there.
"""

from __future__ import annotations

from typing import Any

from flotilla.cluster.membership import View
from flotilla.core.errors import FlotillaError
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import Loop, LoopParts
from flotilla.trainer.parts import StaticMembership, UnitWhere
from flotilla.trainer.step import StepResult

TOTAL = 12
PUBLISHED_AT = 3  # the newer view (epoch 2) is published during this step's unit: the loop
# sees it at the boundary after it (the engine then at PUBLISHED_AT + 1)
READY_AT = 8  # ...and it can be entered from the boundary at this step on


class _Sync(SyncStrategy):
    kind = "fake"

    def __init__(self, barrier: bool) -> None:
        self.traits = Traits(regime=Regime.VOTE if barrier else Regime.ALONE)

    def begin_step(self, step: int) -> None:
        pass

    def synchronize(self, proposal: Proposal) -> Outcome:
        return Outcome.agreed_alone(proposal)


class _Strategies:
    def __init__(self, barrier: bool) -> None:
        self.barrier = barrier

    def __call__(self, option: int, view: View) -> SyncStrategy:
        return _Sync(self.barrier)

    def describe(self, option: int) -> str:
        return "fake"

    def known(self, option: int) -> bool:
        return option == 0


class _Engine:
    def __init__(self) -> None:
        self.step, self.has_state = 0, True
        self.views: list[int] = []  # the view epoch each unit ran in

    def run_unit(self, where: UnitWhere, strategy: SyncStrategy, proposal: Proposal) -> StepResult:
        self.views.append(where.view.epoch)
        return StepResult(strategy.synchronize(proposal), 1.0, 8, 0.0, 0.0)

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        return {}, []

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        pass

    def digest(self) -> str:
        return ""

    def after_commit(self) -> None:
        pass


class _Group:
    """A group of one: a view's state agreement (``trainer/state_sync.py``) finds nothing to move."""

    rank, world_size = 0, 1

    def allreduce(self, tensor: Any, op: str = "sum") -> None:
        pass

    def broadcast(self, tensors: Any, src: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Membership(StaticMembership):
    """View 1 of two members; view 2 is published at ``PUBLISHED_AT`` and broken until
    ``READY_AT`` (``get_view`` refused); every call is logged."""

    def __init__(self, engine: _Engine) -> None:
        super().__init__(0, 2, make_group=lambda view: _Group())
        self.engine = engine
        self.calls: list[tuple[str, int]] = []

    def pending_epoch(self) -> int:
        return 2 if self.engine.step >= PUBLISHED_AT and self.view.epoch < 2 else 0

    def move_to(self, epoch: int) -> View | None:
        self.calls.append(("move_to", self.engine.step))
        if self.engine.step < READY_AT:
            raise FlotillaError("view_broken: epoch 1 lost a member; poll for the next view")
        self.view = View(epoch=2, members=(0, 1))
        return self.view

    def recover(self, failed: frozenset[int]) -> View | None:
        self.calls.append(("recover", self.engine.step))
        self.view = View(epoch=2, members=(0, 1))  # (the round closed: what a wait would give)
        return self.view


class _Duties:
    def restore(self) -> int | None:
        return None

    def restore_lost(self, strategy: Any = None) -> int | None:
        return None

    def checkpoint(self, step: int, strategy: Any, *, agreed: bool) -> None:
        pass

    def local_checkpoint(self, step: int, strategy: Any, rank: int) -> None:
        pass

    def evaluate(self, step: int, strategy: Any) -> None:
        pass

    def finish(self, step: int, strategy: Any, rank: int, *, agreed: bool) -> int:
        return 0

    def nonfinite(self, step: int, what: str, own: bool = False) -> None:
        pass


class _Records:
    def unit(self, *args: Any, **kwargs: Any) -> None:
        pass

    def discarded(self, step: int, membership_epoch: int, why: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _run(barrier: bool) -> tuple[_Engine, _Membership, int]:
    engine = _Engine()
    membership = _Membership(engine)
    loop = Loop(
        LoopParts(
            membership=membership,
            engine=engine,
            strategies=_Strategies(barrier),
            duties=_Duties(),
            records=_Records(),
            policy=BoundaryPolicy(total_steps=TOTAL, on_nonfinite="stop"),
            clock=lambda: 0.0,
        )
    )
    return engine, membership, loop.run()


def test_without_a_barrier_a_broken_move_trains_on_in_the_view_and_retries() -> None:
    engine, membership, code = _run(barrier=False)
    assert code == 0 and engine.step == TOTAL
    assert all(what == "move_to" for what, _ in membership.calls), membership.calls
    # one try per boundary from the publication until the view is ready, then view 2
    assert [s for _, s in membership.calls] == list(range(PUBLISHED_AT + 1, READY_AT + 1))
    assert engine.views == [1] * READY_AT + [2] * (TOTAL - READY_AT)


def test_with_a_barrier_a_broken_move_recovers_in_the_next_view() -> None:
    engine, membership, code = _run(barrier=True)
    assert code == 0 and engine.step == TOTAL
    first = PUBLISHED_AT + 1
    assert membership.calls == [("move_to", first), ("recover", first)]
    assert engine.views == [1] * first + [2] * (TOTAL - first)
