"""PS consistency models, the servers' clock table, and the pure pull gate (SPEC §1, §2).

Clocks, precisely:
- A worker's **clock** is the number of iterations (waves, under WSP) it has completed *and pushed*.
  Its k-th push (0-based) is **tagged with clock k**; after it the worker's clock is k + 1.
- A **pull for clock c** is the pull a worker issues before computing iteration c, i.e. right
  after its push tagged c - 1 (the first pull is for clock 0).
- ``c_global`` = min over workers of their clock = the number of iterations *every* worker has
  pushed; "every worker has pushed clock c - 1" is ``c_global >= c``.

Gates for a pull for clock c (``may_serve_pull``):
- ``BSP()``: ``c_global >= c`` (every worker pushed clocks 0 … c-1);
- ``ASP()``: always;
- ``SSP(s)``: ``c_global >= c - s`` (the slowest worker's clock >= c - s); ``BSP == SSP(0)``;
- ``WSP(s_local, D)``: ``c_global >= c - D`` where c is the VW's local clock (waves completed).
  Which minibatches wait for that pull is the virtual worker's business (see ``ps/wsp.py``).

Read-ahead: under ``SSP(s)`` with s >= 1 and under ``ASP()`` a worker at clock k may also pull
for clock k + 1 (:func:`max_pull_ahead`), e.g. while it computes iteration k, to overlap that
pull with its compute; the gate above is the same.  Under BSP (and WSP) a pull for k + 1 would
wait for the worker's own push of k, so it may only pull for clocks up to its own.

Guarantee: a pull served under BSP/SSP(s)/WSP(_, D) sees (server state = all pushes applied so far)
every worker's updates of clocks < c - s (s = 0 for BSP, D for WSP).

Invariants of :class:`ClockTable` (immutable; transitions return a new table):
- a worker's clock only grows, by exactly one per push (duplicates, regressions and jumps raise
  :class:`ClockError` with a ``kind``);
- ``c_global`` never decreases, across pushes and membership changes alike (a joining worker
  starts at a clock >= ``c_global``; removing the last worker keeps ``c_global``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.events import EventQueue

WorkerId = int
PendingPull = tuple[WorkerId, int]
"""A pull waiting at the server: ``(worker_id, clock)``."""


class ConsistencyConfigError(ConfigError, ValueError):
    """An invalid consistency model; the message names the field and the allowed values."""


class ClockError(FlotillaError, ValueError):
    """A push or membership change that breaks the clock protocol.

    ``kind`` is one of ``unknown_worker``, ``duplicate`` (the push of the previous clock again:
    a retry a server may acknowledge idempotently), ``regression``, ``jump``, ``bad_join``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def _check_count(owner: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConsistencyConfigError(f"{owner}.{field} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BSP:
    """Bulk synchronous: a pull for clock c waits until every worker pushed clock c - 1."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ASP:
    """Asynchronous: pulls never wait."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SSP:
    """Stale synchronous (Ho et al.): a pull for clock c waits until c_global >= c - staleness."""

    staleness: int

    def __post_init__(self) -> None:
        _check_count("SSP", "staleness", self.staleness)


@dataclass(frozen=True, kw_only=True, slots=True)
class WSP:
    """Wave synchronous (HetPipe): waves of ``s_local + 1`` minibatches, clock distance D."""

    s_local: int
    clock_distance: int

    def __post_init__(self) -> None:
        _check_count("WSP", "s_local", self.s_local)
        _check_count("WSP", "clock_distance", self.clock_distance)

    @property
    def wave_size(self) -> int:
        return self.s_local + 1


ConsistencyModel = BSP | ASP | SSP | WSP


def wave_size_of(model: ConsistencyModel) -> int:
    """Minibatches per clock: ``s_local + 1`` under WSP, else 1."""
    return model.wave_size if isinstance(model, WSP) else 1


def s_global(wsp: WSP) -> int:
    """HetPipe's global staleness bound ``(D + 1)(s_local + 1) + s_local - 1``."""
    return (wsp.clock_distance + 1) * (wsp.s_local + 1) + wsp.s_local - 1


def allowed_lag(model: ConsistencyModel) -> int | None:
    """How many clocks behind the pulling worker ``c_global`` may be; ``None`` = unbounded."""
    match model:
        case BSP():
            return 0
        case ASP():
            return None
        case SSP(staleness=s):
            return s
        case WSP(clock_distance=d):
            return d
    raise ConsistencyConfigError(f"model must be one of BSP, ASP, SSP, WSP, got {model!r}")


@dataclass(frozen=True, slots=True)
class ClockTable:
    """Per-worker pushed clocks kept by a server.  ``entries`` is sorted by worker id.

    Derived once per table and shared by the tables a push derives from it (a push changes no
    worker id): the ids' positions, the clocks alone and ``c_global``, so that a push costs a few
    tuple slices and ``clock_of`` a dict lookup (a simulated shard serves 1,024 workers)."""

    entries: tuple[tuple[WorkerId, int], ...] = ()
    floor: int = 0
    _index: dict[WorkerId, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _clocks: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _c_global: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [w for w, _ in self.entries]
        if ids != sorted(set(ids)):
            raise ClockError("bad_join", f"worker ids must be unique and sorted, got {ids}")
        if any(c < self.floor for _, c in self.entries):
            raise ClockError("bad_join", f"every clock must be >= floor {self.floor}")
        clocks = tuple(c for _, c in self.entries)
        object.__setattr__(self, "_index", {w: i for i, w in enumerate(ids)})
        object.__setattr__(self, "_clocks", clocks)
        object.__setattr__(self, "_c_global", min(clocks, default=self.floor))

    @classmethod
    def start(cls, worker_ids: Iterable[WorkerId], clock: int = 0) -> ClockTable:
        """A table where every worker in ``worker_ids`` is at ``clock``."""
        return cls(tuple((w, clock) for w in sorted(set(worker_ids))), floor=clock)

    @property
    def worker_ids(self) -> tuple[WorkerId, ...]:
        return tuple(w for w, _ in self.entries)

    @property
    def c_global(self) -> int:
        """min over workers of their clock (the floor kept when no worker is left)."""
        return self._c_global

    def as_dict(self) -> dict[WorkerId, int]:
        return dict(self.entries)

    def clock_of(self, worker_id: WorkerId) -> int:
        i = self._index.get(worker_id)
        if i is None:
            raise ClockError("unknown_worker", f"worker {worker_id!r} is not in the clock table")
        return self._clocks[i]

    def _replace(self, clocks: Mapping[WorkerId, int], floor: int) -> ClockTable:
        return ClockTable(tuple(sorted(clocks.items())), floor=floor)

    def advance(self, worker_id: WorkerId, clock: int) -> ClockTable:
        """Apply ``worker_id``'s push tagged ``clock``; it must equal the worker's current clock."""
        current = self.clock_of(worker_id)
        if clock != current:
            if clock == current - 1:
                kind, why = "duplicate", "was already pushed"
            elif clock < current:
                kind, why = "regression", f"is older than the expected clock {current}"
            else:
                kind, why = "jump", f"skips clocks {current}..{clock - 1}"
            raise ClockError(kind, f"push by worker {worker_id!r} tagged clock {clock} {why}")
        i = self._index[worker_id]
        out = object.__new__(ClockTable)  # (valid by construction: the checks are not repeated)
        clocks = self._clocks[:i] + (current + 1,) + self._clocks[i + 1 :]
        object.__setattr__(
            out, "entries", self.entries[:i] + ((worker_id, current + 1),) + self.entries[i + 1 :]
        )
        object.__setattr__(out, "floor", self.floor)
        object.__setattr__(out, "_index", self._index)  # (the same ids: shared, never mutated)
        object.__setattr__(out, "_clocks", clocks)
        object.__setattr__(out, "_c_global", min(clocks) if current == self._c_global else self._c_global)
        return out

    def with_worker(self, worker_id: WorkerId, clock: int | None = None) -> ClockTable:
        """Add a worker at ``clock`` (default ``c_global``); it must not lower ``c_global``."""
        clocks = self.as_dict()
        if worker_id in clocks:
            raise ClockError("bad_join", f"worker {worker_id!r} is already in the clock table")
        joined = self.c_global if clock is None else clock
        if joined < self.c_global:
            raise ClockError(
                "bad_join",
                f"worker {worker_id!r} may join at clock >= c_global {self.c_global}, got {joined}",
            )
        clocks[worker_id] = joined
        return self._replace(clocks, self.c_global)

    def without_worker(self, worker_id: WorkerId) -> ClockTable:
        """Remove a worker; its pending pulls are the caller's to drop.  May raise c_global."""
        self.clock_of(worker_id)
        clocks = self.as_dict()
        del clocks[worker_id]
        return self._replace(clocks, self.c_global)


def max_pull_ahead(model: ConsistencyModel) -> int:
    """How many clocks past its own clock a worker may pull for (see "Read-ahead")."""
    match model:
        case ASP():
            return 1
        case SSP(staleness=s) if s >= 1:
            return 1
    return 0


def may_serve_pull(model: ConsistencyModel, table: ClockTable, worker_id: WorkerId, clock: int) -> bool:
    """Whether ``worker_id``'s pull for ``clock`` can be answered now (see the module doc)."""
    table.clock_of(worker_id)  # unknown workers are a protocol error, not a "wait"
    if not isinstance(clock, int) or clock < 0:
        raise ClockError("regression", f"pull clock must be an int >= 0, got {clock!r}")
    lag = allowed_lag(model)
    return lag is None or table.c_global >= clock - lag


def wake_set(
    model: ConsistencyModel, table: ClockTable, pending: Iterable[PendingPull]
) -> tuple[PendingPull, ...]:
    """The pending pulls servable now (sorted), e.g. right after ``table.advance``."""
    return tuple(sorted(p for p in pending if may_serve_pull(model, table, p[0], p[1])))


def blocked_workers(
    model: ConsistencyModel, table: ClockTable, pending: Iterable[PendingPull]
) -> frozenset[WorkerId]:
    """Workers whose pending pull must keep waiting."""
    return frozenset(w for w, c in pending if not may_serve_pull(model, table, w, c))


def reference_may_serve_pull(
    model: ConsistencyModel,
    pushes: Collection[tuple[WorkerId, int]],
    worker_ids: Collection[WorkerId],
    clock: int,
) -> bool:
    """Naive oracle straight from the SPEC §1/§2 text, over the raw log of ``(worker, clock)``
    pushes applied so far.  Used by tests against :func:`may_serve_pull`."""
    match model:
        case ASP():
            return True
        case BSP():  # "waits until every worker has pushed clock c-1"
            return clock == 0 or all((w, clock - 1) in pushes for w in worker_ids)
        case SSP(staleness=s):  # "the slowest worker's clock >= c - s"; clock = pushes made
            counts = Counter(pw for pw, _ in pushes)
            return not worker_ids or min(counts[w] for w in worker_ids) >= clock - s
        case WSP(clock_distance=d):  # "every VW has pushed waves 0 … c-D-1"
            return all((w, k) in pushes for w in worker_ids for k in range(clock - d))
    raise ConsistencyConfigError(f"model must be one of BSP, ASP, SSP, WSP, got {model!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PullRecord:
    """One served pull in a :func:`simulate` trace.  ``seen`` = pushes applied when served;
    ``seen_at_issue`` = pushes applied when issued."""

    worker_id: WorkerId
    clock: int
    issued_tick: int
    served_tick: int
    seen: frozenset[tuple[WorkerId, int]]
    seen_at_issue: frozenset[tuple[WorkerId, int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimTrace:
    """Result of :func:`simulate`; ``finished`` is False on deadlock."""

    pulls: tuple[PullRecord, ...]
    finished: bool
    final_table: ClockTable
    num_ticks: int


def simulate(model: ConsistencyModel, speeds: Sequence[int], num_clocks: int, rng_seed: int = 0) -> SimTrace:
    """Event-driven model of ``len(speeds)`` workers doing ``num_clocks`` iterations each.

    Worker w pulls for clock c (blocking until the gate allows), computes for a random time in
    ``[speeds[w], 2 * speeds[w]]`` ticks, pushes clock c, then pulls for c + 1.  Events of the
    same tick are applied in a seeded random order, each followed by serving every servable pull,
    so different seeds give different interleavings.  Deterministic for a given seed.
    """
    if any(not isinstance(s, int) or s < 1 for s in speeds) or num_clocks < 0:
        raise ConsistencyConfigError("speeds must be ints >= 1 and num_clocks an int >= 0")
    rng = random.Random(rng_seed)
    table = ClockTable.start(range(len(speeds)))
    applied: set[tuple[WorkerId, int]] = set()
    pending: dict[WorkerId, tuple[int, int, frozenset[tuple[WorkerId, int]]]] = {}
    busy: EventQueue[tuple[WorkerId, int]] = EventQueue()  # (worker, clock) done at a tick
    pulls: list[PullRecord] = []

    def serve(now: int) -> None:
        for w, c in wake_set(model, table, ((w, p[0]) for w, p in pending.items())):
            _, issued, at_issue = pending.pop(w)
            pulls.append(
                PullRecord(
                    worker_id=w,
                    clock=c,
                    issued_tick=issued,
                    served_tick=now,
                    seen=frozenset(applied),
                    seen_at_issue=at_issue,
                )
            )
            done = now + rng.randint(speeds[w], 2 * speeds[w])
            busy.push(done, (w, c), tie=rng.random())  # seeded order of simultaneous events

    now = 0
    if num_clocks > 0:
        pending = {w: (0, 0, frozenset()) for w in range(len(speeds))}
        serve(now)
    for event in busy.drain():
        now, (w, c) = int(event.time), event.payload
        table = table.advance(w, c)
        applied.add((w, c))
        if c + 1 < num_clocks:
            pending[w] = (c + 1, now, frozenset(applied))
        serve(now)
    return SimTrace(pulls=tuple(pulls), finished=not pending, final_table=table, num_ticks=now)
