"""Link shaping: the links of ``cluster.links`` emulated at run time (issue 37 item 4, second
part; ``docs/links.md``).  With ``cluster.links.emulate: true`` every worker and stage process
installs a :class:`Shaping` (its own name and the links' costs) and its traffic takes at least
what the links model says -- the same latency-bandwidth functions the pipeline planner and the
simulator use (``cluster/link_costs.py`` over ``cluster/comm_cost.py``; handed in as a
:class:`LinkCosts`, since ``comm`` sits below ``cluster``).

- **Collective plane** (``comm/collective.Group``): a group of two or more members learns their
  names at construction (each member writes its own under the group's namespace before the
  backend's rendezvous, so they are all there once the backend exists).

  * A point-to-point **send** is queued on its destination's modelled link: a message occupies
    the link for ``bytes / bandwidth``, one after another in the order they were posted, and
    arrives ``latency`` after it left; the real send is launched at that arrival time, by the
    group's shaping thread (:class:`GroupShaper`), so the sender's compute goes on meanwhile as
    on a real link.  The order of sends to one destination is kept (the pipeline schedule's
    FIFO links).  A receive is not shaped: its data comes when the send is launched.
  * An **all-reduce** (a vote too) and a **broadcast** are launched at once; their handle
    completes no earlier than launch + the modelled time (``LinkCosts.allreduce_s``: a ring
    all-reduce over the slowest link among the members; ``broadcast_s``: the source's slowest
    link), so the transport's own time overlaps the model's.

- **Message plane** (``comm/base.ClientBase.call``, ``comm/msgplane.MessageServer``): every
  process has one interface (:class:`Nic`) on the default link (``LinkCosts.message``: the
  parameter servers and the coordinator are not among the cluster's workers, so no pair names
  them), each direction serialised: a message leaves behind the ones this process sent before
  it (``bytes / bandwidth`` each) and reaches its receiver ``latency`` later; there it is in once
  the ones that came in before it are (its own transmission was paid by its sender).  A client
  waits before sending and before handing a reply over; a server handles a request once it is
  in and sends a reply once it has left.  So a parameter server's shard receiving every
  worker's push is as busy as its link says (SPEC §1: m workers over n shards), and a process
  sending to several servers shares its own link among them.

What is not modelled: contention between groups (each group's links are its own) and between a
process's collective and message-plane traffic, and the transport's own time on the
point-to-point and message paths, which
comes on top of the model's (loopback: tens of microseconds per megabyte, against the
milliseconds an emulated link slower than the host costs -- SPEC §8's rule: emulate links slower
than the host).  ``benchmarks/link_shaping.py`` prints measured against modelled times.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flotilla.core.log import get_logger

__all__ = [
    "GroupShaper", "HeldWork", "LinkCosts", "Nic", "ServerLink", "Shaping",
    "install", "installed", "payload_bytes", "scoped",
]  # fmt: skip

log = get_logger("comm.shaping")

NAME_KEY = "flotilla/shaping/name/"
NAMES_WAIT_S = 10.0  # (a group's members publish their names at its construction: see join)


class LinkCosts(Protocol):
    """The cost of the emulated links (``cluster/link_costs.ModelCosts`` implements it)."""

    def p2p(self, src: str, dst: str) -> tuple[float, float]:
        """``(latency_s, seconds_per_byte)`` of the link from ``src`` to ``dst``."""
        ...

    def allreduce_s(self, members: tuple[str, ...], num_bytes: int) -> float:
        """An all-reduce of ``num_bytes`` per member among ``members``."""
        ...

    def broadcast_s(self, members: tuple[str, ...], src: int, num_bytes: int) -> float:
        """A broadcast of ``num_bytes`` from ``members[src]`` to the others."""
        ...

    def message(self, me: str) -> tuple[float, float]:
        """``(latency_s, seconds_per_byte)`` of a message-plane message from or to ``me``."""
        ...


class Nic:
    """One process's network interface on the message plane: what it sends leaves one message
    after another, and so does what it receives come in (each direction at the link's bandwidth)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out_free = 0.0  # when what was sent so far has left
        self._in_free = 0.0  # when what arrived so far is in

    def leaves(self, now: float, num_bytes: int, per_byte: float) -> float:
        """When a message of ``num_bytes`` sent ``now`` has left this process."""
        with self._lock:
            self._out_free = max(now, self._out_free) + num_bytes * per_byte
            return self._out_free

    def enters(self, now: float, num_bytes: int, per_byte: float) -> float:
        """When a message of ``num_bytes`` that arrived ``now`` is in: its own transmission was
        paid by its sender, so it waits only behind the ones that came in before it."""
        with self._lock:
            self._in_free = max(now, self._in_free + num_bytes * per_byte)
            return self._in_free


@dataclass(frozen=True, slots=True)
class Shaping:
    """One process's shaping: its name (``cluster.workers[*].name``), the links' costs and its
    message-plane interface."""

    me: str
    costs: LinkCosts
    nic: Nic = field(default_factory=Nic, compare=False)

    def sent_at(self, num_bytes: int, now: float) -> float:
        """When a message-plane message of ``num_bytes`` sent ``now`` reaches its receiver
        (it leaves behind this process's earlier ones, then the link's latency)."""
        latency, per_byte = self.costs.message(self.me)
        return self.nic.leaves(now, num_bytes, per_byte) + latency

    def received_at(self, num_bytes: int, now: float) -> float:
        """When a message-plane message of ``num_bytes`` that arrived ``now`` is in."""
        _, per_byte = self.costs.message(self.me)
        return self.nic.enters(now, num_bytes, per_byte)


_installed: Shaping | None = None
_lock = threading.Lock()


def install(shaping: Shaping | None) -> None:
    """Set (or clear, None) this process's shaping; groups and clients made from now on follow it."""
    global _installed
    with _lock:
        _installed = shaping
    if shaping is not None:
        log.info("links emulated for %s (cluster.links.emulate)", shaping.me)


def installed() -> Shaping | None:
    with _lock:
        return _installed


@contextlib.contextmanager
def scoped(shaping: Shaping | None) -> Iterator[None]:
    """``shaping`` installed for the ``with`` block, the previous one back after it (a launcher
    that runs in a caller's process: a test's)."""
    previous = installed()
    install(shaping)
    try:
        yield
    finally:
        install(previous)


def payload_bytes(frames: Sequence[Any]) -> int:
    """The bytes of a message's frames (bytes, bytearrays, memoryviews, zmq frames)."""
    total = 0
    for f in frames:
        buf = getattr(f, "buffer", f)  # (a zmq.Frame's memoryview)
        total += memoryview(buf).nbytes
    return total


class ServerLink:
    """A message-plane server's side of its process's :class:`Nic` (module doc): a request is
    handled once it is in, a reply sent once it has left.  Used by the serving thread alone."""

    def __init__(self, shaping: Shaping) -> None:
        self.shaping = shaping
        self._in: list[tuple[float, int, Any]] = []
        self._out: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()

    def arrived(self, message: Sequence[Any]) -> None:
        """A request's frames (the transport's routing frame first) just arrived."""
        now = time.monotonic()
        at = self.shaping.received_at(payload_bytes(message[1:]), now)
        heapq.heappush(self._in, (at, next(self._seq), message))

    def due_in(self) -> list[Any]:
        """The requests that are in by now, in order."""
        return _due(self._in)

    def departs(self, message: Sequence[Any]) -> bool:
        """Queue a reply (routing frame first) until it has left; False: it may go now."""
        now = time.monotonic()
        at = self.shaping.sent_at(payload_bytes(message[1:]), now)
        if at <= now:
            return False
        heapq.heappush(self._out, (at, next(self._seq), message))
        return True

    def due_out(self) -> list[Any]:
        """The replies that have left by now, in order."""
        return _due(self._out)

    def drain_out(self) -> list[Any]:
        """Every reply still on the link, in order (the server is closing: they go now)."""
        out = [m for _, _, m in sorted(self._out)]
        self._out.clear()
        return out

    def next_due(self) -> float:
        heads = [q[0][0] for q in (self._in, self._out) if q]
        return min(heads) if heads else math.inf


def _due(heap: list[tuple[float, int, Any]]) -> list[Any]:
    now, out = time.monotonic(), []
    while heap and heap[0][0] <= now:
        out.append(heapq.heappop(heap)[2])
    return out


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, _dt.timedelta) else float(timeout)


