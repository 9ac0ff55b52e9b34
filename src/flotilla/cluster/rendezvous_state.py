"""The rendezvous state machine's data (pure): worker states, the membership state, a failure
round, a transition, and ``broken_epoch``.  ``cluster/rendezvous.py`` holds the transitions
(``step``); its module doc states the rules and invariants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.failure import FailurePolicy
from flotilla.cluster.lease import LeaseTerms
from flotilla.cluster.membership import View

__all__ = [
    "EXPECTED",
    "GONE",
    "IN_PLAY",
    "FailureRound",
    "Member",
    "Rendezvous",
    "RendezvousConfig",
    "Transition",
    "WorkerState",
    "broken_epoch",
]


class WorkerState(Enum):
    JOINED = "joined"  # registered, still setting up
    READY = "ready"  # polled once: may enter a view
    TRAINING = "training"  # its metrics records arrive
    SUSPECTED = "suspected"  # alive but did not report a broken epoch in time; out of the views
    LEFT = "left"
    DEAD = "dead"
    DONE = "done"


IN_PLAY = frozenset({WorkerState.READY, WorkerState.TRAINING})
EXPECTED = IN_PLAY | {WorkerState.JOINED, WorkerState.SUSPECTED}  # still expected to talk
GONE = frozenset({WorkerState.LEFT, WorkerState.DEAD, WorkerState.DONE})


@dataclass(frozen=True, kw_only=True, slots=True)
class Member:
    """``last_seen_s``: its last message of any kind (silence); ``renewed_s``: the newest lease
    stamp it echoed (``cluster/lease.py``); ``proven``: its process is known gone (a death
    notice, a closed liveness connection), not merely silent -- until a message from it says
    otherwise."""

    worker_id: int
    state: WorkerState
    last_seen_s: float
    renewed_s: float | None = None
    proven: bool = False
    runs_epoch: int = 0  # the newest epoch it said it runs (heartbeats): it left every older view
    done_s: float | None = None  # when it said it finished its part (DONE by its own leave)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureRound:
    """Epoch ``epoch`` is broken; ``reported`` members wait for the next view."""

    epoch: int
    reported: frozenset[int] = frozenset()
    first_report_s: float | None = None  # the grace runs from here


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    """``lease``: the partition rule's terms (``cluster/lease.py``); None: views are minted
    without it (proof of death alone guards the other side; the state machine's own tests)."""

    min_workers: int
    policy: FailurePolicy
    lease: LeaseTerms | None = None

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers must be >= 1, got {self.min_workers}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """The whole membership state.  Its mappings are never mutated: ``step`` builds new ones."""

    config: RendezvousConfig
    workers: Mapping[int, Member] = field(default_factory=dict)
    views: Mapping[int, View] = field(default_factory=dict)
    latest_epoch: int = 0
    adopted_epoch: int = 0
    initial_epoch: int = -1
    failure: FailureRound | None = None
    last_check_s: float | None = None  # the previous silence check
    # adopted epochs a ring side may still start from (cluster/lease.py: every one is leased)
    bases: tuple[int, ...] = ()
    stop: bool = False
    done: bool = False

    @property
    def adopted(self) -> View | None:
        return self.views.get(self.adopted_epoch)

    @property
    def latest(self) -> View | None:
        return self.views.get(self.latest_epoch)

    def dead(self) -> frozenset[int]:
        return frozenset(w for w, m in self.workers.items() if m.state is WorkerState.DEAD)


@dataclass(frozen=True, slots=True)
class Transition:
    state: Rendezvous
    reply: ev.Reply = None
    published: tuple[View, ...] = ()  # minted, in epoch order
    adopted: tuple[View, ...] = ()  # newly adopted, in epoch order
    dead: tuple[int, ...] = ()  # newly declared dead


def broken_epoch(state: Rendezvous) -> int:
    """The adopted epoch if it is broken (a failure reported, or a member known dead), else 0.
    Workers still inside a collective of that epoch abort it at once (the heartbeat reply says
    so), instead of waiting out the collective's timeout."""
    if state.failure is not None:
        return state.failure.epoch
    view = state.adopted
    if view is not None and any(state.workers[w].state is WorkerState.DEAD for w in view.members):
        return view.epoch
    return 0
