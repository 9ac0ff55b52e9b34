"""Events into and effects out of the loop machine (``loop_machine.py``), pure data.

An effect either just happens (``Log``, ``SetStep``, ``RecordUnit``, ``Checkpoint``, ...) or asks
something of the world whose answer is the machine's next event (a *query*: ``RunUnit`` ->
``UnitDone``, ``MoveTo`` -> ``Moved`` / ``MoveFailed``, ...), or ends the loop (``Exit``,
``Finish``, ``Refuse``).  Every list of effects the machine returns ends with exactly one query or
end, and only there: an executor runs the others in order, then answers the last one.  The
executor (``trainer/loop.py``) maps views, groups and the strategy object to these facts; a
simulator answers the same queries with modelled ones.

They are messages, made once and read once: plain slotted dataclasses, not frozen (a frozen
one's constructor costs 2-3 times as much, and a few are made per unit); nothing mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.sync.base import Outcome, Proposal, Terms
from flotilla.trainer.boundary import SwitchAt


@dataclass(slots=True)
class ViewFacts:
    """A membership view as the machine sees it: its epoch, this worker's rank and the size;
    ``joined``: it admitted newcomers (who are sent the state when it forms)."""

    epoch: int
    rank: int
    world_size: int
    joined: bool = False


# ---------------------------------------------------------------------- events (answers)
@dataclass(slots=True)
class FirstView:
    """The first view this worker entered (None: the job is over); ``initial``: the job's first
    view (its members resume from the job's checkpoint, if any).  ``step``/``has_state``: the
    engine's."""

    view: ViewFacts | None
    initial: bool = False
    step: int = 0
    has_state: bool = False


@dataclass(slots=True)
class Restored:
    step: int  # the step the resumed state is at (0: a fresh start)


@dataclass(slots=True)
class Built:
    terms: Terms  # the strategy just built: its regime and unit length (``sync.base.terms_of``)


@dataclass(slots=True)
class Entered:
    """The view formed: the members agreed on a state (engine at ``step``; ``has_state``);
    ``joined_at``: where a started strategy says a newcomer starts (``SyncStrategy.joined_at``)."""

    step: int
    has_state: bool = True
    joined_at: int = 0


@dataclass(slots=True)
class EnterFailed:
    reason: str  # a collective failed while the view formed


@dataclass(slots=True)
class ViewGiven:
    view: ViewFacts | None  # the view recovered into (None: this worker is out / the job is over)


@dataclass(slots=True)
class Moved:
    view: ViewFacts | None  # the agreed view moved to (None: this worker is not in it: it left)


@dataclass(slots=True)
class MoveFailed:
    reason: str  # the move was refused (the epoch is broken)


@dataclass(slots=True)
class Polled:
    """The membership and the role before a unit: the service is gone (``orphaned``); a stop or a
    leave was asked for; the newest epoch to propose; a switch requested (an option, 0: none);
    ``done``: the strategy says this worker's training is over (its partners finished);
    ``announced``: the strategy switches announced so far (``cluster/switch_announce.py``)."""

    orphaned: bool = False
    stop: bool = False
    leave: bool = False
    pending_epoch: int = 0
    switch: int = 0
    done: bool = False
    announced: tuple[SwitchAt, ...] = ()


@dataclass(slots=True)
class CaughtUp:
    view: ViewFacts | None  # the view to run the next unit in (None: this worker is out)


@dataclass(slots=True)
class UnitDone:
    """A unit's ``outcome`` (the strategy's, agreed under a vote); ``nonfinite``: what was not
    finite on this worker ("": nothing); ``pending_now``: the newest epoch known after the unit
    (asked for with ``RunUnit.ask_pending``); ``now_s``: the loop's clock; ``overflow``: fp16's
    loss scale overflowed (agreed under a vote): the unit was skipped, not non-finite."""

    outcome: Outcome
    nonfinite: str = ""
    pending_now: int = 0
    now_s: float = 0.0
    overflow: bool = False


Event = (
    FirstView | Restored | Built | Entered | EnterFailed | ViewGiven | Moved | MoveFailed | Polled
    | CaughtUp | UnitDone
)  # fmt: skip


# ---------------------------------------------------------------------- effects: queries
@dataclass(slots=True)
class AskFirstView:
    """-> ``FirstView``."""


@dataclass(slots=True)
class Restore:
    """-> ``Restored``: load the state to resume from (the engine then holds a state)."""


@dataclass(slots=True)
class Build:
    option: int  # -> ``Built``: the strategy of this option (0: the job's), for the current view


@dataclass(slots=True)
class EnterView:
    """-> ``Entered`` / ``EnterFailed``: make view ``epoch`` current; ``bind``: hand its group to
    the strategy and agree on the most advanced state (``wanted``: newcomers are sent it);
    ``start``: then start the strategy; ``average``: first make every replica's weights their
    exact mean (a switch into a vote from a strategy whose replicas drifted apart)."""

    epoch: int
    bind: bool
    wanted: bool
    start: bool
    average: bool = False


@dataclass(slots=True)
class Recover:
    failed: frozenset[int]  # -> ``ViewGiven``: the next view after a broken group


@dataclass(slots=True)
class MoveTo:
    epoch: int  # -> ``Moved`` / ``MoveFailed``


@dataclass(slots=True)
class CatchUp:
    """-> ``CaughtUp``: report a broken view and take the next one, never waiting."""


@dataclass(slots=True)
class Poll:
    """-> ``Polled``; ``propose``: ask for the pending epoch and a requested switch (to propose
    them in the unit's vote); ``ask_done``: ask the strategy whether training is over."""

    propose: bool
    ask_done: bool


@dataclass(slots=True)
class RunUnit:
    """-> ``UnitDone``: run steps ``[first_step, last_step]`` in view ``epoch`` at ``rank``."""

    first_step: int
    last_step: int
    epoch: int
    rank: int
    proposal: Proposal
    ask_pending: bool = False


# ---------------------------------------------------------------------- effects: ends
@dataclass(slots=True)
class Exit:
    code: int  # 0 done / stopped / left; 3 the membership service was lost; 4 non-finite


@dataclass(slots=True)
class Finish:
    """This worker trained its last step: close the strategy's part and report (the exit code is
    the duties'); ``agreed``: every replica holds the same state (the result carries a digest)."""

    step: int
    rank: int
    agreed: bool


@dataclass(slots=True)
class Refuse:
    message: str  # nothing can be trained correctly: raise with this line


# ---------------------------------------------------------------------- effects: actions
@dataclass(slots=True)
class Log:
    level: str  # "info", "warning", "error"
    message: str


@dataclass(slots=True)
class SetStep:
    step: int  # the engine's next step


@dataclass(slots=True)
class AfterCommit:
    """A unit committed (e.g. step the learning-rate schedule)."""


@dataclass(slots=True)
class RecordUnit:
    flush: bool
    digest: bool  # record the model's digest (every replica holds the same state)
    strategy: str = ""  # the running strategy's kind (the report marks the switches)


@dataclass(slots=True)
class RecordDiscarded:
    step: int
    epoch: int
    reason: str


@dataclass(slots=True)
class LocalCheckpoint:
    step: int
    rank: int


@dataclass(slots=True)
class Checkpoint:
    step: int
    agreed: bool  # every replica holds the same committed state (else the role may not write one)


@dataclass(slots=True)
class Evaluate:
    step: int


@dataclass(slots=True)
class FlushRecords:
    pass


@dataclass(slots=True)
class Nonfinite:
    step: int
    what: str
    own: bool


@dataclass(slots=True)
class CloseGroup:
    """Release the current view's group (peers blocked on it fail at once)."""


@dataclass(slots=True)
class CloseStrategy:
    """Before a switch: the running strategy lets go of the model."""


@dataclass(slots=True)
class BoundaryDone:
    step: int  # the whole boundary is done (view changes, switches): the role's hooks run


Query = AskFirstView | Restore | Build | EnterView | Recover | MoveTo | CatchUp | Poll | RunUnit
End = Exit | Finish | Refuse
Action = (
    Log | SetStep | AfterCommit | RecordUnit | RecordDiscarded | LocalCheckpoint | Checkpoint
    | Evaluate | FlushRecords | Nonfinite | CloseGroup | CloseStrategy | BoundaryDone
)  # fmt: skip
Effect = Query | End | Action
