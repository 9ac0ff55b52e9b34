"""Shard 0's data views on the wire (issue 19, ``ps/data_views.py``): every reply to a request
that names a worker carries the entries from that worker's clock on, and a change of the table
is logged with the slices it dropped.  A mixin of :class:`flotilla.ps.server.PSServer`, whose
store and lock it uses; the other shards keep no views and add nothing.
"""

from __future__ import annotations

from typing import Any

from flotilla.core.log import get_logger
from flotilla.ps.data_views import DataViews

__all__ = ["DataViewReplies"]

log = get_logger("ps.server")


class DataViewReplies:
    """The ``data_views`` field of shard 0's replies (module doc)."""

    store: Any  # a ShardStore
    _lock: Any

    def _views_for(self, worker_id: object) -> dict[str, Any]:
        """The field for a direct reply (takes the lock)."""
        with self._lock:
            return self._views_field(worker_id)

    def _views_field(self, worker_id: object) -> dict[str, Any]:
        """(Under the lock.)  ``{"data_views": ...}`` from ``worker_id``'s clock on, or ``{}``."""
        clocks = self.store.clocks
        if not clocks.keeps_views:
            return {}
        at = clocks.table.as_dict().get(worker_id, clocks.table.c_global) if type(worker_id) is int else 0
        return {"data_views": clocks.views.to_wire(max(0, at - 1))}

    def _log_views(self, before: DataViews) -> None:
        """Log a change of the data views (shard 0) and the slices it dropped."""
        after = self.store.clocks.views
        for d in after.dropped[len(before.dropped) - (1 if before.dropped else 0) :]:
            if d not in before.dropped:
                log.warning(
                    "shard 0: data: worker %d's slices of clocks [%d, %d) are used by no push (%s)",
                    d.worker_id, d.first, d.stop, d.why,
                )  # fmt: skip
        if after.views and (not before.views or after.views[-1] != before.views[-1]):
            v = after.views[-1]
            log.info(
                "shard 0: data view %d: from clock %d split among workers %s",
                after.rev,
                v.start,
                list(v.members),
            )
