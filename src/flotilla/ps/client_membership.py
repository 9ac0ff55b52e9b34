"""Worker side of PS membership: evicting the workers the coordinator declared dead or gone from
every shard, resolving their last clock so that it is applied on every shard or on none
(``ps/two_phase.py``), and holding the job's data views that shard 0's replies carry
(``ps/data_views.py``).  A mixin of :class:`flotilla.ps.client_calls.ShardCalls`.

Data views: the newest table (highest ``rev``) wins; after shard 0 restarted (another
incarnation) its table replaces the held one, and if that table is older than the one held (an
unreplicated shard 0 restored from a snapshot taken before the last membership change) a warning
says that the data account may be inexact from there on.

Resolution, for the ids ``gone()`` names that this client has not resolved yet (at most 64):
``ps.fence`` on every shard (each then refuses the ids' stages and commits and reports their
committed clocks), ``target = max`` per id (:func:`~flotilla.ps.two_phase.resolution_target`),
then ``ps.resolve`` on every shard (commit or discard the staged clock, evict).  Both steps are
idempotent, so a resolution cut short (a shard unreachable, this worker dying) is simply redone
by the next attempt or by another survivor; an id counts as resolved only once every shard
answered the resolve.

Invariants: the resolution uses its own connection to each shard (``sender ...-evict``) and one
lock, so it may run from any shard's call thread while the other threads use the main
connections; it never raises (a failure is logged and retried at the next parked pull).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from flotilla.comm.base import ClientBase
from flotilla.comm.codec import Limits
from flotilla.comm.msgplane import connect
from flotilla.core.errors import CallTimeout, CommError
from flotilla.core.log import get_logger
from flotilla.ps import data_views
from flotilla.ps.data_views import DataView
from flotilla.ps.two_phase import resolution_target

__all__ = ["GoneResolver", "MAX_EVICT_IDS"]

log = get_logger("ps.client")
MAX_EVICT_IDS = 64  # ids one resolution names (the servers' MAX_EVICT)


class GoneResolver:
    """Eviction of dead workers from every shard (module doc)."""

    worker_id: int
    incarnations: list[int]
    options: Any

    def _init_membership(self, addresses: Sequence[str], secret: bytes, limits: Limits) -> None:
        # membership (docs/ps.md): the workers the coordinator declared dead or gone, by PS id;
        # a pull the gate parks is re-issued every ``park_s`` and, each time, those ids are
        # evicted from every shard so that no gate waits on them
        self.gone: Callable[[], Collection[int]] | None = None
        self.resolved: set[int] = set()
        self.resolutions: list[dict[str, Any]] = []  # what each shard did, per resolution
        self._evict_lock = threading.Lock()
        self._evict_args = (list(addresses), secret, limits)
        self._evict_conns: list[ClientBase] = []
        self.data_views: tuple[int, tuple[DataView, ...]] = (0, ())  # (rev, entries) from shard 0
        self._views_from = -1  # the incarnation of shard 0 they came from
        self._views_lock = threading.Lock()

    def absorb_views(self, body: object, incarnation: object) -> None:
        """Keep the data views a reply of shard 0 carried (module doc); a malformed table is
        logged and ignored."""
        try:
            received = data_views.from_wire(body)
        except ValueError as exc:
            log.error("worker %d: shard 0 sent malformed data views (ignored): %s", self.worker_id, exc)
            return
        with self._views_lock:
            if type(incarnation) is int and incarnation != self._views_from:
                if self._views_from != -1 and received[0] < self.data_views[0]:
                    log.warning(
                        "worker %d: shard 0 restarted with older data views (rev %d < %d): the data "
                        "account may be inexact from here on",
                        self.worker_id,
                        received[0],
                        self.data_views[0],
                    )
                self._views_from = incarnation
                self.data_views = data_views.absorb((-1, ()), received)
                return
            self.data_views = data_views.absorb(self.data_views, received)

    def evict_gone(self, s: int = 0, deadline: float | None = None) -> list[int]:
        """Resolve and evict, on every shard, the ids ``gone()`` names (module doc); returns the
        ids resolved now.  ``s``: the shard whose pull waits (every shard is resolved anyway)."""
        if self.gone is None:
            return []
        todo = sorted(set(self.gone()) - self.resolved - {self.worker_id})[:MAX_EVICT_IDS]
        if not todo:
            return []
        with self._evict_lock:
            todo = [w for w in todo if w not in self.resolved]
            if not todo:
                return []
            limit = time.monotonic() + self.options.attempt_timeout_s
            limit = limit if deadline is None else min(limit, deadline)
            try:
                self._resolve(todo, limit)
            except CommError as exc:
                log.warning("worker %d: evicting %s failed, will retry: %s", self.worker_id, todo, exc)
                return []
        self.resolved.update(todo)
        return todo

    def _resolve(self, ids: list[int], deadline: float) -> None:
        conns = self._conns_for_evictions()
        committed: dict[int, list[int]] = {}
        for x in range(len(conns)):
            reply = self._side_call(x, "ps.fence", {"evict": ids}, deadline)
            for w, clock, _staged in reply["clocks"]:
                committed.setdefault(int(w), []).append(int(clock))
        known = sorted(committed)
        targets = [resolution_target(committed[w]) for w in known]
        outcome: dict[str, Any] = {"ids": known, "targets": targets, "shards": []}
        for x in range(len(conns)):
            reply = self._side_call(x, "ps.resolve", {"evict": known, "upto": targets}, deadline)
            outcome["shards"].append(reply)
            if reply["failed"]:
                raise CommError(f"shard {x} could not resolve {reply['failed']} (half_applied: see its log)")
        if known:
            self.resolutions.append(outcome)
            log.warning("worker %d: evicted dead workers %s at clocks %s", self.worker_id, known, targets)

    def _conns_for_evictions(self) -> list[ClientBase]:
        if not self._evict_conns:
            addresses, secret, limits = self._evict_args
            self._evict_conns = [
                connect(a, secret, sender=f"ps-w{self.worker_id}-s{s}-evict", limits=limits)
                for s, a in enumerate(addresses)
            ]
        return self._evict_conns

    def _side_call(self, x: int, op: str, fields: dict[str, Any], deadline: float) -> dict[str, Any]:
        last: Exception | None = None
        while (remaining := deadline - time.monotonic()) > 0:
            body = {"worker_id": self.worker_id, "incarnation": self.incarnations[x], **fields}
            try:
                return self._evict_conns[x].call(op, body, (), timeout_s=remaining).body
            except CallTimeout as exc:
                last = exc
        raise CommError(f"{op} to shard {x}: no answer before the deadline ({last})")

    def _close_membership(self) -> None:
        for conn in self._evict_conns:
            conn.close()
        self._evict_conns = []
