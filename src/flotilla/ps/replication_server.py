"""The two processes of a replicated shard (``strategy.replication: 2``, ``ps/replication.py``):

- :class:`ReplicatedPSServer`, the primary: a :class:`flotilla.ps.server.PSServer` whose replies
  wait for the backup (``GatedTransport``) and whose log one sender thread ships to the backup.
  At start it takes the backup's state when the backup holds one at least as new as its own
  snapshot: a restarted primary thus resumes with every update it ever acknowledged.
- :class:`BackupServer`, the backup: a copy of the store, changed only by the primary's
  ``ps.replicate`` (replay, in sequence order; a batch sent twice is applied once) and
  ``ps.replica_load`` (the whole state); ``ps.replica_state`` hands it to a restarted primary.

Assumptions (``docs/ps.md``, "Supervision and replication"): the primary and its backup do not
die within the same moment (a restarted backup is re-filled from the primary, a restarted primary
from the backup); the launcher restarts either at the same address.  While the backup is down the
primary's replies wait (workers retry), so nothing is acknowledged that only one process holds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from flotilla.comm.base import ServerBase
from flotilla.comm.endpoint import Reply, Request
from flotilla.comm.msgplane import connect
from flotilla.core.errors import CallTimeout, CommError, RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.config import ShardConfig
from flotilla.ps.replication import (
    GatedTransport,
    ReplicationLog,
    replay,
    state_from_wire,
    state_to_wire,
)
from flotilla.ps.server import PSServer, SnapshotPolicy
from flotilla.ps.server_snapshots import AccountedStore
from flotilla.ps.snapshot import restore

__all__ = ["BackupServer", "ReplicatedPSServer"]

log = get_logger("ps.replication")
CALL_TIMEOUT_S = 10.0
RECOVER_TIMEOUT_S = 30.0
BACKUP_OPS: dict[str, tuple[dict[str, Any], int | None]] = {
    "ps.replicate": ({"incarnation": int, "first": int, "pristine": int, "ops": list}, None),
    "ps.replica_load": ({"incarnation": int, "seq": int, "names": (list, type(None))}, None),
    "ps.replica_state": ({}, 0),
    "ps.replica_stats": ({}, 0),
}


class ReplicatedPSServer(PSServer):
    """A primary shard whose every acknowledgement waits for its backup at ``backup_address``."""

    def __init__(
        self,
        config: ShardConfig,
        transport: ServerBase,
        *,
        backup_address: str,
        secret: bytes,
        snapshots: SnapshotPolicy | None = None,
    ) -> None:
        self._rlog = ReplicationLog()
        gate = GatedTransport(transport, self._rlog)
        super().__init__(config, gate, snapshots=snapshots)  # type: ignore[arg-type]
        gate.incarnation = lambda: self.incarnation
        gate.retain = lambda: not self.store.initialized
        self._backup = connect(backup_address, secret, sender=f"ps-shard{config.shard_index}-primary")
        self._recover_from_backup()
        self._pristine = not self.store.initialized and not self.store.table.entries
        self._sender = threading.Thread(
            target=self._ship, daemon=True, name=f"flotilla-ps-replicate{config.shard_index}"
        )

    def start(self) -> ReplicatedPSServer:
        super().start()
        self._sender.start()
        return self

    def close(self, *, final_snapshot: bool = True) -> None:
        self._rlog.close()
        super().close(final_snapshot=final_snapshot)
        if self._sender.is_alive():
            self._sender.join(CALL_TIMEOUT_S + 1)
        self._backup.close()

    def _answer(self, ready: list) -> None:  # type: ignore[override]
        """Pulls made servable: answered once the backup holds what they show."""
        if ready:
            self._rlog.when_acked(self._rlog.last_seq, lambda: PSServer._answer(ready))

    def _recover_from_backup(self) -> None:
        """Take the backup's state if it is at least as new as this shard's (module doc)."""
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while True:
            try:
                reply = self._backup.call("ps.replica_state", {}, timeout_s=CALL_TIMEOUT_S)
                break
            except CallTimeout:
                if time.monotonic() > deadline:
                    log.warning(
                        "shard %d: backup unreachable; starting from own state", self.config.shard_index
                    )
                    return
        if not reply.body.get("names"):
            return  # (a backup that was never seeded)
        snap = state_from_wire(reply.body, list(reply.tensors), f"backup {self._backup.address}")
        if self.store.initialized and snap.version < self.store.version:
            return
        store = AccountedStore(self.config)
        restore(store, snap)
        store.updates_lost = int(snap.meta.get("updates_lost", 0))
        own = self.store.version if self.store.initialized else None
        self.store = store
        log.warning(
            "shard %d recovered from its backup at version %d (own snapshot: %s)",
            self.config.shard_index,
            store.version,
            own,
        )

    # ------------------------------------------------------------------ the sender thread
    def _ship(self) -> None:
        while not self._rlog.closed:
            try:
                self._ship_once()
            except Exception:  # (never let the thread die: every reply would wait forever)
                log.exception("shard %d: replication failed; retrying", self.config.shard_index)
                time.sleep(0.5)

    def _ship_once(self) -> None:
        batch = self._rlog.next_batch(0.5)
        if batch:
            body = {
                "incarnation": self.incarnation,
                "first": batch[0].seq,
                "pristine": int(self._pristine),
                "ops": [o.to_wire() for o in batch],
            }
            self._send(body, [t for o in batch for t in o.tensors])

    def _send(self, body: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        try:
            reply = self._backup.call("ps.replicate", body, tensors, timeout_s=CALL_TIMEOUT_S)
            self._rlog.ack(int(reply.body["acked"]))
        except RemoteError as exc:
            if exc.code != "out_of_sync":
                log.error("shard %d: the backup refused a batch: %s", self.config.shard_index, exc)
                time.sleep(0.5)
                return
            self._sync_backup(str(exc.message))
        except (CallTimeout, CommError) as exc:
            log.warning("shard %d: backup not answering (%s); replies wait", self.config.shard_index, exc)

    def _sync_backup(self, why: str) -> None:
        """Give the backup this shard's whole state (or, never seeded, replay the log from 1)."""
        with self._lock:
            seq = self._rlog.last_seq
            wire = state_to_wire(self.store, self.incarnation) if self.store.initialized else None
        body: dict[str, Any] = {"incarnation": self.incarnation, "seq": seq if wire else 0, "names": None}
        tensors: list[torch.Tensor] = []
        if wire is not None:
            body["names"], tensors = wire[0]["names"], wire[1]
        log.warning("shard %d: re-filling its backup (%s)", self.config.shard_index, why)
        try:
            self._backup.call("ps.replica_load", body, tensors, timeout_s=CALL_TIMEOUT_S)
        except (CallTimeout, CommError, RemoteError) as exc:
            log.warning("shard %d: re-filling the backup failed: %s", self.config.shard_index, exc)
            return
        if wire is None:
            self._pristine = True
            self._rlog.rewind()
        else:
            self._rlog.ack(seq)


