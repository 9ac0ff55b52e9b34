"""Which workers split each clock's data (issue 19, item 3), pure: no torch, no I/O, no wall clock.

The job's data order is fixed (``data/sampler.py``): clock ``c`` consumes its global batch(es),
split into contiguous parts among the ranks of a view.  Under the PS nobody meets in a barrier,
so the split of a clock must be decided before any worker starts computing it, or two workers on
either side of a membership change use overlapping slices (a sample used twice) or leave a gap.

**Data views.**  Shard 0 keeps the job's table of data views: ``(start, members)`` entries with
increasing ``start``; clock ``c`` is split among the members (sorted worker ids, rank = index) of
the last entry with ``start <= c``.  Clocks before the first entry use the job's first
membership view (the coordinator's, the same sorted ids: every initial worker starts in it).
When membership changes (a join mid-run, a leave, an eviction) shard 0 appends an entry::

    start = max(top + 2, last start)       top: the highest clock in its (live) clock table

and, if ``start`` equals the last entry's start, replaces that entry instead.  A change for a
worker that departs at clock ``t`` (its clocks before ``t`` applied) starts at ``t`` at least:
it may be ahead of every live worker, and its applied pushes used the view it was in.

**Why nobody computes a clock under two views.**  A worker computing clock ``j`` has committed
clock ``j - 2`` on every shard and received that reply (every push mode of ``sync/via_ps.py``
waits for the acknowledgement of clock ``c - 1`` before it sends ``c``), so ``j <= recorded + 1 <=
top + 1 < start``: when an entry is made, no live worker has started its clock, and a departing
worker's applied clocks are all below it.  Its first clock
``start`` is computed only after a reply to a push or commit of clock ``start - 2`` or later,
which shard 0 can only have received after the entry was made (nobody had pushed ``start - 2``
then, since ``top = start - 2`` at most), and every reply of shard 0 to a worker carries the
entries from that worker's clock on.  A replaced entry (same ``start``) was thus never used.  A
worker always splits with the newest table it holds (``rev`` only grows).

**Dropped data.**  A worker that leaves or is removed at clock ``t`` (its next clock: ``0..t-1``
were applied everywhere, ``ps/two_phase.py``) was a member of the views of clocks ``t .. start-1``
too; its slices of those clocks are not used by any push and are recorded in ``dropped`` (so are
a fresh joiner's slices between the clock it was given and a higher one it then names).  So every
sample of every clock is used by exactly one applied push or listed in ``dropped``.

Invariants (property-tested in ``tests/unit/test_ps_data_views.py``): ``start`` strictly increases
along the table; members are sorted and unique; ``rev`` increases at every change; a change never
alters an entry whose ``start`` is at most ``top + 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "MAX_DROPPED",
    "DataView",
    "DataViews",
    "Dropped",
    "absorb",
    "change",
    "covering",
    "drop",
    "first_view",
    "from_wire",
    "split_of",
    "start_of_next",
]

MAX_DROPPED = 100_000  # dropped ranges kept (then only counted): one per leave/eviction


@dataclass(frozen=True, slots=True)
class DataView:
    start: int  # the first clock split among ``members``
    members: tuple[int, ...]  # sorted worker ids; a worker's rank is its index


@dataclass(frozen=True, slots=True)
class Dropped:
    """Worker ``worker_id``'s slices of clocks ``[first, stop)`` are used by no push."""

    worker_id: int
    first: int
    stop: int
    why: str  # "left", "evicted" or "moved" (a joiner moved to a later clock)


@dataclass(frozen=True, slots=True)
class DataViews:
    views: tuple[DataView, ...] = ()
    dropped: tuple[Dropped, ...] = ()
    rev: int = 0  # changes made so far
    dropped_overflow: int = 0  # ranges not kept beyond MAX_DROPPED

    def at(self, clock: int) -> DataView | None:
        """The entry that splits ``clock`` (None: before the first entry)."""
        return covering(self.views, clock)

    def since(self, clock: int) -> tuple[DataView, ...]:
        """The entries a worker at ``clock`` may still use: the one covering it and later ones."""
        first = 0
        for i, v in enumerate(self.views):
            if v.start <= clock:
                first = i
        return self.views[first:]

    def to_wire(self, clock: int | None = None) -> dict[str, Any]:
        views = self.views if clock is None else self.since(clock)
        return {"rev": self.rev, "views": [[v.start, list(v.members)] for v in views]}


