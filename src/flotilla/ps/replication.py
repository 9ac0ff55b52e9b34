"""Chain replication of one parameter-server shard (``strategy.replication: 2``): the primary's
side of the log, the reply gate, and what both sides share (the replayed operations, the state
transfer encoding).  The processes are in :mod:`flotilla.ps.replication_server`.

The idea: a shard is a deterministic state machine driven by the requests its handlers accept
(``ps.hello``, ``ps.seed``, ``ps.push``, ``ps.pushpull``, ``ps.leave``, ``ps.evict``, and the
two-phase ops: :data:`REPLAYED`).  The primary
applies each request as before, then appends it to a :class:`ReplicationLog`; one sender thread
ships the log, in order and in batches, to the shard's backup, which replays every request on its
own copy of the store (:func:`replay`) and acknowledges a sequence number.  Every reply the
primary sends -- direct or deferred -- is held until the backup acknowledged every operation
appended before the reply was made (:class:`GatedTransport`, ``when_acked``): no client ever
sees, and in particular no worker is ever acknowledged, a state the backup does not hold.

Invariants:
- Log order is apply order: handlers run on the message server's one thread, and an operation is
  appended right after its handler returned (a handler that raised changed nothing: the store
  validates before it changes anything), with the ``resync`` flag the primary decided for a hello.
- Sequence numbers start at 1 per primary incarnation.  ``acked`` only grows, except when a
  pristine backup is re-filled from the primary's own log (``rewind``: the primary had never been
  seeded, so its whole log since seq 1 is kept).
- A backup that does not follow this incarnation (restarted, or the primary is new) answers
  ``out_of_sync``; the primary then sends its whole state captured under its lock at seq S
  (``ps.replica_load``), and the log continues after S.
- A state transfer carries what a snapshot carries (``ps/snapshot.py``).
- Every op a handler may register must be classified here (:data:`REPLAYED` or
  :data:`READ_ONLY`); an unknown one is refused when the server is built, never silently not
  replicated.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.comm.endpoint import Deferred, Request
from flotilla.core.errors import ConfigError, RemoteError
from flotilla.ps.snapshot import Snapshot, capture
from flotilla.ps.store import ShardStore
from flotilla.ps.wire import keys_from_wire

__all__ = [
    "READ_ONLY",
    "REPLAYED",
    "GatedTransport",
    "LoggedOp",
    "ReplicationLog",
    "replay",
    "state_from_wire",
    "state_to_wire",
]

REPLAYED = frozenset(
    {"ps.hello", "ps.seed", "ps.push", "ps.pushpull", "ps.leave", "ps.evict"}
    | {"ps.stage", "ps.commit", "ps.cpull", "ps.fence", "ps.resolve"}  # two-phase pushes (issue 19)
    | {"ps.stage_part", "ps.vpull"}  # a virtual worker's parts and votes (two_phase.py "Parts")
)
READ_ONLY = frozenset({"ps.init", "ps.pull", "ps.stats", "ps.snapshot"})
MAX_BATCH_OPS = 64
MAX_BATCH_TENSORS = 2048  # (Limits.max_frames is 4096)


@dataclass(frozen=True, slots=True)
class LoggedOp:
    seq: int
    op: str
    body: dict[str, Any]
    tensors: list[torch.Tensor]
    resync: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.op, "body": self.body, "n": len(self.tensors), "resync": int(self.resync)}


def replay(
    store: ShardStore, op: str, body: dict[str, Any], tensors: list[torch.Tensor], resync: bool
) -> None:
    """Apply one replicated request to ``store`` exactly as the primary's handler did."""
    if op == "ps.hello":
        store.hello(body["worker_id"], body["clock"], resync=resync)
    elif op == "ps.seed":
        store.seed(keys_from_wire(body["keys"]), body["chunks"], tensors)
    elif op in ("ps.push", "ps.pushpull"):
        store.push(body["worker_id"], body["clock"], body["base_version"], body["chunks"], tensors)
    elif op == "ps.leave":
        store.leave(body["worker_id"], finished=body["finished"])
    elif op == "ps.evict":
        for w in body["evict"]:
            if w != body["worker_id"]:
                store.evict(w)
    else:
        _replay_two_phase(store, op, body, tensors)


