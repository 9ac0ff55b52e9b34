"""The training loop machine's state between two events (``trainer/loop_machine.py`` holds its
transitions): the phase it waits in and every field a transition reads.  Pure data: no torch,
no I/O, no clock.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from flotilla.sync.base import Regime
from flotilla.trainer.boundary import BoundaryPolicy, LoopState, SwitchAt

__all__ = ["EXIT_NONFINITE", "EXIT_ORPHANED", "Machine", "Phase"]

EXIT_ORPHANED = 3
EXIT_NONFINITE = 4


class Phase(Enum):
    """The answer the machine waits for."""

    FIRST_VIEW = "first_view"
    RESTORE = "restore"
    BUILD = "build"
    ENTER = "enter"
    RECOVER = "recover"
    MOVE = "move"
    POLL = "poll"
    CATCH_UP = "catch_up"
    UNIT = "unit"
    ENDED = "ended"


class Machine(NamedTuple):
    """The loop's state between two events (a named tuple: a new state per event costs a few
    microseconds, not the tens a frozen dataclass's ``replace`` takes with this many fields)."""

    policy: BoundaryPolicy
    worker: int
    phase: Phase = Phase.FIRST_VIEW
    regime: Regime = Regime.ALONE
    newcomers: bool = True  # the running strategy takes newcomers (Terms.takes_newcomers)
    k: int = 1  # minibatches per commit unit
    name: str = ""  # the running strategy's kind (for the log)
    option: int = 0  # the running switch option (0: the job's strategy)
    epoch: int = 0
    rank: int = 0
    world: int = 0
    step: int = 0  # the engine's next step
    has_state: bool = False
    progress: LoopState | None = None  # None until training starts
    last: int = 0  # the running unit's last step
    starting: bool = False  # the view being entered starts the strategy
    switch_from: str = ""  # a switch in progress: the strategy it switches from
    then_switch: int = 0  # the option to switch to once the view change in progress is done
    in_boundary: bool = False  # a boundary is being carried out (BoundaryDone at its end)
    moving_to: int = 0
    stayed: int = 0  # the last epoch a barrier-free move to failed for (logged once)
    ran_unit: bool = False
    plan_at: int = 0  # switch-plan entries up to this step were honoured
    announced: tuple[SwitchAt, ...] = ()  # switches announced at run time, in order
    honoured: frozenset[SwitchAt] = frozenset()  # ...those already taken
    average: bool = False  # the switch in progress leaves a regime whose replicas drift apart