def change(views: DataViews, members: Iterable[int], top: int, *, after: int = 0) -> DataViews:
    """The table after a membership change: from :func:`start_of_next` the clocks are split
    among ``members`` (module doc).  ``top``: the highest clock in the live clock table;
    ``after``: the clock a departing worker leaves at (its pushes before it were applied)."""
    ids = tuple(sorted(set(members)))
    start = max(top + 2, after)
    kept = views.views
    if kept and kept[-1].start >= start:
        start, kept = kept[-1].start, kept[:-1]  # not used by anybody yet: replace it
    if kept and kept[-1].members == ids:
        new = kept  # (the replaced entry is undone: the previous one goes on)
    else:
        new = (*kept, DataView(start, ids))
    return replace(views, views=new, rev=views.rev + 1)


def start_of_next(views: DataViews, top: int, *, after: int = 0) -> int:
    """The ``start`` a change made now gets (module doc)."""
    last = views.views[-1].start if views.views else 0
    return max(top + 2, last, after)


def first_view(views: DataViews, members: Iterable[int], floor: int) -> DataViews:
    """The entry of the job's first clocks, made when every expected worker has said hello: from
    ``floor`` (the table's lowest clock) the clocks are split among ``members``.  No-op if the
    table has entries already (a change came first)."""
    if views.views:
        return views
    return replace(views, views=(DataView(floor, tuple(sorted(set(members)))),), rev=views.rev + 1)


def drop(views: DataViews, worker_id: int, first: int, stop: int, why: str) -> DataViews:
    """Record that ``worker_id``'s slices of clocks ``[first, stop)`` are used by no push, for the
    clocks whose view holds it (before the first entry: the job's first view, which holds every
    worker that can be in the table then)."""
    out = list(views.dropped)
    overflow = views.dropped_overflow
    a = first
    while a < stop:
        view = views.at(a)
        nxt = min((v.start for v in views.views if v.start > a), default=stop)
        b = min(nxt, stop)
        if view is None or worker_id in view.members:
            if out and out[-1].worker_id == worker_id and out[-1].stop == a and out[-1].why == why:
                out[-1] = Dropped(worker_id, out[-1].first, b, why)
            elif len(out) < MAX_DROPPED:
                out.append(Dropped(worker_id, a, b, why))
            else:
                overflow += 1
        a = b
    return replace(views, dropped=tuple(out), dropped_overflow=overflow)


def covering(views: Sequence[DataView], clock: int) -> DataView | None:
    """The entry of ``views`` (sorted by start) that splits ``clock`` (None: before the first)."""
    found = None
    for v in views:
        if v.start > clock:
            break
        found = v
    return found


def split_of(views: Sequence[DataView], clock: int, worker_id: int) -> tuple[int, int, int] | None:
    """``(rank, world_size, start)`` of ``worker_id`` in the entry of ``views`` covering ``clock``;
    ``None`` if no entry covers it.  ``(-1, world, start)`` if the worker is not a member."""
    found = covering(views, clock)
    if found is None:
        return None
    rank = found.members.index(worker_id) if worker_id in found.members else -1
    return rank, len(found.members), found.start


def absorb(
    held: tuple[int, tuple[DataView, ...]], received: tuple[int, tuple[DataView, ...]]
) -> tuple[int, tuple[DataView, ...]]:
    """A worker's table after a reply carrying ``received = (rev, entries from some clock on)``:
    the newer ``rev`` wins; the received entries replace those from their first ``start`` on."""
    rev, entries = received
    if rev <= held[0]:
        return held
    if not entries:
        return rev, held[1]
    first = entries[0].start
    return rev, (*(v for v in held[1] if v.start < first), *entries)


def from_wire(
    body: object, *, max_entries: int = 4096, max_members: int = 1 << 16
) -> tuple[int, tuple[DataView, ...]]:
    """Parse ``{"rev": int, "views": [[start, [ids...]], ...]}``; ``ValueError`` if malformed."""
    if (
        not isinstance(body, dict)
        or type(body.get("rev")) is not int
        or not isinstance(body.get("views"), list)
    ):
        raise ValueError("data_views must be {rev: int, views: list}")
    raw = body["views"]
    if len(raw) > max_entries:
        raise ValueError(f"data_views holds more than {max_entries} entries")
    out: list[DataView] = []
    for item in raw:
        if not (
            isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], list)
        ):
            raise ValueError(f"a data view must be [start, [worker ids]], got {item!r}")
        start, members = item
        if len(members) > max_members or any(type(m) is not int or m < 0 for m in members):
            raise ValueError("data view members must be worker ids (ints >= 0)")
        ids = tuple(members)
        if ids != tuple(sorted(set(ids))) or start < 0 or (out and start <= out[-1].start):
            raise ValueError("data views must have increasing starts and sorted, unique members")
        out.append(DataView(start, ids))
    if body["rev"] < 0:
        raise ValueError("data_views rev must be >= 0")
    return body["rev"], tuple(out)
