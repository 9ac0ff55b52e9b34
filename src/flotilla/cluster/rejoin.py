"""Whether a worker the job went on without comes back as a newcomer (issue 37 item 1).  Pure
(DESIGN §1): no I/O, no clock; the worker role (``roles/worker.py``, :func:`run_worker`) asks
it after every session and the simulator can too.

A *session* is one membership of the job: a join, the views it trained in, and its end.  A
session that ends *evicted* (the coordinator declared the worker dead -- a freeze longer than
``cluster.heartbeat_timeout_s``, a network cut -- or a view was chosen without it) is followed
by a new one: the worker drops everything it held (model, optimizer, groups, links), joins again
under the same name, and receives the current state from a live replica like any newcomer.  The
coordinator decides whether the job admits it (a finished job refuses with ``job_over``).

A worker evicted ``max_idle`` sessions in a row without committing a single step in any of them
gives up with one line: something keeps it from training (its peers cannot reach the address it
advertises, say), and rejoining forever would hide that.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_IDLE_SESSIONS", "Rejoin", "after_session"]

MAX_IDLE_SESSIONS = 3


@dataclass(frozen=True, slots=True)
class Rejoin:
    """The verdict after a session: ``rejoin`` or not, the consecutive idle evicted sessions so
    far, and why (a line for the log)."""

    rejoin: bool
    idle: int
    why: str


def after_session(
    *, evicted: bool, commits: int, idle: int, coordinator: bool = True, max_idle: int = MAX_IDLE_SESSIONS
) -> Rejoin:
    """The verdict after a session that ended ``evicted`` (or not) having committed ``commits``
    units, ``idle`` evicted sessions without a commit having preceded it; ``coordinator``: the
    coordinator still answers (in ring mode nobody joins: ``docs/membership.md``)."""
    if commits < 0 or idle < 0 or max_idle < 1:
        raise ValueError(f"commits, idle >= 0 and max_idle >= 1, got {commits}, {idle}, {max_idle}")
    if not evicted:
        return Rejoin(False, 0, "the session ended by itself (finished, left or failed)")
    if not coordinator:
        return Rejoin(False, idle, "the job went on without this worker and has no coordinator to rejoin")
    idle = 0 if commits else idle + 1
    if idle >= max_idle:
        return Rejoin(
            False,
            idle,
            f"evicted {idle} times in a row without committing a step: giving up (can the other "
            "workers reach the address this one advertises?)",
        )
    return Rejoin(True, idle, "the job went on without this worker: rejoining as a newcomer")