class HeldWork:
    """A launched collective whose completion is held until ``until`` (a ``time.monotonic()``
    reading): ``wait`` never takes longer than asked (it raises a "timed out" error when the
    hold outlasts the time given, as a backend's wait does, so a sliced wait goes on)."""

    __slots__ = ("_work", "_until")

    def __init__(self, work: Any, until: float) -> None:
        self._work, self._until = work, until

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.monotonic()
        if timeout is None:
            self._work.wait()
            time.sleep(max(0.0, self._until - time.monotonic()))
            return True
        self._work.wait(timeout)
        left = self._until - time.monotonic()
        if left > 0:
            budget = _seconds(timeout) - (time.monotonic() - t0)
            if left > budget:
                time.sleep(max(0.0, budget))
                raise RuntimeError("timed out: the emulated link still holds the result")
            time.sleep(left)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed()) and time.monotonic() >= self._until


class DelayedWork:
    """A send waiting on its modelled link; the shaping thread launches it (:meth:`launched`) or
    gives it up (:meth:`failed`)."""

    __slots__ = ("_ready", "_work", "_error")

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._work: Any = None
        self._error = ""

    def launched(self, work: Any) -> None:
        self._work = work
        self._ready.set()

    def failed(self, why: str) -> None:
        self._error = why
        self._ready.set()

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.monotonic()
        if not self._ready.wait(None if timeout is None else _seconds(timeout)):
            raise RuntimeError("timed out: the send is still on its emulated link")
        if self._error:
            raise RuntimeError(self._error)
        if timeout is None:
            return bool(self._work.wait())
        left = max(0.001, _seconds(timeout) - (time.monotonic() - t0))
        return bool(self._work.wait(_dt.timedelta(seconds=left)))

    def is_completed(self) -> bool:
        if not self._ready.is_set():
            return False
        return bool(self._error) or bool(self._work.is_completed())


