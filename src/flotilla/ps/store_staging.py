"""Two-phase pushes on one shard (issue 19: a clock is applied on every shard or on none): staged
updates, commits, fences and the eviction's resolution.  The rules are the pure
``ps/two_phase.py`` (its module doc holds the protocol and why it is safe); this mixin of
:class:`flotilla.ps.store.ShardStore` executes them.  No I/O, threads or wall clock.

Invariants:
- A staged update is validated completely (like a push) before it is kept; it is not applied,
  not visible to reads and not counted by the gate; at most one clock per worker (its committed
  clock), possibly in parts (``stage_part``: a virtual worker's stages, ``two_phase.stage_part``;
  a plain ``stage`` is part 0 of 1).  A part may hold no chunk of this shard.
- A commit (or the last part's vote, ``vote``) applies the staged update -- the union of its
  parts, once every part is staged --
  exactly as one push of that clock (``ShardStore._apply_push``); an incomplete clock is
  ``not_staged``, and a resolution discards it.
- A fenced worker's stages, commits and pushes are refused (``unknown_worker``); ``resolve``
  commits or discards its staged clock per :func:`~flotilla.ps.two_phase.resolve_verdict`, then
  evicts it.  Leaving or being evicted drops a staged update.
- Staged updates are volatile (not in snapshots): a restarted shard answers ``not_staged`` and the
  worker stages again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.core.errors import RemoteError
from flotilla.ps import two_phase
from flotilla.ps.clock_rules import Refused, ShardClocks

__all__ = ["PushResult", "Resolution", "StagedPushes"]


@dataclass(frozen=True, slots=True)
class PushResult:
    applied: bool  # False: a retry of the previous clock, acknowledged only
    version: int  # shard version after the push
    clock: int  # the worker's clock after the push


@dataclass(frozen=True, slots=True)
class Resolution:
    """What ``resolve`` did with one fenced worker."""

    worker_id: int
    outcome: str  # "committed" (its staged clock), "discarded", "none" (nothing staged), "absent"
    clock: int  # its committed clock on this shard afterwards (-1: absent)


@dataclass(frozen=True, slots=True)
class _Staged:
    """A worker's staged clock: its parts (pure, ``two_phase.Parts``, chunks named by slot) and
    each part's slots and tensors."""

    parts: two_phase.Parts
    held: dict[int, tuple[list[int], list[torch.Tensor]]]

    def union(self) -> tuple[list[int], list[torch.Tensor]]:
        """Every part's slots and tensors, in part order (disjoint: ``two_phase.stage_part``)."""
        slots = [x for p in sorted(self.held) for x in self.held[p][0]]
        return slots, [t for p in sorted(self.held) for t in self.held[p][1]]


def _remote(exc: Refused) -> RemoteError:
    return RemoteError(exc.code, exc.message)


