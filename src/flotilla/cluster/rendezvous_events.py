"""Events into and replies out of the rendezvous state machine (``rendezvous.py``), pure data.

Every event carries the time it happened (``now_s``, from the caller's clock); replies are what the
coordinator turns into message-plane answers (``PollReply`` -> ``poll_view``, ``ViewReply`` ->
``get_view``, ``Refused`` -> an error reply with its code).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from flotilla.cluster.membership import View


@dataclass(frozen=True, slots=True)
class Joined:
    now_s: float


@dataclass(frozen=True, slots=True)
class Polled:
    """``poll_view``: the first one marks the worker ready; with ``adopt`` and ``after_epoch`` at
    or past the adopted epoch it is a failure report."""

    worker_id: int
    after_epoch: int
    adopt: bool
    now_s: float


@dataclass(frozen=True, slots=True)
class ViewRequested:
    """``get_view``: the workers voted to move to ``epoch``."""

    worker_id: int
    epoch: int
    now_s: float


@dataclass(frozen=True, slots=True)
class LeaveRequested:
    """A worker leaves the job: asked to (SIGTERM), or ``finished``: it trained the job's last
    step and is not the rank that reports the result (its state is then DONE, not LEFT)."""

    worker_id: int
    now_s: float
    finished: bool = False


@dataclass(frozen=True, slots=True)
class DeathNoticed:
    """The launcher saw the process die (or anything else that knows it is dead)."""

    worker_id: int
    now_s: float


@dataclass(frozen=True, slots=True)
class Suspected:
    """Worker ``reporter`` stopped hearing from its ring neighbours ``suspects`` (the peer watch,
    ``cluster/peer_watch.py``).  Corroborated by this machine's own record: a suspect in play
    whose last heartbeat here is older than ``silence_s`` as well is *suspected* (out of the
    views; a frozen worker that wakes up comes back as a newcomer with its next poll) and the
    adopted epoch is broken; a suspect still heartbeating is left alone (the reporter's own link
    may be the broken one).  ``closed``: the reporter's liveness connections to the suspects
    ended (``comm/liveness.py``): their processes are gone, which needs no corroboration."""

    reporter: int
    suspects: tuple[int, ...]
    silence_s: float
    now_s: float
    closed: bool = False


@dataclass(frozen=True, slots=True)
class Exited:
    """The process exited normally."""

    worker_id: int
    now_s: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``stamp``: the newest lease stamp (the coordinator's clock in a heartbeat reply) the worker
    received, echoed -- its lease renewal (``cluster/lease.py`` rule 1); None: it renews nothing.
    ``runs``: the epoch of the view it runs (0: none yet) -- it has left every older view."""

    worker_id: int
    now_s: float
    trained: bool = False  # it carried training records
    stamp: float | None = None
    runs: int = 0


@dataclass(frozen=True, slots=True)
class RingReturned:
    """A heartbeat from a worker in ring mode (``cluster/lease.py`` rule 5): it went on without
    the coordinator, and runs view ``epoch`` of ``members`` (epoch 0: none yet).  The heal."""

    worker_id: int
    epoch: int
    members: tuple[int, ...]
    now_s: float
    trained: bool = False


@dataclass(frozen=True, slots=True)
class Tick:
    now_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    now_s: float


@dataclass(frozen=True, slots=True)
class StopRequested:
    now_s: float


Event = (
    Joined
    | Polled
    | ViewRequested
    | LeaveRequested
    | DeathNoticed
    | Suspected
    | Exited
    | Heartbeat
    | RingReturned
    | Tick
    | Finished
    | StopRequested
)


# ---------------------------------------------------------------------- replies
class PollStatus(Enum):
    VIEW = "view"
    WAIT = "wait"
    DONE = "done"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class Registered:
    worker_id: int


@dataclass(frozen=True, slots=True)
class PollReply:
    status: PollStatus
    view: View | None = None
    initial: bool = False


@dataclass(frozen=True, slots=True)
class ViewReply:
    view: View


@dataclass(frozen=True, slots=True)
class EpochReply:
    epoch: int


@dataclass(frozen=True, slots=True)
class Refused:
    code: str
    message: str


Reply = Registered | PollReply | ViewReply | EpochReply | Refused | None
