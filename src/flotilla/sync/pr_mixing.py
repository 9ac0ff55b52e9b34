"""Partial reduce's mixing rounds (pure): who knows whose round-start model, when a round ends,
and which ready workers would bridge knowledge -- the "No update isolation" rule of
``sync/pr_plan.py`` (its module doc states the rule and its bound; this module keeps the state).

:class:`MixingRounds` shares the controller's live set (the controller tells it of every change:
:meth:`MixingRounds.added`, :meth:`MixingRounds.removed`).  Its queries run on every poll of the
controller, on clusters of thousands of simulated workers, so they are incremental:

- ``knows[i]`` is a frozenset; a committed group gives its members one shared union object;
- :meth:`bridging` memoises each knowledge set's live part by the set's identity (holding the set,
  so that its id is not reused) and interns the parts, so that equal parts compare by identity;
  the memo is dropped when the live set changes;
- :meth:`end_round_if_mixed` keeps the live workers known to know every live worker (``_full``);
  a commit adds its members when their union covers the live set; a change of the live set marks
  it stale, and the next check finds the missing ones, stopping at the first that is not.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MixingRounds"]


class MixingRounds:
    def __init__(self, live: set[int]) -> None:
        self.live = live  # (the controller's set, shared)
        self.knows: dict[int, frozenset[int]] = {w: frozenset((w,)) for w in live}
        self.round_groups = 0  # committed groups in the current round
        self.rounds_completed = 0
        self._version = 0  # (bumped whenever ``live`` changes)
        self._frozen: tuple[int, frozenset[int]] = (-1, frozenset())  # (version, live as a frozenset)
        self._memo_version = -1
        self._memo: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._canon: dict[frozenset[int], frozenset[int]] = {}
        self._full: set[int] = set()
        self._stale = True

    def added(self, worker_id: int) -> None:
        """``worker_id`` was added to the live set: it knows itself only."""
        self._version += 1
        self.knows[worker_id] = frozenset((worker_id,))
        self._full.clear()  # (who knows it: found again by the next check)
        self._stale = True

    def removed(self, worker_id: int) -> None:
        """``worker_id`` left the live set."""
        self._version += 1
        self.knows.pop(worker_id, None)
        self._full.discard(worker_id)
        self._stale = True  # (one that missed only this worker now knows every live one)

    def merged(self, members: Iterable[int]) -> None:
        """A group of these live ``members`` committed: each knows the union of their sets."""
        live_members = list(members)
        union = frozenset().union(*(self.knows[w] for w in live_members)) if live_members else frozenset()
        full = union >= self._live_frozen()
        for w in live_members:
            self.knows[w] = union
            if full:
                self._full.add(w)
        self.round_groups += 1

    def end_round_if_mixed(self) -> None:
        """End the round when every live worker knows every live worker (sets reset)."""
        if self.live and self._all_full():
            self.rounds_completed += 1
            self.round_groups = 0
            self.knows = {w: frozenset((w,)) for w in self.live}
            self._full, self._stale = set(), True

    def bridging(self, order: list[int], size: int) -> list[int] | None:
        """``size`` ready workers, ``order``'s first and then (oldest first) those whose knowledge
        of the live workers differs from its, filled with the others; None when all know the same."""
        if self._memo_version != self._version or len(self._memo) > 4 * len(self.live) + 64:
            self._memo_version, self._memo, self._canon = self._version, {}, {}
        live = self._live_frozen()
        memo, canon = self._memo, self._canon

        def known(w: int) -> frozenset[int]:
            k = self.knows[w]
            got = memo.get(id(k))
            if got is None:
                part = k & live
                got = memo[id(k)] = (k, canon.setdefault(part, part))
            return got[1]

        ref = known(order[0])
        differ: list[int] = []
        same: list[int] = []
        for w in order[1:]:
            (same if known(w) is ref else differ).append(w)
            if len(differ) == size - 1:
                break
        if not differ:
            return None
        return [order[0], *(differ + same)[: size - 1]]

    def _live_frozen(self) -> frozenset[int]:
        if self._frozen[0] != self._version:
            self._frozen = (self._version, frozenset(self.live))
        return self._frozen[1]

    def _all_full(self) -> bool:
        if len(self._full) == len(self.live):
            return True
        if not self._stale:
            return False
        live = self._live_frozen()
        for w in self.live:
            if w not in self._full:
                if not self.knows[w] >= live:
                    return False
                self._full.add(w)
        self._stale = False
        return True
