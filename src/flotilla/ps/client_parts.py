"""A parameter-server client that stands for one part of a HetPipe virtual worker (SPEC §2, issue
19 item 5).  A virtual worker (VW) is k pipeline stages, each holding a partition of the model's
keys; it pushes one aggregated update per wave, tagged with the VW's clock, under the VW's one
worker id.  Each stage runs a :class:`VWPartClient` for the VW's id and its own part number.

Per VW clock ``c`` (the rules: ``ps/two_phase.py``, "Parts"):

1. every stage :meth:`~VWPartClient.stage`\\ s its part of ``c`` on **every** shard
   (``ps.stage_part``; an empty chunk list on a shard holding none of its chunks);
2. each stage then calls :meth:`~VWPartClient.vote_pull` (``ps.vpull`` on every shard): its
   vote to commit ``c`` -- "my part is staged on every shard" -- carried by its pull of
   ``c + 1``; a shard applies the union of the parts as one push when the last part's vote
   arrives, and answers each part's pull once the clock is applied and the gate allows it.  The
   stages need not coordinate among themselves;
3. (or, where something outside coordinates the stages: once every stage's ``stage`` returned,
   :meth:`~VWPartClient.commit` -- the first commit to reach a shard applies the clock -- and
   :meth:`~VWPartClient.pull` of the own chunks; a shard holding none is skipped).

The VW id says hello, leaves and is evicted like any worker (one clock per VW; a VW whose stage
dies is evicted by the survivors' resolution, which discards an incomplete clock everywhere).

Invariants:
- The shard plan is computed from the **full** key layout (as the servers compute it); only the
  own keys' chunks are sent or received.  Parts of one VW must own disjoint keys (the shards
  refuse overlapping chunks: ``bad_key``).
- A part client never seeds (seeding needs every value: a client with all keys does it), and
  never pushes alone (``push``/``push_pull``/``push_pull_ahead`` raise :class:`ConfigError`).
- A commit answered ``not_staged`` (a shard restarted and lost the staged parts, or a stage had
  not staged yet) is raised to the caller: every stage must stage again before a commit.
- ``leave`` by a second stage of a VW that already left is a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn

import torch

from flotilla.comm.codec import Limits
from flotilla.core.errors import CommError, ConfigError, RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.client import PSClient
from flotilla.ps.client_calls import MAX_RESTAGE
from flotilla.ps.config import ClientOptions
from flotilla.ps.sharding import DEFAULT_CHUNK_BYTES, KeySpec
from flotilla.ps.two_phase import MAX_PARTS
from flotilla.ps.wire import flatten, writable

__all__ = ["VWPartClient"]

log = get_logger("ps.client")


class VWPartClient(PSClient):
    """Part ``part`` of ``parts`` of virtual worker ``worker_id``, owning the keys named ``own``
    of the full layout ``keys`` (module doc)."""

    def __init__(
        self,
        addresses: Sequence[str],
        secret: bytes,
        *,
        worker_id: int,
        keys: Sequence[KeySpec],
        own: Collection[str],
        part: int,
        parts: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        options: ClientOptions = ClientOptions(),
        limits: Limits = Limits(),
    ) -> None:
        names = {k.name for k in keys}
        if not own or not set(own) <= names:
            raise ConfigError(f"own: must name some of the layout's keys, got {sorted(set(own) - names)[:4]}")
        if not 1 <= parts <= MAX_PARTS or not 0 <= part < parts:
            raise ConfigError(f"part/parts: need 0 <= part < parts <= {MAX_PARTS}, got {part}/{parts}")
        super().__init__(
            addresses,
            secret,
            worker_id=worker_id,
            keys=keys,
            chunk_bytes=chunk_bytes,
            options=options,
            limits=limits,
            two_phase=True,
            sender=f"ps-w{worker_id}-p{part}",
        )
        self.part, self.parts = part, parts
        self.own_keys = tuple(k for k in self.keys if k.name in set(own))
        self._chunks = [[(cid, c) for cid, c in chunks if c.key in set(own)] for chunks in self._chunks]

    @property
    def own_shards(self) -> list[int]:
        """The shards holding some of the own keys' chunks (the others are never pulled from)."""
        return [s for s, chunks in enumerate(self._chunks) if chunks]

    # ------------------------------------------------------------------ public API
    def stage(self, values: Mapping[str, torch.Tensor], clock: int) -> bool:
        """Stage this part of the VW's ``clock`` (``values``: at least the own keys) on every
        shard; True if every shard then holds every part of it (or had committed it)."""
        flats = self._flat(values)
        deadline = self._deadline()
        return all(self._each(lambda s: self._stage_part(s, flats, clock, deadline)))

    def commit(self, clock: int) -> list[int]:
        """Commit the VW's ``clock`` on every shard (once every part is staged on every shard);
        the shards' versions.  ``RemoteError("not_staged")`` if a shard lacks a part."""
        deadline = self._deadline()
        return self._each(lambda s: self._commit_vw(s, clock, deadline))

    def pull(self, clock: int, out: Mapping[str, torch.Tensor]) -> list[int]:
        """Pull the own keys for ``clock`` into ``out`` (gated as any pull); a shard holding none
        of them is not asked (its entry: the last version seen)."""
        flats = self._flat(writable(out))
        deadline = self._deadline()
        return self._each(
            lambda s: self._pull(s, flats, clock, deadline) if self._chunks[s] else self.versions[s]
        )

    def vote_pull(
        self, values: Mapping[str, torch.Tensor], clock: int, out: Mapping[str, torch.Tensor]
    ) -> list[int]:
        """Vote to commit the VW's staged ``clock`` on every shard (this part, ``values``, is
        staged on every shard: :meth:`stage` returned), then pull the own keys for ``clock + 1``
        into ``out``: each shard answers once every part voted there (the last vote applies the
        clock) and the gate allows the pull.  No stage needs to know when the others staged.
        A shard that lost the staged clock (it restarted) is staged again from ``values``."""
        flats, dst = self._flat(values), self._flat(writable(out))
        deadline = self._deadline()

        def one(s: int) -> int:
            vpull = lambda: self._vpull(s, dst, clock, deadline)
            return self._restaging_part(s, flats, clock, deadline, vpull)

        return self._each(one)

    def leave(self, *, finished: bool = False) -> None:
        """Leave the job for the VW on every shard (after every stage is done; ``finished``: it
        trained every clock of the job); a no-op where another stage of the VW left already."""
        deadline = time.monotonic() + self.options.attempt_timeout_s

        def one(s: int) -> None:
            try:
                self._call(
                    s,
                    "ps.leave",
                    lambda: {
                        "worker_id": self.worker_id,
                        "incarnation": self.incarnations[s],
                        "finished": finished,
                    },
                    (),
                    deadline=deadline,
                )
            except RemoteError as exc:
                if exc.code != "unknown_worker":
                    raise

        self._each(one)

    def initialize(self, values: Mapping[str, torch.Tensor]) -> NoReturn:
        raise ConfigError("a VW part holds only its own keys: seed the PS with a client that has all values")

    def push_async(self, values: Mapping[str, torch.Tensor], clock: int) -> NoReturn:
        raise ConfigError("a VW part does not push alone: stage() its part, then commit() the VW's clock")

    def push_pull(self, values: Any, clock: int, out: Any) -> NoReturn:
        self.push_async(values, clock)

    def push_pull_ahead(self, values: Any, clock: int, out: Any) -> NoReturn:
        self.push_async(values, clock)

    # ------------------------------------------------------------------ per shard
    def _flat(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flatten(self.own_keys, values)

    def _stage_part(self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float) -> bool:
        ids, tensors = self._views(s, flats)
        reply = self._call(
            s,
            "ps.stage_part",
            lambda: {**self._update_body(s, clock, ids), "part": self.part, "parts": self.parts},
            tensors,
            deadline=deadline,
            reseed=False,
        )
        if not reply["staged"]:  # committed already (a retry, or another stage committed it)
            self.clocks[s] = int(reply["clock"])
        return bool(reply["complete"])

    def _restaging_part(
        self, s: int, flats: dict[str, torch.Tensor], clock: int, deadline: float, call: Callable[[], int]
    ) -> int:
        for _ in range(MAX_RESTAGE):
            try:
                return call()
            except RemoteError as exc:
                if exc.code != "not_staged":
                    raise
                what = "VW %d part %d: shard %d lost clock %d; staging it again"
                log.warning(what, self.worker_id, self.part, s, clock)
                self._stage_part(s, flats, clock, deadline)
        raise CommError(f"VW {self.worker_id}: shard {s} lost the staged clock {clock} {MAX_RESTAGE} times")

    def _vpull(self, s: int, dst: dict[str, torch.Tensor], clock: int, deadline: float) -> int:
        ids = [cid for cid, _ in self._chunks[s]]
        got: list[torch.Tensor] = []

        def body() -> dict[str, Any]:
            remaining = deadline - time.monotonic()
            return {
                "worker_id": self.worker_id,
                "incarnation": self.incarnations[s],
                "clock": clock + 1,
                "commit": clock,
                "part": self.part,
                "parts": self.parts,
                "chunks": ids,
                "wait_s": float(max(0.01, min(self.park_s, remaining - min(0.25, remaining / 2)))),
            }

        reply = self._call(s, "ps.vpull", body, (), deadline=deadline, sink=got, reseed=False)
        if len(got) != len(ids):
            raise CommError(f"shard {s} answered a pull of {len(ids)} chunks with {len(got)}")
        with torch.no_grad():
            for (_, chunk), t in zip(self._chunks[s], got):
                dst[chunk.key][chunk.offset_elems : chunk.offset_elems + chunk.num_elems].copy_(t)
        self.clocks[s] = clock + 1
        self.versions[s] = int(reply["version"])
        self.read_c_global[s] = int(reply.get("c_global", 0))
        return self.versions[s]

    def _commit_vw(self, s: int, clock: int, deadline: float) -> int:
        reply = self._call(
            s,
            "ps.commit",
            lambda: {"worker_id": self.worker_id, "incarnation": self.incarnations[s], "clock": clock},
            (),
            deadline=deadline,
            reseed=False,
        )
        self.clocks[s] = int(reply["clock"])
        self.versions[s] = int(reply["version"])
        return self.versions[s]
