"""The clock rules of one parameter-server shard, pure: who may join at which clock, resync after
a restart, leave, when the job is complete, whether a push's clock is new, a retry or an error, and
whether a pull may be served now (SPEC §1, §2).  No torch, no I/O, no wall clock.

:class:`ShardClocks` is immutable; every transition returns a new value or raises
:class:`Refused` (``code`` is the wire error code the server answers with, e.g. ``bad_clock``,
``unknown_worker``) and changes nothing.

Rules:
- **hello** (first time): a worker not known to the shard joins at the clock it names, while fewer
  than ``num_workers`` workers have joined; the first joiner sets the table's floor, a later one
  at a lower clock lowers it (workers may start from a resumed checkpoint in any order).
  A shard of a **resumed job** (``resume_at`` > 0: its state was cut from a previous job's
  shards at that clock, ``ps/reshard.py``) takes a first hello below ``resume_at`` at
  ``resume_at``: the workers learn where the job goes on from the reply.
  **hello again**: returns the recorded clock; only with ``resync`` (the server restarted since
  the worker last saw it) a *higher* clock named by the worker replaces the recorded one.
  A worker that has left may not come back.
- **join mid-run** (membership, docs/ps.md): once every expected worker has joined, a new worker
  still joins: at ``max(clock, c_global)`` (it cannot lower the global clock, so no bound a read
  already served relied on moves back) and, on shard 0, at least at the first clock of the data
  view it is added to (``ps/data_views.py``: ``max`` of the table + 2); only if ``clock`` is at
  most :data:`JOIN_LEAD` past every live worker (``max`` of the table) and every clock a departed
  worker left at (``high``): a clock further ahead is refused.  Until its first push such a
  worker is *fresh*: a hello naming a higher clock (still not ahead of every live worker) moves
  it there, so that a joiner can end up at the same clock on every shard even though the
  shards' ``c_global`` differ for a moment.  The server's 1/N shares then
  count the live workers.  Bounds: every clock and worker id a peer names is below
  :data:`MAX_CLOCK` / :data:`MAX_WORKER_ID`, checked before use; a resync (hello after a
  restart) may raise a clock by at most :data:`MAX_RESYNC_JUMP` past the newest recorded one.
- **leave**: the worker's clock is dropped (``c_global`` may rise); it stays ``departed``.
- **data views** (shard 0 only, ``keeps_views``): once every expected worker has joined, the first
  data view holds them; every later join, leave and eviction makes a new one and records the
  slices nobody will push as dropped (``ps/data_views.py``, which says why no worker ever
  computes a clock under two views).
- **evict** (a worker the coordinator declared dead or gone, told by a survivor): a leave at the
  clock the shard recorded for it, remembered in ``evicted`` (its data slices pass to the
  survivors, so the server's momentum shares do not shrink: ``ps/shard_sgd.py``); evicting a
  worker the shard does not know, or one that already left, changes nothing (``evict`` says
  whether it did anything).  Once departed a worker id never counts in ``c_global`` again, so
  no gate waits on a worker known dead.
- **bar** (an id the hosting process knows will never train -- a newcomer given up, whose hello
  may still be on its way): an id the shard does not know is marked departed, so its hello is
  refused from then on; a known or departed id changes nothing (evict that one).
- **complete**: every expected worker has joined once (departed ones count).
- **push** tagged ``clock``: must be the worker's recorded clock (advance by one); the previous
  clock is a *retry* (acknowledged, not applied again); anything else is ``bad_clock``.
- **pull** for ``clock``: ``0 <= clock <= own + max_pull_ahead(model)``; ASP serves at once,
  the other models once the job is complete and :func:`~flotilla.ps.consistency.may_serve_pull`
  allows it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flotilla.core.errors import FlotillaError
from flotilla.ps import data_views
from flotilla.ps.consistency import (
    ASP,
    ClockError,
    ClockTable,
    ConsistencyModel,
    WorkerId,
    allowed_lag,
    max_pull_ahead,
    may_serve_pull,
)
from flotilla.ps.data_views import DataViews

__all__ = [
    "JOIN_LEAD",
    "MAX_CLOCK",
    "MAX_RESYNC_JUMP",
    "MAX_WORKER_ID",
    "Refused",
    "ShardClocks",
    "blocked_reason",
    "check_pull",
    "evict",
    "hello",
    "leave",
    "push",
]

MAX_CLOCK = 2**40  # no job pushes 10^12 clocks; a larger claim is refused before use
MAX_RESYNC_JUMP = 100_000  # clocks a restarted shard's table may lag its workers by
MAX_WORKER_ID = 2**20  # worker ids are small ints handed out by the coordinator
JOIN_LEAD = 3  # a joiner may name a clock this far past the highest live clock (data views)


class Refused(FlotillaError):
    """A request the clock rules refuse; ``code`` is the server's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardClocks:
    """A shard's clock table and membership; ``num_workers`` workers are expected."""

    num_workers: int
    table: ClockTable = ClockTable()
    joined: frozenset[WorkerId] = frozenset()
    departed: frozenset[WorkerId] = frozenset()
    fresh: frozenset[WorkerId] = frozenset()  # joined mid-run, not pushed yet: may move its clock up
    evicted: frozenset[WorkerId] = frozenset()  # departed by ``evict`` (declared dead), not by a leave
    high: int = 0  # the highest clock a departed worker left at (the join bound counts it)
    keeps_views: bool = False  # shard 0: keeps the job's data views (``ps/data_views.py``)
    views: DataViews = DataViews()
    resume_at: int = 0  # a resumed job's first clock: a first hello below it joins at it

    @property
    def top(self) -> int:
        """The highest clock of a live worker (the floor if there is none)."""
        return max((c for _, c in self.table.entries), default=self.table.floor)

    @property
    def complete(self) -> bool:
        return len(self.joined) >= self.num_workers

    def clock_of(self, worker_id: WorkerId) -> int:
        """The worker's recorded clock; ``Refused("unknown_worker")`` if it has not said hello."""
        try:
            return self.table.clock_of(worker_id)
        except ClockError:
            raise Refused("unknown_worker", f"worker {worker_id!r} has not said hello") from None


