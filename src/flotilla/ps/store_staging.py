"""Two-phase pushes on one shard (issue 19: a clock is applied on every shard or on none): staged
updates, commits, fences and the eviction's resolution.  The rules are the pure
``ps/two_phase.py`` (its module doc holds the protocol and why it is safe); this mixin of
:class:`flotilla.ps.store.ShardStore` executes them.  No I/O, threads or wall clock.

Invariants:
- A staged update is validated completely (like a push) before it is kept; it is not applied,
  not visible to reads and not counted by the gate; at most one per worker (its committed clock).
- A commit applies the staged update exactly as a push of that clock (``ShardStore._apply_push``).
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


@dataclass(slots=True)
class _Staged:
    clock: int
    slots: list[int]
    tensors: list[torch.Tensor]


def _remote(exc: Refused) -> RemoteError:
    return RemoteError(exc.code, exc.message)


class StagedPushes:
    """Staged updates of a shard (module doc).  The host provides ``clocks``, ``clock_of``,
    ``_validate_push``, ``_apply_push`` and ``evict``."""

    clocks: ShardClocks
    version: int
    clock_of: Any
    _validate_push: Any
    _apply_push: Any
    evict: Any

    def _init_staging(self) -> None:
        self.staged: dict[int, _Staged] = {}
        self.fenced: set[int] = set()
        self.removed_at: dict[int, int] = {}  # departed workers: their committed clock then

    def staged_clock(self, worker_id: int) -> int:
        entry = self.staged.get(worker_id)
        return two_phase.NONE if entry is None else entry.clock

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
        slots = self._validate_push(worker_id, base_version, chunk_ids, tensors)
        recorded = self.clock_of(worker_id)
        try:
            verdict = two_phase.stage_verdict(
                worker_id, recorded, self.staged_clock(worker_id), clock, fenced=worker_id in self.fenced
            )
        except Refused as exc:
            raise _remote(exc) from None
        if verdict == "done":
            return False, recorded
        self.staged[worker_id] = _Staged(clock, slots, list(tensors))
        return True, recorded

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
        entry = self.staged.pop(worker_id)
        result: PushResult = self._apply_push(worker_id, clock, entry.slots, entry.tensors)
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
        outcome = "none" if staged == two_phase.NONE else "discarded"
        if verdict == "commit":
            entry = self.staged.pop(worker_id)
            self._apply_push(worker_id, entry.clock, entry.slots, entry.tensors)
            outcome, recorded = "committed", entry.clock + 1
        self.evict(worker_id)
        return Resolution(worker_id, outcome, recorded)

    def departing(self, worker_id: int, clock: int | None) -> None:
        """A worker left or was evicted at ``clock``: its staged update goes (never applied)."""
        self.staged.pop(worker_id, None)
        if clock is not None:
            self.removed_at[worker_id] = clock