@dataclass(order=True, slots=True)
class _Queued:
    due: float
    seq: int
    start: Callable[[], Any]
    work: DelayedWork


class GroupShaper:
    """The shaping of one group (module doc): its members' names, each destination's link
    (``free_at``: when it has sent what was queued), and the thread that launches sends when
    their modelled time has come (started on the first send)."""

    def __init__(
        self,
        shaping: Shaping,
        names: tuple[str, ...],
        rank: int,
        on_fail: Callable[[str], None] | None = None,
    ) -> None:
        """``on_fail(why)``: called (on the shaping thread) when a send could not be launched."""
        self.shaping, self.names, self.rank = shaping, names, rank
        self._on_fail = on_fail
        self._free_at: dict[int, float] = {}
        self._heap: list[_Queued] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = ""

    @staticmethod
    def publish(store: Any, rank: int, me: str) -> None:
        """Write this member's name under the group's namespace (``store``: the prefixed store)."""
        store.set(f"{NAME_KEY}{rank}", me.encode())

    @classmethod
    def join(
        cls,
        shaping: Shaping,
        store: Any,
        rank: int,
        world_size: int,
        *,
        wait_s: float = NAMES_WAIT_S,
        on_fail: Callable[[str], None] | None = None,
    ) -> GroupShaper:
        """The shaper of a group whose members publish their names before its backend's
        rendezvous (with gloo they all have once it exists; NCCL's starts lazily, so this waits
        up to ``wait_s`` for them).  A member that published nothing by then (it does not emulate
        links: every process of a job emulates alike) is named ``rank<r>``: the default links."""
        keys = [f"{NAME_KEY}{r}" for r in range(world_size)]
        deadline, pause = time.monotonic() + wait_s, 0.002
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        names = []
        for r, key in enumerate(keys):
            if r == rank:
                names.append(shaping.me)
            else:
                names.append(_as_str(store.get(key)) if store.check([key]) else f"rank{r}")
        return cls(shaping, tuple(names), rank, on_fail)

    def allreduce(self, work: Any, num_bytes: int) -> HeldWork:
        return HeldWork(work, time.monotonic() + self.shaping.costs.allreduce_s(self.names, num_bytes))

    def broadcast(self, work: Any, src: int, num_bytes: int) -> HeldWork:
        return HeldWork(work, time.monotonic() + self.shaping.costs.broadcast_s(self.names, src, num_bytes))

    def send(self, start: Callable[[], Any], dst: int, num_bytes: int) -> DelayedWork:
        """Queue a send to rank ``dst`` of ``num_bytes``; ``start()`` launches the real one."""
        latency, per_byte = self.shaping.costs.p2p(self.names[self.rank], self.names[dst])
        work = DelayedWork()
        with self._cv:
            if self._closed:
                work.failed(self._closed)
                return work
            now = time.monotonic()
            left = max(now, self._free_at.get(dst, 0.0)) + num_bytes * per_byte
            self._free_at[dst] = left
            heapq.heappush(self._heap, _Queued(left + latency, next(self._seq), start, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="link-shaping", daemon=True)
                self._thread.start()
            self._cv.notify()
        return work

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0].due > time.monotonic()):
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0].due - time.monotonic()))
                if self._closed:
                    return
                item = heapq.heappop(self._heap)
            try:
                item.work.launched(item.start())
            except Exception as exc:  # (the group failed or closed meanwhile)
                why = f"send failed: {str(exc).strip().splitlines()[0] if str(exc) else repr(exc)}"
                item.work.failed(why)
                if self._on_fail is not None:  # (the group fails at once, as an unshaped send's would)
                    self._on_fail(why)
            del item  # (nothing of a launched send kept here: its group and tensor)

    def close(self, why: str = "group closed") -> None:
        """Give up every queued send (their waits fail with ``why``) and stop the thread."""
        with self._cv:
            self._closed = why or "group closed"
            pending, self._heap = self._heap, []
            self._cv.notify_all()
            thread = self._thread
        for item in pending:
            item.work.failed(self._closed)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