def hello(state: ShardClocks, worker_id: int, clock: int, *, resync: bool) -> tuple[ShardClocks, int]:
    """Register ``worker_id`` at ``clock`` (see the module doc); returns the new state and the
    worker's recorded clock."""
    if type(worker_id) is not int or type(clock) is not int or worker_id < 0 or clock < 0:
        raise Refused("bad_clock", "worker_id and clock must be ints >= 0")
    if worker_id > MAX_WORKER_ID or clock > MAX_CLOCK:
        raise Refused("bad_clock", f"worker_id must be <= {MAX_WORKER_ID} and clock <= {MAX_CLOCK}")
    if worker_id in state.departed:
        raise Refused("unknown_worker", f"worker {worker_id} has left this job")
    clocks = state.table.as_dict()
    if worker_id in clocks:
        if worker_id in state.fresh and clock > clocks[worker_id]:
            return _move_fresh(state, worker_id, clock)
        if resync and clock > clocks[worker_id]:
            _check_resync(state, worker_id, clock)
            clocks[worker_id] = clock
            table = ClockTable(tuple(sorted(clocks.items())), floor=state.table.floor)
            return replace(state, table=table), clock
        return state, clocks[worker_id]
    if state.complete:
        return _join_mid_run(state, worker_id, clock)
    clock = max(clock, state.resume_at)
    clocks[worker_id] = clock
    floor = min(state.table.floor, clock) if state.joined else clock
    table = ClockTable(tuple(sorted(clocks.items())), floor=floor)
    state = replace(state, table=table, joined=state.joined | {worker_id})
    if state.keeps_views and state.views.views:  # (a change came before every worker joined)
        state = replace(state, views=data_views.change(state.views, clocks, state.top))
    elif state.keeps_views and state.complete:
        state = replace(state, views=data_views.first_view(state.views, clocks, floor))
    return state, clock


def _check_not_ahead(state: ShardClocks, worker_id: int, clock: int) -> None:
    """A joiner may not name a clock more than :data:`JOIN_LEAD` past every live worker and
    every clock a departed worker left at (the data views' ``start`` on shard 0 is at most 2 past
    its table or a departed worker's clock, which lead the other shards' by at most one)."""
    others = [c for w, c in state.table.entries if w != worker_id]
    top = max(max(others, default=state.table.c_global), state.high)
    if clock > top + JOIN_LEAD:
        raise Refused(
            "bad_clock",
            f"worker {worker_id} names clock {clock}, more than {JOIN_LEAD} ahead of every live "
            f"worker (max {top})",
        )


def _check_resync(state: ShardClocks, worker_id: int, clock: int) -> None:
    """After a restart the shard's table may be older than the workers (pushes after its last
    snapshot), but by at most :data:`MAX_RESYNC_JUMP` clocks past its newest recorded clock."""
    top = max((c for _, c in state.table.entries), default=state.table.floor)
    if clock > top + MAX_RESYNC_JUMP:
        raise Refused(
            "bad_clock",
            f"worker {worker_id} resyncs at clock {clock}, more than {MAX_RESYNC_JUMP} past "
            f"the newest clock this shard recorded ({top})",
        )


def _join_mid_run(state: ShardClocks, worker_id: int, clock: int) -> tuple[ShardClocks, int]:
    """A worker beyond the first ``num_workers`` joins at ``max(clock, c_global)``; on shard 0
    (data views) at least at the first clock of the data view it is added to."""
    _check_not_ahead(state, worker_id, clock)
    at = max(clock, state.table.c_global)
    views = state.views
    if state.keeps_views:
        start = data_views.start_of_next(views, state.top)
        views = data_views.change(views, [*state.table.as_dict(), worker_id], state.top)
        at = max(at, start)
        views = data_views.drop(views, worker_id, start, at, "moved")
    clocks = state.table.as_dict()
    clocks[worker_id] = at
    table = ClockTable(tuple(sorted(clocks.items())), floor=state.table.floor)
    joined, fresh = state.joined | {worker_id}, state.fresh | {worker_id}
    return replace(state, table=table, joined=joined, fresh=fresh, views=views), at


