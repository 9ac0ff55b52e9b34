"""Groups formed while running, by namespace (P-member subsets, pairs, a virtual worker's
stages): a cache of :class:`~flotilla.comm.collective.Group` per namespace over one store."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from flotilla.comm.collective import CollectiveFaults, Group

__all__ = ["GroupFactory"]


class GroupFactory:
    """Groups by namespace over one store, for strategies that form groups while running
    (P-member subsets, pairs, a virtual worker's stages).  ``get(namespace, members, me)`` returns
    the group of ``members`` (worker ids; rank = position) named ``namespace``, building it on
    first use and caching it (a gloo rendezvous costs milliseconds: ``setup_s`` of each group,
    printed by ``tests/multiproc/test_collective_epochs.py``).  Every member must ask for the same
    namespace with the same members.  A failed group is dropped from the cache."""

    def __init__(
        self,
        store: dist.Store,
        *,
        timeout_s: float,
        backend: str = "gloo",
        device: torch.device | None = None,
        breaks: Callable[[], int] | None = None,
        faults: CollectiveFaults | None = None,
    ) -> None:
        self._store, self._timeout_s, self._backend, self._device = store, timeout_s, backend, device
        self._groups: dict[str, Group] = {}
        # a count of the failures seen (broken epochs): a group being set up is given up on as
        # soon as it changes, instead of waiting out the timeout for a member that died
        self._breaks = breaks
        self._faults = faults  # (a test's fault plan: comm.collective.CollectiveFaults)

    def get(self, namespace: str, members: Sequence[int], me: int) -> Group:
        group = self._groups.get(namespace)
        if group is not None and not group.aborted:
            return group
        group = Group(
            self._store,
            namespace=namespace,
            rank=list(members).index(me),
            world_size=len(members),
            timeout_s=self._timeout_s,
            backend=self._backend,
            device=self._device,
            cancelled=self._cancelled(),
            faults=self._faults,
        )
        self._groups[namespace] = group
        return group

    def _cancelled(self) -> Callable[[], bool] | None:
        breaks = self._breaks
        if breaks is None:
            return None
        at = breaks()
        return lambda: breaks() != at

    def abort_all(self, reason: str) -> None:
        for g in list(self._groups.values()):
            g.abort(reason)

    def abort_busy(self, reason: str) -> None:
        """Abort the groups with a collective in flight (a member blocked on a peer that died is
        released), and leave the idle ones: an aborted group is rebuilt under the same namespace
        on its next ``get``, which its peers, still holding theirs, would not meet."""
        for g in list(self._groups.values()):
            if any(not h.is_completed() for h in list(g._handles)):
                g.abort(reason)

    def close(self) -> None:
        for g in self._groups.values():
            g.close()
        self._groups.clear()
