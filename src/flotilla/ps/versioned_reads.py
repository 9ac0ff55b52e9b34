"""Versioned reads and ordered clocks of one parameter-server shard under a lag-0 consistency
model (BSP, SSP(0), WSP with D = 0; SPEC §1): a mixin of :class:`flotilla.ps.store.ShardStore`.
No I/O, threads or wall clock.

Under BSP a worker's pull for clock c waits until every worker pushed clock c - 1 (the gate,
``ps/consistency.py``), but a shard applies each push when it arrives: a worker whose pull was
served at once can push clock c before a slower worker's pull for c is answered, and that pull
would then read weights holding part of clock c.  So the trajectory depended on timing (issue 37:
the same BSP job ended at test accuracy 1.000 on a quiet machine and 0.96-0.99 beside two busy
processes), and a shard summed a clock's pushes in arrival order.

Invariants (lag-0 models; others are unchanged: a read serves every push applied so far):
- **Versioned reads**: :meth:`VersionedReads.read` serves the state of the last *fold* (the
  moment ``c_global`` last advanced): exactly the weights after every clock below ``c_global``,
  whatever pushes of later clocks arrived since.  The state is captured by reference (published
  tensors are immutable, ``ps/shard_sgd.py``), so this costs no copy.
- **Ordered clocks**: pushes are applied when they arrive (so a snapshot is always consistent with
  the clock table) and logged; when a fold is due and they did not arrive in ``(clock,
  worker_id)`` order, the shard returns to the state of the last fold and applies them again in
  that order before folding.  Equal jobs therefore give equal bits on any machine under any load.
- The log holds references to at most one clock's pushes per live worker (plus the clocks a
  jump of ``c_global`` folds at once).  Snapshots carry the fold state and the log
  (:meth:`VersionedReads.fold_snapshot`), so a restored shard -- a restart, a refilled backup --
  serves and orders exactly as the one that wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.config import ShardConfig
from flotilla.ps.consistency import allowed_lag

__all__ = ["FOLD_KINDS", "LOG_KIND", "VersionedReads", "check_fold_state"]

LOG_KIND = "g"  # snapshot tensors "g<k>.<slot>": the k-th logged push's chunk in that slot
FOLD_KINDS = ("fw", "fp")  # snapshot tensors: the fold's weights and pending sums, where they differ


@dataclass(frozen=True, slots=True)
class _Served:
    """What a lag-0 read serves: the state at the last fold."""

    weights: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    version: int
    c_global: int


@dataclass(frozen=True, slots=True)
class _Logged:
    clock: int
    worker_id: int
    slots: tuple[int, ...]
    grads: tuple[torch.Tensor, ...]


class VersionedReads:
    """Versioned reads and ordered clocks (module doc).  The host class provides the state
    (``weights``, ``pending``, ``applied``, ``versions``, ``version``, ``clocks``) and the
    update rule's ``_apply``, ``_fold_due`` and ``_fold``."""

    config: ShardConfig
    clocks: ShardClocks
    weights: list[torch.Tensor]
    pending: list[torch.Tensor | None]
    applied: list[int]
    versions: list[int]
    version: int
    _apply: Callable[[int, torch.Tensor, int], None]  # the update rule's (ps/shard_sgd.py)
    _fold_due: Callable[[], bool]
    _fold: Callable[[], None]

    def _init_versioned(self) -> None:
        self.versioned = allowed_lag(self.config.consistency) == 0
        self._served: _Served | None = None
        self._start: tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]] | None = None
        self._log: list[_Logged] = []
        self._in_order = True
        self.reordered_clocks = 0  # folds that re-applied their pushes in order (monitoring)

    def mark_fold_state(self) -> None:
        """The current state is a fold's (seeded, folded or restored): serve it, order from it."""
        if not self.versioned:
            return
        self._served = _Served(
            tuple(self.weights), tuple(self.versions), self.version, self.clocks.table.c_global
        )
        self._start = (list(self.weights), list(self.pending), list(self.applied))
        self._log, self._in_order = [], True

    def _log_push(
        self, worker_id: int, clock: int, slots: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> None:
        """Record an applied push for the ordered replay (lag-0 models only)."""
        if self._start is None:
            return
        entry = _Logged(clock, worker_id, tuple(slots), tuple(g.reshape(-1) for g in grads))
        if self._log and (clock, worker_id) < (self._log[-1].clock, self._log[-1].worker_id):
            self._in_order = False
        self._log.append(entry)

    def _maybe_fold(self) -> None:
        """Fold the finished global clock(s) if due, applying their pushes in order first."""
        if not self._fold_due():
            return
        if self._start is not None and not self._in_order:
            weights, pending, applied = self._start
            self.weights, self.pending, self.applied = list(weights), list(pending), list(applied)
            for e in sorted(self._log, key=lambda e: (e.clock, e.worker_id)):
                for slot, g in zip(e.slots, e.grads):
                    self._apply(slot, g, e.clock)
            self.reordered_clocks += 1
        self._fold()
        self.mark_fold_state()

    def served_state(self) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], int, int] | None:
        """``(weights, versions, version, c_global)`` a lag-0 read serves; None: the current
        state (other models, or not seeded yet)."""
        s = self._served
        return None if s is None else (s.weights, s.versions, s.version, s.c_global)

    # ------------------------------------------------------------------ snapshots
    def fold_snapshot(self) -> tuple[dict[str, Any], list[tuple[int, str, torch.Tensor]]]:
        """The manifest entry ``fold_state`` and the tensors (slot, kind) a snapshot needs to
        restore the fold state and the log (none for other models)."""
        if self._start is None or self._served is None:
            return {}, []
        weights, pending, applied = self._start
        s = self._served
        meta = {
            "applied": list(applied),
            "versions": list(s.versions),
            "version": s.version,
            "c_global": s.c_global,
            "log": [[e.clock, e.worker_id, list(e.slots)] for e in self._log],
            "no_pending": [i for i, p in enumerate(pending) if p is None],
        }
        tensors = [(i, "fw", w) for i, w in enumerate(weights) if w is not self.weights[i]]
        tensors += [(i, "fp", p) for i, p in enumerate(pending) if p is not None and p is not self.pending[i]]
        for k, e in enumerate(self._log):
            tensors += [(slot, f"{LOG_KIND}{k}", g) for slot, g in zip(e.slots, e.grads)]
        return {"fold_state": meta}, tensors

    def restore_fold_state(self, meta: object, tensors: dict[tuple[int, str], torch.Tensor]) -> None:
        """After a snapshot's state was restored: its fold state and log (``fold_snapshot``),
        or, without one, the restored state as the fold's.  ``ValueError`` if malformed (the
        caller validates before changing anything: call :func:`check_fold_state` first)."""
        if not self.versioned or meta is None:
            self.mark_fold_state()
            return
        m = check_fold_state(meta, len(self.weights))
        n = len(self.weights)
        weights = [tensors.get((i, "fw"), self.weights[i]) for i in range(n)]
        pending = [
            None if i in m["no_pending"] else tensors.get((i, "fp"), self.pending[i]) for i in range(n)
        ]
        self._served = _Served(tuple(weights), tuple(m["versions"]), m["version"], m["c_global"])
        self._start = (weights, pending, list(m["applied"]))
        self._log = [
            _Logged(c, w, tuple(slots), tuple(tensors[(slot, f"{LOG_KIND}{k}")] for slot in slots))
            for k, (c, w, slots) in enumerate(m["log"])
        ]
        keys = [(e.clock, e.worker_id) for e in self._log]
        self._in_order = keys == sorted(keys)