def _move_fresh(state: ShardClocks, worker_id: int, clock: int) -> tuple[ShardClocks, int]:
    """A joiner that has not pushed yet names a higher clock (another shard gave it one): it
    moves there; its slices of the clocks it skips are dropped (shard 0)."""
    _check_not_ahead(state, worker_id, clock)
    old = state.table.clock_of(worker_id)
    clocks = state.table.as_dict()
    clocks[worker_id] = max(clock, state.table.without_worker(worker_id).c_global)  # (the others')
    table = ClockTable(tuple(sorted(clocks.items())), floor=state.table.floor)
    views = state.views
    if state.keeps_views:
        views = data_views.drop(views, worker_id, old, clocks[worker_id], "moved")
    return replace(state, table=table, views=views), clocks[worker_id]


def leave(
    state: ShardClocks, worker_id: WorkerId, *, why: str = "left", finished: bool = False
) -> ShardClocks:
    """Drop ``worker_id`` from the table for good (shard 0: the clocks from the next data view
    on are split among the others; its slices until then are dropped -- unless it ``finished``:
    it pushed every clock of the job, and later clocks are nobody's)."""
    try:
        at = state.table.clock_of(worker_id)
        table = state.table.without_worker(worker_id)
    except ClockError as exc:
        raise Refused("unknown_worker", str(exc).removeprefix(f"{exc.kind}: ")) from None
    out = replace(
        state,
        table=table,
        departed=state.departed | {worker_id},
        fresh=state.fresh - {worker_id},
        high=max(state.high, at),
    )
    if state.keeps_views and not finished:
        stop = data_views.start_of_next(out.views, out.top, after=at)
        views = data_views.drop(out.views, worker_id, at, stop, why)
        out = replace(out, views=data_views.change(views, table.as_dict(), out.top, after=at))
    return out


def evict(state: ShardClocks, worker_id: int) -> tuple[ShardClocks, bool]:
    """Remove a worker declared dead (see the module doc); ``(state, False)`` if there was
    nothing to remove (unknown, or already departed)."""
    if type(worker_id) is not int or not 0 <= worker_id <= MAX_WORKER_ID:
        raise Refused("bad_clock", f"worker id must be an int in [0, {MAX_WORKER_ID}], got {worker_id!r}")
    if worker_id in state.departed or worker_id not in state.table.as_dict():
        return state, False
    left = leave(state, worker_id, why="evicted")
    return replace(left, evicted=left.evicted | {worker_id}), True


def bar(state: ShardClocks, worker_id: int) -> tuple[ShardClocks, bool]:
    """Refuse ``worker_id``'s hello from now on if it has not said one (see the module doc);
    ``(state, False)`` for an id in the table (evict it) or departed already."""
    if type(worker_id) is not int or not 0 <= worker_id <= MAX_WORKER_ID:
        raise Refused("bad_clock", f"worker id must be an int in [0, {MAX_WORKER_ID}], got {worker_id!r}")
    if worker_id in state.departed or worker_id in state.table.as_dict():
        return state, False
    return replace(state, departed=state.departed | {worker_id}), True


def push(state: ShardClocks, worker_id: WorkerId, clock: int) -> ShardClocks | None:
    """The state after ``worker_id``'s push tagged ``clock``; ``None`` for a retry of the previous
    clock (acknowledge, do not apply)."""
    current = state.clock_of(worker_id)
    if type(clock) is int and clock == current - 1:
        return None
    try:
        table = state.table.advance(worker_id, clock)
    except (ClockError, TypeError) as exc:
        raise Refused("bad_clock", str(exc)) from None
    return replace(state, table=table, fresh=state.fresh - {worker_id})


def check_pull(state: ShardClocks, model: ConsistencyModel, worker_id: WorkerId, clock: object) -> bool:
    """Whether ``worker_id``'s pull for ``clock`` can be served now; ``Refused`` if invalid."""
    current = state.clock_of(worker_id)
    ahead = max_pull_ahead(model)
    if type(clock) is not int or not 0 <= clock <= current + ahead:
        raise Refused(
            "bad_clock",
            f"pull for clock {clock!r} by worker {worker_id}: must be in [0, {current + ahead}] "
            "(its pushes so far" + (", plus one: read-ahead)" if ahead else ")"),
        )
    if isinstance(model, ASP):
        return True
    return state.complete and may_serve_pull(model, state.table, worker_id, clock)


def blocked_reason(state: ShardClocks, model: ConsistencyModel, clock: int) -> str:
    """Why a pull for ``clock`` still waits: the ``c_global`` it needs and who is behind."""
    lag = allowed_lag(model) or 0
    slow = [w for w, c in state.table.entries if c < clock - lag]
    return (
        f"c_global={state.table.c_global} must reach {clock - lag}; workers behind: "
        f"{slow[:16]}; joined {len(state.joined)}/{state.num_workers}"
    )
