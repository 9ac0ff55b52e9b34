"""Worker side of the parameter server: one batched request per shard per push or pull, sent to
all shards in parallel (shard 0 on the calling thread, the others on a pool thread each; an
asynchronous push uses the pool for every shard), chunks reassembled into the caller's tensors.
The per-shard requests, their retries and the per-shard state are
:class:`flotilla.ps.client_calls.ShardCalls` (its module doc holds their invariants).

With more than one shard a push is **two-phase** (``ps/two_phase.py``): ``ps.stage`` on every
shard, then, once every shard acknowledged, the commit on every shard -- carried by the pull of the
next clock (``ps.cpull``) in ``push_pull`` and read-ahead, or ``ps.commit`` -- so that a worker dying
mid-push leaves its clock applied on every shard or on none.  An asynchronous two-phase push runs
both phases on one driver thread.  With one shard a push is one ``ps.push``/``ps.pushpull``.

Invariants:
- At most one ``push_async`` is in flight; every other call first waits for its acknowledgement
  (and raises its error, if any), so pushes stay in clock order and exactly-once.
- A shard that lost its state while an asynchronous push was in flight is seeded again by
  :meth:`PSClient.wait_pushes` on the caller's thread, and its clock is moved past that push.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import torch

from flotilla.comm.codec import Limits
from flotilla.core.errors import CommError, RemoteError
from flotilla.core.log import get_logger
from flotilla.ps.client_calls import ShardCalls
from flotilla.ps.config import ClientOptions
from flotilla.ps.sharding import DEFAULT_CHUNK_BYTES, KeySpec
from flotilla.ps.wire import keys_of, writable

__all__ = ["ClientOptions", "PSClient", "keys_of"]

log = get_logger("ps.client")
MAX_JOIN_ROUNDS = 8  # hellos until a worker joining mid-run holds one clock on every shard
T = TypeVar("T")


class PSClient(ShardCalls):
    """A worker's connection to all ``len(addresses)`` shards (shard ``s`` at ``addresses[s]``)."""

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
        two_phase: bool | None = None,
        sender: str = "",
    ) -> None:
        super().__init__(
            addresses,
            secret,
            worker_id=worker_id,
            keys=keys,
            chunk_bytes=chunk_bytes,
            options=options,
            limits=limits,
            sender=sender,
        )
        self._pool = ThreadPoolExecutor(self.num_shards, thread_name_prefix="flotilla-ps-client")
        # two-phase pushes (ps/two_phase.py) where a clock spans shards; one shard is atomic alone
        self.two_phase = self.num_shards > 1 if two_phase is None else two_phase
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="flotilla-ps-2pc")  # async 2PC
        self._inflight_flats: dict[str, torch.Tensor] = {}
        self._inflight: list[Future] = []
        self._inflight_clock = -1
        self._inflight_out: dict[str, torch.Tensor] | None = None  # read-ahead target

    # ------------------------------------------------------------------ public API
    def hello(self, clock: int = 0) -> None:
        """Register with every shard at ``clock`` (the number of pushes made so far)."""
        self.wait_pushes()
        self.clocks = [clock] * self.num_shards
        self._each(lambda s: self._hello(s, self._deadline()))
        deadline, rounds = self._deadline(), 0
        while min(self.joined_at) != max(self.joined_at):  # a join mid-run: one clock everywhere
            if rounds == MAX_JOIN_ROUNDS:
                raise CommError(
                    f"worker {self.worker_id}: shards assigned different join clocks {self.joined_at}"
                )
            self.clocks = [max(self.joined_at)] * self.num_shards
            try:
                self._each(lambda s: self._hello(s, self._deadline()))
                rounds += 1
            except RemoteError as exc:  # a shard whose clocks lag shard 0's by > JOIN_LEAD: later
                if exc.code != "bad_clock" or time.monotonic() > deadline:
                    raise
                log.info(
                    "worker %d: joining at clock %d: %s; trying again", self.worker_id, self.clocks[0], exc
                )
                time.sleep(0.2)
        self.clocks = list(self.joined_at)

    def initialize(self, values: Mapping[str, torch.Tensor]) -> list[bool]:
        """Seed every shard not yet seeded with ``values`` (idempotent); True where this call
        seeded.  Raises ``RemoteError("layout")`` if a shard holds another layout."""
        self.wait_pushes()
        return self._each(lambda s: self._initialize(s, values, self._deadline()))

    def push(self, values: Mapping[str, torch.Tensor], clock: int) -> list[int]:
        """Push every key's value (a gradient or a delta) tagged ``clock``; returns shard versions."""
        self.push_async(values, clock)
        return self.wait_pushes()

    def push_async(self, values: Mapping[str, torch.Tensor], clock: int) -> None:
        """Start ``push(values, clock)`` and return at once; the tensors of ``values`` are sent
        zero-copy and must not be modified until the next call (which waits for the ack)."""
        self._ready_to_push(clock)
        flats = self._flat(values)
        deadline = self._deadline()
        self._inflight_clock, self._inflight_flats = clock, flats
        if self.two_phase:
            self._inflight = [self._driver.submit(self._two_phase, flats, clock, deadline, None)]
            return
        self._inflight = [
            self._pool.submit(self._push, s, flats, clock, deadline, reseed=False)
            for s in range(self.num_shards)
        ]

    def push_pull_ahead(
        self, values: Mapping[str, torch.Tensor], clock: int, out: Mapping[str, torch.Tensor]
    ) -> None:
        """Start ``push(values, clock)`` and a pull for ``clock + 2`` into ``out`` (read-ahead:
        one clock past this worker's own, SSP with s >= 1 or ASP only) in one ``ps.pushpull`` per
        shard, and return at once.  ``values`` must stay unmodified and ``out`` unread until
        :meth:`wait_pushes` (or any other call) has collected the replies; ``out``'s tensors must
        be contiguous."""
        self._ready_to_push(clock)
        flats, outs = self._flat(values), self._flat(writable(out))
        deadline = self._deadline()
        self._inflight_clock, self._inflight_out, self._inflight_flats = clock, outs, flats
        if self.two_phase:
            self._inflight = [self._driver.submit(self._two_phase, flats, clock, deadline, (outs, clock + 2))]
            return
        self._inflight = [
            self._pool.submit(self._pull, s, outs, clock, deadline, push=flats, ahead=1, reseed=False)
            for s in range(self.num_shards)
        ]

    @property
    def push_in_flight(self) -> bool:
        """Whether a push started by :meth:`push_async` or :meth:`push_pull_ahead` was not
        collected yet: the message plane may still read its tensors (sent zero-copy)."""
        return bool(self._inflight)

    def wait_pushes(self) -> list[int]:
        """Wait for every shard of the push in flight (if any); their versions, or the first error.

        A shard that lost its state meanwhile (``not_initialized``) is seeded again here, on the
        caller's thread, from ``reseed()`` -- the caller's current weights, which already hold its
        own update -- and told that this worker's clock is past the push, which is therefore not
        applied twice."""
        inflight, self._inflight = self._inflight, []
        out, self._inflight_out = self._inflight_out, None
        if not inflight:
            return []
        if self.two_phase:
            lost = inflight[0].result()  # (raises the first error)
            if lost:
                self._recover_lost(lost, out)
            return list(self.versions)
        wait_futures(inflight)
        versions, first_error = [], None
        for s, f in enumerate(inflight):
            exc = f.exception()
            if isinstance(exc, RemoteError) and exc.code == "not_initialized" and self.reseed is not None:
                log.warning("worker %d: shard %d lost its state; seeding it again", self.worker_id, s)
                deadline = self._deadline()
                self._initialize(s, self.reseed(), deadline)
                self.clocks[s] = self._inflight_clock + 1
                self.incarnations[s] = -1  # a hello that resyncs our clock on the shard
                self._hello(s, deadline)
                if out is not None:  # the read-ahead part did not happen
                    self._pull(s, out, self._inflight_clock + 2, deadline)
                versions.append(self.versions[s])
            elif exc is not None:
                first_error = first_error or exc
            else:
                versions.append(f.result())
        if first_error is not None:
            raise first_error
        return versions

    def pull(self, clock: int, out: Mapping[str, torch.Tensor]) -> list[int]:
        """Block (per the consistency gate) and copy the global values into ``out``'s tensors
        (which must be contiguous: they are written in place)."""
        self.wait_pushes()
        flats = self._flat(writable(out))
        return self._each(lambda s: self._pull(s, flats, clock, self._deadline()))

    def push_pull(
        self, values: Mapping[str, torch.Tensor], clock: int, out: Mapping[str, torch.Tensor]
    ) -> list[int]:
        """``push(values, clock)`` then ``pull(clock + 1, out)`` in one request per shard."""
        self._ready_to_push(clock)
        flats, outs = self._flat(values), self._flat(writable(out))
        if self.two_phase:
            lost = self._two_phase(flats, clock, self._deadline(), (outs, clock + 1), reseed=True)
            assert not lost  # (with reseed, a shard that lost its state is seeded in the call)
            return list(self.versions)
        return self._each(lambda s: self._pull(s, outs, clock, self._deadline(), push=flats))

    def leave(self, *, finished: bool = False) -> None:
        """Leave the job on every shard (gated peers stop waiting for us); one attempt's time.
        ``finished``: this worker pushed every clock of the job (shard 0 then drops no data)."""
        try:
            self.wait_pushes()
        except CommError as exc:
            log.warning("worker %d: the last push failed before leaving: %s", self.worker_id, exc)
        deadline = time.monotonic() + self.options.attempt_timeout_s
        self._each(
            lambda s: self._call(
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
        )

    def stats(self) -> list[dict[str, Any]]:
        return self._each(
            lambda s: self._conns[s].call("ps.stats", {}, timeout_s=self.options.attempt_timeout_s).body
        )

    def close(self) -> None:
        try:
            self.wait_pushes()
        except CommError as exc:
            log.warning("worker %d: the last push failed: %s", self.worker_id, exc)
        self._pool.shutdown(wait=True)
        self._driver.shutdown(wait=True)
        self._close_membership()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _ready_to_push(self, clock: int) -> None:
        """Collect the push in flight, then check that every shard expects ``clock`` next."""
        self.wait_pushes()
        if any(c != clock for c in self.clocks):
            raise CommError(f"push tagged clock {clock}, but the shards acknowledged {self.clocks}")

    def _two_phase(
        self,
        flats: dict[str, torch.Tensor],
        clock: int,
        deadline: float,
        pull: tuple[dict[str, torch.Tensor], int] | None,
        *,
        reseed: bool = False,
    ) -> list[int]:
        """Stage ``clock`` on every shard, then commit it on every shard (``pull = (out, k)``:
        each commit carried by a pull of k into ``out``, ``ps.cpull``).  Returns the shards that
        had lost their state (``not_initialized``, only without ``reseed``): then nothing was
        committed, :meth:`_recover_lost` finishes on the caller's thread."""

        def stage(s: int) -> int | None:
            try:
                self._stage(s, flats, clock, deadline, reseed=reseed)
            except RemoteError as exc:
                if exc.code != "not_initialized" or reseed:
                    raise
                return s
            return None

        lost = [s for s in self._each(stage) if s is not None]
        if not lost:
            self._each(lambda s: self._commit_one(s, flats, clock, deadline, pull))
        return lost

    def _commit_one(
        self,
        s: int,
        flats: dict[str, torch.Tensor],
        clock: int,
        deadline: float,
        pull: tuple[dict[str, torch.Tensor], int] | None,
    ) -> int:
        if pull is None:
            return self._commit(s, flats, clock, deadline)
        return self._pull(s, pull[0], pull[1], deadline, commit=(clock, flats))

    def _recover_lost(self, lost: list[int], out: dict[str, torch.Tensor] | None) -> None:
        """Shards that lost their state during the stage of the clock in flight are seeded again
        from ``reseed()`` (the caller's weights, which hold its own update) with the worker's
        clock past it; the other shards commit it (as :meth:`wait_pushes` does without 2PC)."""
        if self.reseed is None:
            raise RemoteError("not_initialized", f"shards {lost} lost their state and nothing can seed them")
        clock, flats, deadline = self._inflight_clock, self._inflight_flats, self._deadline()
        pull = None if out is None else (out, clock + 2)
        for s in range(self.num_shards):
            if s not in lost:
                self._commit_one(s, flats, clock, deadline, pull)
                continue
            log.warning("worker %d: shard %d lost its state; seeding it again", self.worker_id, s)
            self._initialize(s, self.reseed(), deadline)
            self.clocks[s] = clock + 1
            self.incarnations[s] = -1  # a hello that resyncs our clock on the shard
            self._hello(s, deadline)
            if out is not None:  # the read-ahead part did not happen
                self._pull(s, out, clock + 2, deadline)

    def _each(self, fn: Callable[[int], T]) -> list[T]:
        if self.num_shards == 1:
            return [fn(0)]
        # Shard 0 runs on the calling thread: one thread hand-off less per call (measured 4-9 %
        # faster push_pull, docs/benchmarks.md).  The others' futures are always waited for.
        futures = [self._pool.submit(fn, s) for s in range(1, self.num_shards)]
        try:
            first = fn(0)
        finally:
            wait_futures(futures)
        return [first, *(f.result() for f in futures)]
