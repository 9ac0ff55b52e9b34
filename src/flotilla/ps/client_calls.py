"""Worker side of the parameter server, one shard at a time: the retried, exactly-once requests
(``ps.hello``/``init``/``seed``/``push``/``pull``/``pushpull``, and the two-phase
``ps.stage``/``commit``/``cpull``) a worker sends to shard ``s``,
and the per-shard state they keep.  :class:`flotilla.ps.client.PSClient` builds on it, fanning
each call out to every shard.

Invariants:
- The key -> chunk -> shard map is :func:`flotilla.ps.sharding.plan_shards` of the caller's keys;
  servers compute the same plan from the same keys (checked by ``ps.init``).
- Chunks are sent zero-copy as views of the caller's (flattened, contiguous) tensors; a pull copies
  each received chunk once, into the caller's tensor.
- ``clocks[s]`` is the number of pushes shard ``s`` acknowledged.  Every call is retried until
  its deadline: after a timeout (server down: zmq reconnects by itself), after ``restarted`` (the
  client says hello again, re-syncing its clock, then retries), after ``not_ready`` (a pull still
  gated).  A retried push is never applied twice (the server acknowledges a repeated clock).  When
  the deadline passes, ``CallTimeout`` says which shard, which op and the last reason.
- A commit that a restarted shard answers with ``not_staged`` (staged updates are not in its
  snapshots) stages the clock there again first, then commits (at most ``MAX_RESTAGE`` times).
- A shard that lost its state (restarted without a snapshot: ``not_initialized``) is seeded again
  from ``reseed()`` when the caller gave one, else the error propagates.
- ``read_c_global[s]`` is shard ``s``'s global clock when it built the last pull reply: the pulled
  weights contain every push of every worker for clocks below it (the basis of SSP cached reads).
- Nothing here spans shards or threads: a method for shard ``s`` touches only index ``s`` of the
  per-shard lists, so the caller may run different shards' calls concurrently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from flotilla.comm.base import ClientBase
from flotilla.comm.codec import Limits
from flotilla.comm.msgplane import connect
from flotilla.core.errors import CallTimeout, CommError, ConfigError, RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.client_membership import GoneResolver
from flotilla.ps.config import ClientOptions
from flotilla.ps.sharding import DEFAULT_CHUNK_BYTES, Chunk, KeySpec, plan_shards
from flotilla.ps.wire import flatten, keys_to_wire

__all__ = ["ShardCalls"]

log = get_logger("ps.client")
MAX_RESTAGE = 3  # stages of one clock on one shard that lost it (restarted) before giving up
T = TypeVar("T")


class ShardCalls(GoneResolver):
    """A worker's connections to all ``len(addresses)`` shards (shard ``s`` at ``addresses[s]``)
    and the retried requests to one shard at a time."""

    def __init__(
        self,
        addresses: Sequence[str],
        secret: bytes,
        *,
        worker_id: int,
        keys: Sequence[KeySpec],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        options: ClientOptions = ClientOptions(),
        limits: Limits = Limits(),
        sender: str = "",
    ) -> None:
        """``sender``: this client's name on the wire (default ``ps-w<worker_id>``); clients of
        one worker id side by side (a virtual worker's stages) need names of their own, since a
        receiver requires each sender's sequence numbers to grow."""
        if not addresses:
            raise ConfigError("addresses: need at least one server address")
        self.worker_id = worker_id
        self.options = options
        self.keys = tuple(keys)
        self.plan = plan_shards(self.keys, len(addresses), chunk_bytes=chunk_bytes)
        self.num_shards = len(addresses)
        self._chunks: list[list[tuple[int, Chunk]]] = [[] for _ in addresses]
        for cid, (chunk, shard) in enumerate(zip(self.plan.chunks, self.plan.assignment)):
            self._chunks[shard].append((cid, chunk))
        self._conns: list[ClientBase] = [
            connect(a, secret, sender=f"{sender or f'ps-w{worker_id}'}-s{s}", limits=limits)
            for s, a in enumerate(addresses)
        ]
        self.clocks = [0] * self.num_shards
        self.versions = [0] * self.num_shards
        self.incarnations = [-1] * self.num_shards
        self.joined_at = [0] * self.num_shards  # the clock each shard recorded at the last hello
        self.read_c_global = [0] * self.num_shards
        self.reseed: Callable[[], Mapping[str, torch.Tensor]] | None = None
        self._init_membership(addresses, secret, limits)
        self.park_s = options.attempt_timeout_s

    # ------------------------------------------------------------------ per shard
    def _hello(self, s: int, deadline: float) -> None:
        reply = self._call(
            s,
            "ps.hello",
            lambda: {
                "worker_id": self.worker_id,
                "clock": self.clocks[s],
                "incarnation": self.incarnations[s],
            },
            (),
            deadline=deadline,
            rehello=False,
        )
        if self.incarnations[s] not in (-1, reply["incarnation"]):
            log.warning(
                "worker %d: shard %d restarted; its clock for us is %d, ours %d",
                self.worker_id,
                s,
                reply["clock"],
                self.clocks[s],
            )
        self.incarnations[s] = reply["incarnation"]
        self.versions[s] = min(self.versions[s], reply["version"])
        self.joined_at[s] = int(reply["clock"])

    def _initialize(self, s: int, values: Mapping[str, torch.Tensor], deadline: float) -> bool:
        wire = keys_to_wire(self.keys)
        reply = self._call(s, "ps.init", lambda: {"keys": wire}, (), deadline=deadline)
        if reply["initialized"]:
            return False
        flats = self._flat(values)
        ids, tensors = self._views(s, flats)
        return bool(
            self._call(s, "ps.seed", lambda: {"keys": wire, "chunks": ids}, tensors, deadline=deadline)[
                "seeded"
            ]
        )

    def _update_body(self, s: int, clock: int, ids: list[int]) -> dict[str, Any]:
        """The header of a push or a stage of ``clock`` to shard ``s`` (read at each attempt: a
        retry after a restart carries the new incarnation and version)."""
        return {
            "worker_id": self.worker_id,
            "clock": clock,
            "incarnation": self.incarnations[s],
            "base_version": self.versions[s],
            "chunks": ids,
        }

    def _push(
        self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float, *, reseed: bool = True
    ) -> int:
        ids, tensors = self._views(s, flats)
        reply = self._call(
            s,
            "ps.push",
            lambda: self._update_body(s, clock, ids),
            tensors,
            deadline=deadline,
            reseed=reseed,
        )
        self.clocks[s] = reply["clock"]
        return int(reply["version"])

    def _stage(
        self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float, *, reseed: bool = True
    ) -> bool:
        """Phase 1 of a two-phase push (``ps/two_phase.py``): stage this worker's update of
        ``clock`` on shard ``s``.  False: the shard had committed it already (a retry)."""
        ids, tensors = self._views(s, flats)
        reply = self._call(
            s,
            "ps.stage",
            lambda: self._update_body(s, clock, ids),
            tensors,
            deadline=deadline,
            reseed=reseed,
        )
        if not reply["staged"]:
            self.clocks[s] = int(reply["clock"])
        return bool(reply["staged"])

    def _commit(self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float) -> int:
        """Phase 2: commit the staged ``clock`` on shard ``s``; returns the shard's version."""
        reply = self._restaging(
            s,
            flats,
            clock,
            deadline,
            lambda: self._call(
                s,
                "ps.commit",
                lambda: {"worker_id": self.worker_id, "incarnation": self.incarnations[s], "clock": clock},
                (),
                deadline=deadline,
            ),
        )
        self.clocks[s] = int(reply["clock"])
        self.versions[s] = int(reply["version"])
        return self.versions[s]

    def _restaging(
        self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float, call: Callable[[], T]
    ) -> T:
        """``call()`` (a commit of the staged ``clock``), staging it again from ``flats`` first
        if shard ``s`` lost it (``not_staged``: it restarted; staged updates are not in
        snapshots)."""
        for _ in range(MAX_RESTAGE):
            try:
                return call()
            except RemoteError as exc:
                if exc.code != "not_staged":
                    raise
                log.warning(
                    "worker %d: shard %d lost staged clock %d; staging it again", self.worker_id, s, clock
                )
                self._stage(s, flats, clock, deadline)
        raise CommError(
            f"worker {self.worker_id}: shard {s} lost the staged clock {clock} {MAX_RESTAGE} times"
        )

    def _pull(
        self,
        s: int,
        flats: dict[str, torch.Tensor],
        clock: int,
        deadline: float,
        *,
        push: dict[str, torch.Tensor] | None = None,
        ahead: int = 0,
        reseed: bool = True,
        commit: tuple[int, dict[str, torch.Tensor]] | None = None,
    ) -> int:
        """Pull for ``clock`` from shard ``s`` into ``flats``; with ``push``, first push those
        values tagged ``clock`` and pull for ``clock + 1 + ahead`` (``ps.pushpull``); with
        ``commit = (c, staged values)``, first commit this worker's staged clock c (``ps.cpull``;
        staged again from those values if the shard lost it)."""
        ids = [cid for cid, _ in self._chunks[s]]
        sent = self._views(s, push)[1] if push is not None else []
        reply_tensors: list[torch.Tensor] = []

        def body() -> dict[str, Any]:
            remaining = deadline - time.monotonic()  # leave time for the server's answer
            wait_s = max(0.01, min(self.park_s, remaining - min(0.25, remaining / 2)))
            b = {
                "worker_id": self.worker_id,
                "clock": clock,
                "incarnation": self.incarnations[s],
                "chunks": ids,
                "wait_s": float(wait_s),
            }
            if push is not None:
                b["base_version"] = self.versions[s]
                b["pull_clock"] = clock + 1 + ahead
            if commit is not None:
                b["commit"] = commit[0]
            return b

        op = "ps.pull" if push is None else "ps.pushpull"
        if commit is None:
            reply = self._call(s, op, body, sent, deadline=deadline, sink=reply_tensors, reseed=reseed)
        else:
            reply = self._restaging(
                s,
                commit[1],
                commit[0],
                deadline,
                lambda: self._call(s, "ps.cpull", body, (), deadline=deadline, sink=reply_tensors),
            )
        if len(reply_tensors) != len(ids):
            raise CommError(f"shard {s} answered a pull of {len(ids)} chunks with {len(reply_tensors)}")
        with torch.no_grad():
            for (_, chunk), t in zip(self._chunks[s], reply_tensors):
                flats[chunk.key][chunk.offset_elems : chunk.offset_elems + chunk.num_elems].copy_(t)
        if push is not None:
            self.clocks[s] = clock + 1
        if commit is not None:
            self.clocks[s] = commit[0] + 1
        self.versions[s] = int(reply["version"])
        self.read_c_global[s] = int(reply.get("c_global", 0))
        return self.versions[s]

    def _call(
        self,
        s: int,
        op: str,
        body: Callable[[], dict[str, Any]],
        tensors: Sequence[torch.Tensor],
        *,
        deadline: float,
        rehello: bool = True,
        sink: list[torch.Tensor] | None = None,
        reseed: bool = True,
    ) -> dict[str, Any]:
        """One call to shard ``s`` retried until ``deadline`` (see the module doc)."""
        last, diagnosis = "no attempt made", ""
        while (remaining := deadline - time.monotonic()) > 0:
            b = body()
            timeout = min(remaining, b.get("wait_s", 0.0) + self.options.attempt_timeout_s)
            try:
                reply = self._conns[s].call(op, b, tensors, timeout_s=timeout)
                if sink is not None:
                    sink.extend(reply.tensors)
                if s == 0 and "data_views" in reply.body:
                    self.absorb_views(
                        reply.body["data_views"], reply.body.get("incarnation", b.get("incarnation"))
                    )
                return reply.body
            except CallTimeout as exc:
                last = f"no reply ({exc})"
            except RemoteError as exc:
                last = f"{exc.code}: {exc.message}"
                if exc.code == "restarted" and rehello:
                    self._hello(s, deadline)
                    continue
                if exc.code == "not_initialized" and reseed and self.reseed is not None and op != "ps.init":
                    log.warning("worker %d: shard %d lost its state; seeding it again", self.worker_id, s)
                    self._initialize(s, self.reseed(), deadline)
                    continue
                if exc.code not in ("not_ready", "superseded"):
                    raise
                if exc.code == "not_ready":
                    diagnosis = exc.message
                    self.evict_gone(s, deadline)
                continue
            time.sleep(min(self.options.retry_pause_s, max(0.0, deadline - time.monotonic())))
        raise CallTimeout(
            f"PS {op} to shard {s} ({self._conns[s].address}) by worker "
            f"{self.worker_id} gave up after {self.options.pull_timeout_s} s "
            f"(pull_timeout_s); last: {last}"
            + (f"; the server last said: {diagnosis}" if diagnosis not in last else "")
        )

    # ------------------------------------------------------------------ helpers
    def _deadline(self) -> float:
        return time.monotonic() + self.options.pull_timeout_s

    def _flat(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flatten(self.keys, values)

    def _views(self, s: int, flats: dict[str, torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        ids = [cid for cid, _ in self._chunks[s]]
        views = [flats[c.key][c.offset_elems : c.offset_elems + c.num_elems] for _, c in self._chunks[s]]
        return ids, views
