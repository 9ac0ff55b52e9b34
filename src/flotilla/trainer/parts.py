"""The parts the loop (``trainer/loop.py``) drives, as protocols: a worker is Membership x Engine x
SyncStrategy, plus the role's duties and records.

- :class:`Membership` -- who trains together: the current view, a pending change, and recovery
  after a broken group.  ``roles/coordinated.py`` implements it through the coordinator (views
  minted by the rendezvous state machine); ``StaticMembership`` below is a fixed set (pipeline
  stages); ring repair (Spotnik) will be another implementation.  The loop never knows which.
- :class:`Engine` -- what one unit of work is: a replica's forward/backward of whole minibatches
  (``trainer/replica.py``) or a pipeline stage's slice of a schedule (``trainer/stage_engine.py``).
  It also holds the model state the members agree on when a view forms.
- the strategy (``sync/base.py``) and how to build one (:class:`StrategyMaker`).
- :class:`Duties` -- what the role does at boundaries besides training: restore, checkpoint,
  evaluate, finish (report the result, export the model).
- :class:`Records` -- metrics records out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flotilla.cluster.membership import View
from flotilla.comm.collective import Group
from flotilla.sync.base import Proposal, SyncStrategy
from flotilla.trainer.boundary import SwitchAt
from flotilla.trainer.step import StepResult

__all__ = [
    "Duties",
    "Engine",
    "Entry",
    "Membership",
    "Records",
    "StaticMembership",
    "StrategyMaker",
    "UnitWhere",
]


@dataclass(frozen=True, slots=True)
class Entry:
    """A view this worker entered; ``initial``: it is the job's first view (its members hold
    the seeded or resumed initial model; a later joiner holds nothing until a member sends it)."""

    view: View
    initial: bool = False


class Membership(Protocol):
    worker_id: int

    @property
    def orphaned(self) -> bool:
        """The membership service is gone for good: the worker must exit."""
        ...

    @property
    def stop_requested(self) -> bool: ...

    @property
    def leave_requested(self) -> bool: ...

    def first_view(self) -> Entry | None:
        """Block until a view containing this worker is adopted; None: the job is over."""
        ...

    def pending_epoch(self) -> int:
        """The newest epoch to propose moving to (0: none); a leave request mints one."""
        ...

    def announced(self) -> tuple[SwitchAt, ...]:
        """The strategy switches announced at run time so far (step, option)."""
        ...

    def move_to(self, epoch: int) -> View | None:
        """The agreed view ``epoch`` (None: this worker is not in it -- it left)."""
        ...

    def catch_up(self) -> View | None:
        """Between units of a strategy of groups formed per unit (``Regime.GROUPS``): report a
        broken view and take the next one once formed, never waiting.  The view to run now
        (maybe the current one); None: this worker is out of the job."""
        ...

    def recover(self, failed: frozenset[int]) -> View | None:
        """Our group broke (``failed``: the peers known to have failed): the next view that
        contains us (None: we are out, or the job is over)."""
        ...

    def group(self, view: View) -> Group:
        """The process group of ``view`` (built on first use, one per view)."""
        ...

    def close_group(self) -> None:
        """Release the current view's group (after a failure, before a new view)."""
        ...

    def groups(self) -> Any:
        """A factory of groups by namespace (``comm.group_factory.GroupFactory``), or None."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class UnitWhere:
    """Where a unit runs: its steps and the view (``split``: the rank and world size its data is
    split with, when the strategy decides it: ``SyncStrategy.data_split``)."""

    first_step: int
    last_step: int
    view: View
    rank: int
    split: tuple[int, int] | None = None

    @property
    def data_split(self) -> tuple[int, int]:
        return self.split if self.split is not None else (self.rank, self.view.world_size)


class Engine(Protocol):
    step: int  # the next step this engine's state is at
    has_state: bool  # False for a newcomer until a member sends it the state

    def run_unit(self, where: UnitWhere, strategy: SyncStrategy, proposal: Proposal) -> StepResult: ...

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        """(meta, tensors) of the state members agree on (model, optimizer, step...)."""
        ...

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None: ...

    def digest(self) -> str: ...

    def after_commit(self) -> None:
        """A unit committed (e.g. step the learning-rate schedule)."""
        ...

    def average(self, group: Group) -> None:
        """Make the model's weights the exact mean over ``group`` (before a switch into a vote)."""
        ...


class StrategyMaker(Protocol):
    def __call__(self, option: int, view: View) -> SyncStrategy:
        """Option 0: the job's strategy; 1..n: the job's switch options."""
        ...

    def describe(self, option: int) -> str: ...

    def known(self, option: int) -> bool:
        """Whether ``option`` is one this worker can build."""
        ...


class Duties(Protocol):
    def restore(self) -> int | None:
        """A member of the first view: load the state to resume from; its step (None: fresh)."""
        ...

    def restore_lost(self, strategy: SyncStrategy | None = None) -> int | None:
        """Every replica of the state is gone: load the job's newest checkpoint (its step, and the
        strategy's own state into ``strategy``), or None if there is none (the job cannot go on)."""
        ...

    def checkpoint(self, step: int, strategy: SyncStrategy, *, agreed: bool) -> None:
        """A checkpoint fell due; ``agreed``: every replica holds the same committed state (the
        strategy votes on every unit), so one rank's copy is the job's."""
        ...

    def local_checkpoint(self, step: int, strategy: SyncStrategy, rank: int) -> None:
        """Every rank, at the steps a checkpoint falls due: save this rank's own state (e.g. an
        inner optimizer's, ``SyncStrategy.local_state_dict``) beside rank 0's checkpoint."""
        ...

    def evaluate(self, step: int, strategy: SyncStrategy) -> None: ...

    def finish(self, step: int, strategy: SyncStrategy, rank: int, *, agreed: bool) -> int:
        """The job's steps are done: report the result (rank 0; ``agreed``: with the digest every
        replica shares); the exit code."""
        ...

    def nonfinite(self, step: int, what: str, own: bool) -> None:
        """The job stops on a non-finite value (one line; the exported model is the last finite)."""
        ...


class Records(Protocol):
    def unit(
        self,
        res: StepResult,
        where: UnitWhere,
        step_s: float,
        *,
        flush: bool,
        extra: dict[str, Any],
        digest: Any,
    ) -> None: ...

    def discarded(self, step: int, membership_epoch: int, why: str) -> None: ...

    def flush(self) -> None: ...


class StaticMembership:
    """A fixed member set that never changes (pipeline stages of one job): view 1 of
    ``num_members``; a broken group ends the job (there is no one to recover with)."""

    def __init__(self, worker_id: int, num_members: int, make_group: Any) -> None:
        self.worker_id = worker_id
        self.view = View(epoch=1, members=tuple(range(num_members)))
        self._make_group = make_group
        self._group: Group | None = None

    orphaned = False
    stop_requested = False
    leave_requested = False

    def first_view(self) -> Entry | None:
        return Entry(self.view, initial=True)

    def pending_epoch(self) -> int:
        return 0

    def announced(self) -> tuple[SwitchAt, ...]:
        return ()

    def move_to(self, epoch: int) -> View | None:
        return self.view

    def catch_up(self) -> View | None:
        return self.view

    def recover(self, failed: frozenset[int]) -> View | None:
        return None

    def group(self, view: View) -> Group:
        if self._group is None:
            self._group = self._make_group(view)
        return self._group

    def close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def groups(self) -> Any:
        return None

    def close(self) -> None:
        self.close_group()
