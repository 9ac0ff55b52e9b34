"""State of one parameter-server shard: its chunks as flat tensors, versions and the per-worker
clock table (SPEC §1); the update rule, momentum and the 1/N momentum shares are the mixin
:class:`flotilla.ps.shard_sgd.ShardSGD` (its module doc holds their invariants).  Runtime data, but
no I/O, threads or wall clock: the server (``ps/server.py``) owns locking, the message plane and
snapshot timing; the snapshot encoding is in ``ps/snapshot.py``.

Vocabulary: a *chunk id* is a chunk's index in the :class:`~flotilla.ps.sharding.ShardPlan`
(the same on every worker and server); a *slot* is its position among this shard's chunks.

Invariants:
- A push is validated completely before anything changes (worker, clock, base version, chunk ids,
  dtype, length, finiteness): a rejected push changes no state.  A push tagged with the clock the
  worker already pushed (a retry) is acknowledged without being applied again.
- ``version`` counts the pushes applied to the shard; ``versions[slot]`` those that touched a chunk.
- Membership (hello, leave, evict) follows the pure rules of ``ps/clock_rules.py``; a change that
  advances ``c_global`` folds the finished clock at once.
- Pulls are gated by :func:`flotilla.ps.consistency.may_serve_pull` once every expected worker
  has joined (ASP pulls never wait).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flotilla.core.errors import RemoteError
from flotilla.ps import clock_rules
from flotilla.ps.clock_rules import Refused, ShardClocks
from flotilla.ps.config import DeltaUpdate, ServerSGD, ShardConfig, UpdateRule, shard_config_from
from flotilla.ps.consistency import ClockTable
from flotilla.ps.shard_sgd import ShardSGD
from flotilla.ps.sharding import KeySpec, ShardingError, ShardPlan, plan_shards
from flotilla.ps.store_staging import PushResult, StagedPushes
from flotilla.ps.versioned_reads import VersionedReads
from flotilla.ps.wire import TORCH_FLOAT_DTYPES, keys_from_wire, keys_to_wire, layout_digest, torch_dtype

__all__ = [
    "FLOAT_DTYPES",
    "DeltaUpdate",
    "PushResult",
    "ServerSGD",
    "ShardConfig",
    "ShardStore",
    "UpdateRule",
    "keys_from_wire",
    "keys_to_wire",
    "layout_digest",
    "shard_config_from",
]

FLOAT_DTYPES = TORCH_FLOAT_DTYPES  # the dtypes a PS key may have (flotilla.core.dtypes)


def _reject(code: str, message: str) -> RemoteError:
    return RemoteError(code, message)


@dataclass(slots=True)
class _Layout:
    keys: tuple[KeySpec, ...]
    plan: ShardPlan
    chunk_ids: tuple[int, ...]  # this shard's chunk ids, in slot order
    slot_of: dict[int, int] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = ()
    digest: str = ""


class ShardStore(StagedPushes, VersionedReads, ShardSGD):
    """One shard's parameters, optimizer state, versions and clocks (see the module doc)."""

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.layout: _Layout | None = None
        self._init_sgd()
        self._init_staging()
        self._init_versioned()
        self.versions: list[int] = []
        self.version = 0
        self.clocks = ShardClocks(  # pure clock rules' state
            num_workers=config.num_workers, keeps_views=config.shard_index == 0
        )

    # ------------------------------------------------------------------ layout and seeding
    @property
    def initialized(self) -> bool:
        return self.layout is not None

    def make_layout(self, keys: Sequence[KeySpec]) -> _Layout:
        cfg = self.config
        try:
            plan = plan_shards(keys, cfg.num_shards, chunk_bytes=cfg.chunk_bytes)
        except ShardingError as exc:
            raise _reject("layout", str(exc)) from None
        ids = tuple(i for i, s in enumerate(plan.assignment) if s == cfg.shard_index)
        dtypes = {k.name: torch_dtype(k.dtype) for k in keys}
        return _Layout(
            keys=tuple(keys),
            plan=plan,
            chunk_ids=ids,
            slot_of={c: s for s, c in enumerate(ids)},
            dtypes=tuple(dtypes[plan.chunks[c].key] for c in ids),
            digest=layout_digest(keys, cfg.num_shards, cfg.chunk_bytes),
        )

    def check_layout(self, keys: Sequence[KeySpec]) -> str:
        """The layout digest; ``RemoteError("layout")`` if it differs from the seeded one."""
        digest = layout_digest(keys, self.config.num_shards, self.config.chunk_bytes)
        if self.layout is not None and digest != self.layout.digest:
            raise _reject(
                "layout",
                "the workers' parameter layout differs from the one this "
                "shard was seeded with (different model or chunk_bytes)",
            )
        return digest

    def seed(self, keys: Sequence[KeySpec], chunk_ids: object, tensors: Sequence[torch.Tensor]) -> bool:
        """Set the initial values of every chunk of this shard; False if already seeded."""
        self.check_layout(keys)
        if self.layout is not None:
            return False
        layout = self.make_layout(keys)
        if not isinstance(chunk_ids, list) or sorted(chunk_ids) != sorted(layout.chunk_ids):
            raise _reject("bad_key", f"seed must carry exactly this shard's chunks {list(layout.chunk_ids)}")
        slots = [layout.slot_of[c] for c in chunk_ids]
        self._check_values(layout, slots, tensors)
        weights: list[torch.Tensor] = [torch.empty(0)] * len(layout.chunk_ids)
        for slot, t in zip(slots, tensors):
            weights[slot] = t.reshape(-1).clone()
        self.layout = layout
        self._seed_sgd(weights)
        self.versions = [0] * len(weights)
        self.mark_fold_state()
        return True

    # ------------------------------------------------------------------ membership and clocks
    @property
    def table(self) -> ClockTable:
        return self.clocks.table

    @property
    def joined(self) -> frozenset[int]:
        return self.clocks.joined

    @property
    def departed(self) -> frozenset[int]:
        return self.clocks.departed

    @property
    def complete(self) -> bool:
        return self.clocks.complete

    def hello(self, worker_id: int, clock: int, *, resync: bool) -> int:
        """Register ``worker_id`` at ``clock`` (or, with ``resync`` after a restart, raise its
        recorded clock to ``clock``); returns the worker's recorded clock (``ps/clock_rules``)."""
        self.clocks, recorded = self._rule(clock_rules.hello, worker_id, clock, resync=resync)
        self._maybe_fold()  # a join or a resync may advance c_global
        return recorded

    def leave(self, worker_id: int, *, finished: bool = False) -> None:
        """``worker_id`` leaves (``finished``: after the job's last clock, ``clock_rules.leave``)."""
        clock = self.clocks.table.as_dict().get(worker_id)
        self.clocks = self._rule(clock_rules.leave, worker_id, finished=finished)
        self.departing(worker_id, clock)
        self._maybe_fold()

    def evict(self, worker_id: int) -> bool:
        """Remove a worker declared dead (``clock_rules.evict``); False: nothing to remove."""
        clock = self.clocks.table.as_dict().get(worker_id)
        self.clocks, removed = self._rule(clock_rules.evict, worker_id)
        if removed:
            self.departing(worker_id, clock)
            self._maybe_fold()
        return bool(removed)

    def bar(self, worker_id: int) -> bool:
        """Refuse a worker's hello from now on if it has not said one (``clock_rules.bar``)."""
        self.clocks, barred = self._rule(clock_rules.bar, worker_id)
        return bool(barred)

    def clock_of(self, worker_id: int) -> int:
        try:
            return self.clocks.clock_of(worker_id)
        except Refused:
            raise _reject(
                "unknown_worker",
                f"worker {worker_id!r} has not said hello to shard {self.config.shard_index}",
            ) from None

    def may_serve(self, worker_id: int, clock: int) -> bool:
        """Whether a pull for ``clock`` by ``worker_id`` can be answered now (validated first)."""
        self.clock_of(worker_id)
        return bool(self._rule(clock_rules.check_pull, self.config.consistency, worker_id, clock))

    def _rule(self, rule: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply a pure clock rule to the current state; ``Refused`` becomes a ``RemoteError``."""
        try:
            return rule(self.clocks, *args, **kwargs)
        except Refused as exc:
            raise _reject(exc.code, exc.message) from None

    # ------------------------------------------------------------------ push and pull
    def push(
        self,
        worker_id: int,
        clock: int,
        base_version: int,
        chunk_ids: object,
        tensors: Sequence[torch.Tensor],
    ) -> PushResult:
        """Validate, then apply one push atomically (see the module doc)."""
        slots = self._validate_push(worker_id, base_version, chunk_ids, tensors)
        return self._apply_push(worker_id, clock, slots, tensors)

    def _validate_push(
        self, worker_id: int, base_version: int, chunk_ids: object, tensors: Sequence[torch.Tensor]
    ) -> list[int]:
        """Everything of a push but its clock; returns its slots (``RemoteError`` if invalid)."""
        layout = self._require_layout()
        self.clock_of(worker_id)
        if worker_id in self.fenced:
            raise _reject("unknown_worker", f"worker {worker_id} was declared dead: its pushes are refused")
        if type(base_version) is not int or not 0 <= base_version <= self.version:
            raise _reject(
                "bad_version",
                f"base_version {base_version!r} must be in [0, {self.version}] (the shard's current version)",
            )
        slots = self._slots(layout, chunk_ids)
        self._check_values(layout, slots, tensors)
        return slots

    def _apply_push(
        self, worker_id: int, clock: int, slots: Sequence[int], tensors: Sequence[torch.Tensor]
    ) -> PushResult:
        """Apply a validated push tagged ``clock`` (a retry of the previous clock: not again)."""
        current = self.clock_of(worker_id)
        clocks = self._rule(clock_rules.push, worker_id, clock)
        if clocks is None:  # a retry of the previous clock
            return PushResult(applied=False, version=self.version, clock=current)
        for slot, g in zip(slots, tensors):
            self._apply(slot, g.reshape(-1), current)
            self.versions[slot] += 1
        self.clocks = clocks
        self.version += 1
        self._log_push(worker_id, current, slots, tensors)
        self._maybe_fold()
        return PushResult(applied=True, version=self.version, clock=current + 1)

    def read(self, chunk_ids: object) -> tuple[list[torch.Tensor], list[int]]:
        """The (immutable) tensors of ``chunk_ids`` a pull serves and their versions: the current
        state, or under a lag-0 model the state of the last fold (``ps/versioned_reads.py``);
        :meth:`read_clock` says which."""
        layout = self._require_layout()
        slots = self._slots(layout, chunk_ids)
        served = self.served_state()
        weights, versions = (self.weights, self.versions) if served is None else served[:2]
        return [weights[s] for s in slots], [versions[s] for s in slots]

    def read_clock(self) -> tuple[int, int]:
        """``(version, c_global)`` of the state :meth:`read` serves."""
        served = self.served_state()
        return (self.version, self.table.c_global) if served is None else served[2:]

    # ------------------------------------------------------------------ validation helpers
    def _require_layout(self) -> _Layout:
        if self.layout is None:
            raise _reject(
                "not_initialized",
                f"shard {self.config.shard_index} has not been "
                "seeded with initial parameters yet (call init first)",
            )
        return self.layout

    @staticmethod
    def _slots(layout: _Layout, chunk_ids: object) -> list[int]:
        if not isinstance(chunk_ids, list) or not chunk_ids:
            raise _reject("bad_key", "chunks must be a non-empty list of chunk ids")
        slots = []
        for c in chunk_ids:
            slot = layout.slot_of.get(c) if type(c) is int else None
            if slot is None:
                raise _reject("bad_key", f"chunk id {c!r} is not held by this shard")
            slots.append(slot)
        if len(set(slots)) != len(slots):
            raise _reject("bad_key", "chunk ids must not repeat")
        return slots

    @staticmethod
    def _check_values(layout: _Layout, slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(slots):
            raise _reject("bad_value", f"{len(tensors)} tensors for {len(slots)} chunk ids")
        for slot, t in zip(slots, tensors):
            chunk = layout.plan.chunks[layout.chunk_ids[slot]]
            if t.dtype != layout.dtypes[slot] or t.dim() != 1 or t.numel() != chunk.num_elems:
                raise _reject(
                    "bad_value",
                    f"chunk {layout.chunk_ids[slot]} needs a 1-d "
                    f"{layout.dtypes[slot]} tensor of {chunk.num_elems} elements, got "
                    f"{t.dtype} of shape {tuple(t.shape)}",
                )
            # the sum is non-finite iff an element is, or on float32 overflow (|sum| > 3e38,
            # itself a broken update); one vectorised read, ~8x cheaper than isfinite().all()
            acc = torch.float64 if t.dtype == torch.float64 else torch.float32
            if t.numel() and not math.isfinite(float(t.sum(dtype=acc))):
                raise _reject("bad_value", f"chunk {layout.chunk_ids[slot]} holds NaN or Inf")

    # ------------------------------------------------------------------ digest
    def digest(self) -> str:
        """Hex digest of every weight, momentum and pending buffer, version and clock (tests,
        monitoring)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(
            repr(
                (
                    self.version,
                    self.versions,
                    self.table.entries,
                    self.table.floor,
                    sorted(self.joined),
                    sorted(self.departed),
                )
            ).encode()
        )
        h.update(repr((self.folded_clock, self.applied)).encode())
        for t in [*self.weights, *(m for m in (*self.momentum, *self.pending) if m is not None)]:
            if t.numel():
                h.update(t.view(torch.uint8).numpy().data)
        return h.hexdigest()
