"""A worker's process groups (``roles/coordinated.py`` asks for them): one per membership view,
met in the store that view belongs to -- the coordinator's, or, for a view of ring repair, the one
its lowest member hosts (``PeerLink.store``) -- and the per-step groups by namespace
(``GroupFactory``).

A broken epoch (``abort_epoch``: the coordinator or the neighbour watch said so) aborts that
epoch's group and every per-step group with a collective in flight (one being set up gives up),
so no survivor waits out a timeout.  The first group this worker forms fails loudly, naming the
peer address it could not reach (``comm/addresses.check_first_group``), unless that peer died.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from flotilla.cluster.membership import View
from flotilla.comm.addresses import check_first_group
from flotilla.comm.collective import CollectiveFaults, EpochGroup
from flotilla.comm.group_factory import GroupFactory
from flotilla.comm.store import StoreAddress, connect_store
from flotilla.core.errors import CollectiveError, CommError
from flotilla.roles.link import CoordinatorLink
from flotilla.roles.peer_link import PeerLink

__all__ = ["ViewGroups"]


class ViewGroups:
    """``broken(epoch)``: whether ``epoch`` is known broken; ``ring_mode()``: the coordinator is
    gone; ``addresses``: worker id -> its peer server (shared with the membership, which fills
    it); ``ring_epochs``: the views ring repair formed (the membership adds them)."""

    def __init__(
        self,
        link: CoordinatorLink,
        worker_id: int,
        store_address: StoreAddress,
        *,
        timeout_s: float,
        backend: str,
        device: Any,
        peers: PeerLink | None,
        addresses: dict[int, str],
        broken: Callable[[int], bool],
        ring_mode: Callable[[], bool],
        stall_limit_s: float | None = None,
        faults: CollectiveFaults | None = None,
    ) -> None:
        self.link, self.worker_id = link, worker_id
        self._stall_limit_s = stall_limit_s  # (a view's vote: comm.collective.Group.vote)
        self._faults = faults  # a test's fault plan, at every group this worker forms
        self._store_address = store_address
        self._store: Any = None
        self._timeout_s, self._backend, self._device = timeout_s, backend, device
        self._peers, self._addresses = peers, addresses
        self._broken, self._ring_mode = broken, ring_mode
        self.ring_epochs: set[int] = set()  # views formed by ring repair (their store differs)
        self._lock = threading.Lock()
        self._group: EpochGroup | None = None
        self._factory: GroupFactory | None = None
        self._breaks = 0  # failures seen (abort_epoch calls)
        self._stores: dict[StoreAddress, Any] = {}
        self._formed_once = False  # a group of this worker has formed (comm/addresses.check_first_group)

    def abort_epoch(self, epoch: int, why: str = "") -> None:
        """Any thread: ``epoch`` is broken; release whoever waits in its collectives."""
        with self._lock:
            group = self._group
            self._breaks += 1  # (a per-step group being set up gives up: GroupFactory)
        if group is not None and group.epoch <= epoch:
            group.abort(why or f"epoch {group.epoch} is broken (a member died)")
        if self._factory is not None:  # (idle groups are left: see GroupFactory.abort_busy)
            self._factory.abort_busy(why or f"epoch {epoch} is broken (a member died)")

    def _connect(self) -> Any:
        if self._store is None:
            self._store = connect_store(self._store_address, secret=self._store_secret())
        return self._store

    def _store_secret(self) -> bytes | None:
        """The secret that signs the rendezvous store's values (docs/security.md)."""
        secret = getattr(self.link, "secret", None)
        return secret if isinstance(secret, bytes) else None

    def _store_of(self, view: View) -> Any:
        """The store a view's group meets in: the coordinator's, or (a view of ring repair) the
        one its lowest member hosts."""
        if view.epoch not in self.ring_epochs:
            return self._connect()
        host = view.members[0]
        if host == self.worker_id and self._peers is not None and self._peers.store is not None:
            address = self._peers.store.address
        elif self._peers is not None and host in self._addresses:
            try:
                address = self._peers.store_of(self._addresses[host])
            except CommError as exc:
                raise CollectiveError(f"view {view.epoch}: the store of worker {host}: {exc}") from exc
        else:
            raise CollectiveError(f"view {view.epoch}: no address of worker {host}, its store host")
        if address not in self._stores:
            self._stores[address] = connect_store(address, secret=self._store_secret())
        return self._stores[address]

    def group(self, view: View) -> EpochGroup:
        with self._lock:
            if self._group is not None and self._group.epoch == view.epoch:
                return self._group
        epoch = view.epoch
        try:
            group = EpochGroup(
                self._store_of(view),
                epoch=epoch,
                cancelled=lambda: self._broken(epoch),
                rank=view.rank_of(self.worker_id),
                world_size=view.world_size,
                timeout_s=self._timeout_s,
                backend=self._backend,
                device=self._device,
                stall_limit_s=self._stall_limit_s,
                faults=self._faults,
            )
        except CollectiveError as exc:
            # the join fails loudly, naming the peer address (issue 22) -- unless the peer it
            # could not reach has died meanwhile (then the epoch is broken: recover as usual)
            if not self._formed_once and not self._broken_soon(epoch):
                check_first_group(str(exc))
            raise
        self._formed_once = True
        with self._lock:
            self._group = group
        if 0 < self.link.broken_epoch and view.epoch <= self.link.broken_epoch:
            group.abort(f"epoch {view.epoch} is broken (a member died)")
        return group

    def _broken_soon(self, epoch: int, wait_s: float = 2.0) -> bool:
        """Is ``epoch`` declared broken (a member died) within ``wait_s``?  A dead peer refuses
        connections just like an unreachable one; its death reaches us within a heartbeat."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._broken(epoch) or self._ring_mode():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def close_group(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            group.close()
        if self._factory is not None:
            self._factory.close()

    def factory(self) -> GroupFactory:
        """The per-step groups by namespace (built once, in the coordinator's store)."""
        if self._factory is None:
            self._factory = GroupFactory(
                self._connect(),
                timeout_s=self._timeout_s,
                backend=self._backend,
                device=self._device,
                breaks=lambda: self._breaks,
                faults=self._faults,
            )
        return self._factory