def _replay_two_phase(store: Any, op: str, body: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    """The two-phase push operations (``ps/server_two_phase.py``), as their handlers apply them."""
    if op == "ps.stage":
        store.stage(body["worker_id"], body["clock"], body["base_version"], body["chunks"], tensors)
    elif op == "ps.stage_part":
        store.stage_part(
            body["worker_id"],
            body["clock"],
            body["base_version"],
            body["chunks"],
            tensors,
            body["part"],
            body["parts"],
        )
    elif op == "ps.commit":
        store.commit(body["worker_id"], body["clock"])
    elif op == "ps.cpull":
        if body["commit"] >= 0:
            store.commit(body["worker_id"], body["commit"])
    elif op == "ps.vpull":
        store.vote(body["worker_id"], body["commit"], body["part"], body["parts"])
    elif op == "ps.fence":
        for w in body["evict"]:
            if w != body["worker_id"]:
                store.fence(w)
    elif op == "ps.resolve":
        for w, target in zip(body["evict"], body["upto"]):
            if w != body["worker_id"]:
                try:
                    store.resolve(w, target)
                except RemoteError:  # (the handler logs it and goes on: so does the replay)
                    pass
    else:
        raise RemoteError("schema", f"operation {op!r} is not replicated")


# ----------------------------------------------------------------------------- state transfer
def state_to_wire(store: ShardStore, incarnation: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The whole (seeded) store as a body and tensors: the manifest of a snapshot (as a uint8
    tensor, so it never meets the header's size bound) and its tensors, named."""
    snap = capture(store, incarnation, {"updates_lost": int(getattr(store, "updates_lost", 0))})
    meta = torch.frombuffer(bytearray(json.dumps(snap.meta).encode()), dtype=torch.uint8)
    names = [f"{kind}.{slot}" for slot, kind, _ in snap.tensors]
    return {"names": names}, [meta, *(t for _, _, t in snap.tensors)]


def state_from_wire(body: dict[str, Any], tensors: list[torch.Tensor], source: str) -> Snapshot:
    """The :class:`Snapshot` a state transfer carries (validated by ``snapshot.restore``)."""
    names = body.get("names")
    if not isinstance(names, list) or len(names) + 1 != len(tensors) or tensors[0].dtype != torch.uint8:
        raise RemoteError("schema", "a state transfer is a manifest tensor and one tensor per name")
    meta = json.loads(bytes(tensors[0].numpy().tobytes()).decode())
    entries = []
    for name, t in zip(names, tensors[1:]):
        kind, _, slot = str(name).partition(".")
        if not slot.isdigit():
            raise RemoteError("schema", f"unexpected tensor name {name!r}")
        entries.append((int(slot), kind, t))
    return Snapshot(meta=meta, tensors=tuple(entries), source=source)


# ----------------------------------------------------------------------------- the log
class ReplicationLog:
    """The primary's operations not yet acknowledged by its backup, and the replies held for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ops: list[LoggedOp] = []  # seq > acked, in order (and, with retain, all since 1)
        self.last_seq = 0
        self.acked = 0
        self.retain = True  # keep acknowledged ops (the store is not seeded yet: see rewind)
        self._held: list[tuple[int, Callable[[], object]]] = []
        self.closed = False

    def append(self, op: str, body: dict[str, Any], tensors: list[torch.Tensor], resync: bool) -> int:
        with self._cond:
            self.last_seq += 1
            self._ops.append(LoggedOp(self.last_seq, op, body, tensors, resync))
            self._cond.notify_all()
            return self.last_seq

    def when_acked(self, seq: int, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the backup acknowledged ``seq`` (now, if it has)."""
        with self._cond:
            if seq > self.acked:
                self._held.append((seq, fn))
                return
        fn()

    def next_batch(self, timeout_s: float) -> list[LoggedOp]:
        """The ops after ``acked`` (at most a batch), waiting up to ``timeout_s`` for one."""
        with self._cond:
            self._cond.wait_for(lambda: self.last_seq > self.acked or self.closed, timeout_s)
            batch: list[LoggedOp] = []
            tensors = 0
            for o in self._ops:
                if o.seq <= self.acked:
                    continue
                if batch and (len(batch) >= MAX_BATCH_OPS or tensors + len(o.tensors) > MAX_BATCH_TENSORS):
                    break
                batch.append(o)
                tensors += len(o.tensors)
            return batch

    def ack(self, seq: int) -> None:
        """The backup holds every op up to ``seq``: release the replies waiting for them."""
        with self._cond:
            self.acked = max(self.acked, min(seq, self.last_seq))
            if not self.retain:
                self._ops = [o for o in self._ops if o.seq > self.acked]
            ready = [fn for s, fn in self._held if s <= self.acked]
            self._held = [(s, fn) for s, fn in self._held if s > self.acked]
        for fn in ready:
            fn()

    def rewind(self) -> None:
        """A pristine backup will replay the whole log again from seq 1 (never-seeded primary)."""
        with self._cond:
            if not self.retain:
                raise RuntimeError("the log was not retained: send the state instead")
            self.acked = 0

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._held.clear()  # (their clients retry against the next incarnation)
            self._cond.notify_all()


# ----------------------------------------------------------------------------- the reply gate
class GatedTransport:
    """Wraps a message-plane server for a replicated primary: each handler's accepted request is
    logged (``REPLAYED`` ops) and its reply held until the backup acknowledged the log up to it."""

    def __init__(self, inner: Any, log: ReplicationLog) -> None:
        self._inner = inner
        self._log = log
        self.incarnation: Callable[[], int] = lambda: -1  # set by the server once it has one
        self.retain: Callable[[], bool] = lambda: True  # whether the primary is still unseeded

    @property
    def address(self) -> str:
        return str(self._inner.address)

    def start(self) -> GatedTransport:
        self._inner.start()
        return self

    def close(self) -> None:
        self._inner.close()

    def register(self, op: str, handler: Callable[[Request], Any], schema: Any, **kwargs: Any) -> None:
        if op not in REPLAYED and op not in READ_ONLY:
            raise ConfigError(
                f"replication: PS operation {op!r} is not classified as replayed or read-only "
                "(ps/replication.py): a replicated shard cannot know whether it changes its state"
            )
        self._inner.register(op, self._gated(op, handler), schema, **kwargs)

    def _gated(self, op: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        log = self._log

        def run(req: Request) -> Any:
            resync = op == "ps.hello" and req.body.get("incarnation") != self.incarnation()
            result = handler(req)  # (a RemoteError changed nothing: not logged)
            if op in REPLAYED:
                log.append(op, dict(req.body), list(req.tensors), resync)
                log.retain = self.retain()
            if isinstance(result, Deferred):
                return result  # (resolved through the server's gated _answer)
            seq = log.last_seq
            if log.acked >= seq:
                return result
            deferred = req.defer()
            log.when_acked(seq, lambda: deferred.resolve(result))
            return deferred

        return run