class StagedPushes:
    """Staged updates of a shard (module doc).  The host provides ``clocks``, ``clock_of``,
    ``_validate_push``, ``_apply_push``, ``_require_layout`` and ``evict``."""

    clocks: ShardClocks
    version: int
    clock_of: Any
    _validate_push: Any
    _apply_push: Any
    _require_layout: Any
    evict: Any

    def _init_staging(self) -> None:
        self.staged: dict[int, _Staged] = {}
        self.fenced: set[int] = set()
        self.removed_at: dict[int, int] = {}  # departed workers: their committed clock then

    def staged_clock(self, worker_id: int) -> int:
        """The worker's staged clock once all its parts are staged here, else ``NONE``."""
        entry = self.staged.get(worker_id)
        return two_phase.NONE if entry is None else entry.parts.staged

    def stage(
        self,
        worker_id: int,
        clock: int,
        base_version: int,
        chunk_ids: object,
        tensors: Sequence[torch.Tensor],
    ) -> tuple[bool, int]:
        """Keep ``worker_id``'s update of ``clock`` aside; ``(staged, recorded clock)``, ``staged``
        False for a retry of a clock already committed here."""
        slots = self._validate_push(worker_id, base_version, chunk_ids, tensors)  # (not empty)
        staged, recorded, _ = self._stage_slots(worker_id, clock, slots, tensors, 0, 1)
        return staged, recorded

    def stage_part(
        self,
        worker_id: int,
        clock: int,
        base_version: int,
        chunk_ids: object,
        tensors: Sequence[torch.Tensor],
        part: int,
        parts: int,
    ) -> tuple[bool, int, bool]:
        """Keep ``part`` (of ``parts``) of ``worker_id``'s update of ``clock`` aside (it may hold
        no chunk of this shard); ``(staged, recorded clock, complete)``, ``staged`` False for a
        retry of a clock already committed here, ``complete``: every part is staged here."""
        if isinstance(chunk_ids, list) and not chunk_ids:  # a part with no chunk on this shard
            self._check_empty_part(worker_id, base_version, tensors)
            slots: list[int] = []
        else:
            slots = self._validate_push(worker_id, base_version, chunk_ids, tensors)
        return self._stage_slots(worker_id, clock, slots, tensors, part, parts)

    def _stage_slots(
        self,
        worker_id: int,
        clock: int,
        slots: list[int],
        tensors: Sequence[torch.Tensor],
        part: int,
        parts: int,
    ) -> tuple[bool, int, bool]:
        """(Validated but for the clock and the parts.)"""
        recorded, entry, (verdict, parts_now) = self._on_parts(
            two_phase.stage_part, worker_id, clock, part, parts, slots
        )
        if verdict == "done" or parts_now is None:
            return False, recorded, True
        held = dict(entry.held) if entry is not None and entry.parts.clock == clock else {}
        held[part] = (slots, list(tensors))
        self.staged[worker_id] = _Staged(parts_now, held)
        return True, recorded, parts_now.complete

    def _on_parts(self, rule: Any, worker_id: int, *args: Any) -> tuple[int, _Staged | None, Any]:
        """``rule(worker_id, recorded, held parts or None, *args, fenced=)`` (a pure rule of
        ``two_phase``) on the worker's state here: its recorded clock, its staged entry, the
        rule's answer; a refusal is a ``RemoteError``."""
        recorded = self.clock_of(worker_id)
        entry = self.staged.get(worker_id)
        held = None if entry is None else entry.parts
        try:
            return recorded, entry, rule(worker_id, recorded, held, *args, fenced=worker_id in self.fenced)
        except Refused as exc:
            raise _remote(exc) from None

    def _check_empty_part(
        self, worker_id: int, base_version: object, tensors: Sequence[torch.Tensor]
    ) -> None:
        """``_validate_push`` for a part holding no chunk of this shard."""
        self._require_layout()
        self.clock_of(worker_id)
        if tensors:
            raise RemoteError("bad_value", f"{len(tensors)} tensors for 0 chunk ids")
        if type(base_version) is not int or not 0 <= base_version <= self.version:
            raise RemoteError(
                "bad_version",
                f"base_version {base_version!r} must be in [0, {self.version}] (the shard's current version)",
            )

    def commit(self, worker_id: int, clock: int) -> PushResult:
        """Apply ``worker_id``'s staged ``clock`` (a retry of a committed clock: acknowledged)."""
        recorded = self.clock_of(worker_id)
        try:
            verdict = two_phase.commit_verdict(
                worker_id, recorded, self.staged_clock(worker_id), clock, fenced=worker_id in self.fenced
            )
        except Refused as exc:
            raise _remote(exc) from None
        if verdict == "done":
            return PushResult(applied=False, version=self.version, clock=recorded)
        slots, tensors = self.staged.pop(worker_id).union()
        result: PushResult = self._apply_push(worker_id, clock, slots, tensors)
        return result

    def vote(self, worker_id: int, clock: int, part: int, parts: int) -> PushResult | None:
        """Record ``part``'s vote to commit ``worker_id``'s staged ``clock``
        (``two_phase.vote_verdict``); the last vote applies the clock (its result returned), an
        earlier one returns None, a vote for a committed clock is acknowledged (``applied`` False)."""
        recorded, entry, (verdict, parts_now) = self._on_parts(
            two_phase.vote_verdict, worker_id, clock, part, parts
        )
        if verdict == "done":
            return PushResult(applied=False, version=self.version, clock=recorded)
        assert entry is not None and parts_now is not None  # (vote_verdict refuses otherwise)
        if verdict == "wait":
            self.staged[worker_id] = _Staged(parts_now, entry.held)
            return None
        slots, tensors = self.staged.pop(worker_id).union()
        result: PushResult = self._apply_push(worker_id, clock, slots, tensors)
        return result

    def fence(self, worker_id: int) -> tuple[int, int] | None:
        """Refuse ``worker_id``'s stages and commits from now on; its ``(committed clock, staged
        clock or NONE)`` here (a departed worker: the clock it left at, as known since this
        shard started), or None if unknown."""
        clock = self.clocks.table.as_dict().get(worker_id)
        if clock is None:
            gone = self.removed_at.get(worker_id)
            return None if gone is None else (gone, two_phase.NONE)
        self.fenced.add(worker_id)
        return clock, self.staged_clock(worker_id)

    def resolve(self, worker_id: int, target: int) -> Resolution:
        """Commit or discard a fenced worker's staged clock up to ``target``, then evict it.
        ``RemoteError("half_applied")`` (changing nothing) if this shard cannot reach ``target``."""
        recorded = self.clocks.table.as_dict().get(worker_id)
        if recorded is None:
            return Resolution(worker_id, "absent", -1)
        staged = self.staged_clock(worker_id)
        try:
            verdict = two_phase.resolve_verdict(recorded, staged, target)
        except Refused as exc:
            raise _remote(exc) from None
        self.fenced.add(worker_id)
        outcome = "none" if worker_id not in self.staged else "discarded"  # (incomplete parts too)
        if verdict == "commit":
            slots, tensors = self.staged.pop(worker_id).union()
            self._apply_push(worker_id, staged, slots, tensors)
            outcome, recorded = "committed", staged + 1
        self.evict(worker_id)
        return Resolution(worker_id, outcome, recorded)

    def departing(self, worker_id: int, clock: int | None) -> None:
        """A worker left or was evicted at ``clock``: its staged update goes (never applied)."""
        self.staged.pop(worker_id, None)
        if clock is not None:
            self.removed_at[worker_id] = clock