def check_fold_state(meta: object, num_slots: int, tensors: object = None) -> dict[str, Any]:
    """The manifest's ``fold_state`` validated (``ValueError`` naming what is wrong); with
    ``tensors`` (a set of (slot, kind)) also that every logged chunk is present."""

    def ints(v: object, n: int | None = None) -> bool:
        return (
            isinstance(v, list) and all(type(x) is int and x >= 0 for x in v) and (n is None or len(v) == n)
        )

    if not isinstance(meta, dict):
        raise ValueError("its fold_state is not an object")
    if not (ints(meta.get("applied"), num_slots) and ints(meta.get("versions"), num_slots)):
        raise ValueError("its fold_state's applied/versions do not match the chunks")
    if not ints(meta.get("no_pending")) or any(s >= num_slots for s in meta["no_pending"]):
        raise ValueError("its fold_state's no_pending is not a list of slots")
    if type(meta.get("version")) is not int or type(meta.get("c_global")) is not int:
        raise ValueError("its fold_state's version/c_global are not integers")
    log = meta.get("log")
    if not isinstance(log, list):
        raise ValueError("its fold_state's log is not a list")
    for k, entry in enumerate(log):
        ok = isinstance(entry, list) and len(entry) == 3 and ints(entry[:2]) and ints(entry[2])
        if not ok or not all(s < num_slots for s in entry[2]) or len(set(entry[2])) != len(entry[2]):
            raise ValueError(f"its fold_state's log entry {k} is malformed")
        if isinstance(tensors, set) and any((s, f"{LOG_KIND}{k}") not in tensors for s in entry[2]):
            raise ValueError(f"its fold_state's log entry {k} misses a chunk")
    return meta