class BackupServer:
    """The backup of one shard: a replayed copy of the primary's store (module doc)."""

    def __init__(self, config: ShardConfig, transport: ServerBase) -> None:
        self.config = config
        self.store = AccountedStore(config)
        self._transport = transport
        self._lock = threading.Lock()
        self.follows: int | None = None  # the primary incarnation whose log this replays
        self.applied_seq = 0
        self.pristine = True
        handlers: dict[str, Any] = {
            "ps.replicate": self._replicate,
            "ps.replica_load": self._load,
            "ps.replica_state": self._state,
            "ps.replica_stats": self._stats,
        }
        for op, (schema, max_tensors) in BACKUP_OPS.items():
            transport.register(op, handlers[op], schema, max_tensors=max_tensors)

    @property
    def address(self) -> str:
        return self._transport.address

    def start(self) -> BackupServer:
        self._transport.start()
        return self

    def close(self) -> None:
        self._transport.close()

    def _replicate(self, req: Request) -> dict[str, Any]:
        b = req.body
        with self._lock:
            if self.follows != b["incarnation"]:
                if not (self.pristine and b["pristine"] and b["first"] == 1):
                    raise RemoteError("out_of_sync", f"following {self.follows}, not {b['incarnation']}")
                self.follows, self.applied_seq = b["incarnation"], 0
            if b["first"] > self.applied_seq + 1:
                raise RemoteError("out_of_sync", f"gap: have {self.applied_seq}, batch from {b['first']}")
            self._replay_batch(b["first"], b["ops"], list(req.tensors))
            return {"acked": self.applied_seq}

    def _replay_batch(self, first: int, ops: list, tensors: list[torch.Tensor]) -> None:
        at = 0
        for i, o in enumerate(ops):
            n = int(o["n"])
            mine, at = tensors[at : at + n], at + n
            if first + i <= self.applied_seq:
                continue  # (sent again after a lost reply)
            try:
                replay(self.store, str(o["op"]), dict(o["body"]), mine, bool(o["resync"]))
            except RemoteError as exc:  # the primary applied it: this copy has diverged
                log.error(
                    "backup of shard %d: replay of %s failed: %s", self.config.shard_index, o["op"], exc
                )
            self.applied_seq, self.pristine = first + i, False

    def _load(self, req: Request) -> dict[str, Any]:
        b = req.body
        store = AccountedStore(self.config)
        if b["names"] is not None:
            snap = state_from_wire(b, list(req.tensors), "the primary")
            restore(store, snap)
            store.updates_lost = int(snap.meta.get("updates_lost", 0))
        with self._lock:
            self.store, self.follows, self.applied_seq = store, b["incarnation"], b["seq"]
            self.pristine = b["names"] is None
        log.warning(
            "backup of shard %d re-filled by incarnation %x at seq %d (version %d)",
            self.config.shard_index,
            b["incarnation"],
            b["seq"],
            store.version,
        )
        return {"version": store.version}

    def _state(self, req: Request) -> Reply:
        with self._lock:
            if not self.store.initialized:
                return Reply({"names": []})
            body, tensors = state_to_wire(self.store, self.follows or 0)
        return Reply(body, tensors)

    def _stats(self, req: Request) -> dict[str, Any]:
        with self._lock:
            s = self.store
            return {
                "version": s.version,
                "digest": s.digest() if s.initialized else "",
                "applied_seq": self.applied_seq,
                "follows": self.follows,
                "updates_lost": s.updates_lost,
            }
