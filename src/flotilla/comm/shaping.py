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

- **Message plane** (``comm/base.ClientBase.call``): a request is sent ``transfer_s(its bytes)``
  after the call (``LinkCosts.message``: the link from this process to the servers, which the
  cluster description does not name: the default link), and a reply is handed over
  ``transfer_s(its bytes)`` after it arrived.  Calls of one client are one after another already.

What is not modelled: contention between groups (each group's links are its own), between a
process's clients, and the transport's own time on the point-to-point and message paths, which
comes on top of the model's (loopback: tens of microseconds per megabyte, against the
milliseconds an emulated link slower than the host costs -- SPEC §8's rule: emulate links slower
than the host).  ``benchmarks/link_shaping.py`` prints measured against modelled times.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flotilla.core.log import get_logger

__all__ = ["GroupShaper", "HeldWork", "LinkCosts", "Shaping", "install", "installed", "payload_bytes"]

log = get_logger("comm.shaping")

NAME_KEY = "flotilla/shaping/name/"


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


@dataclass(frozen=True, slots=True)
class Shaping:
    """One process's shaping: its name (``cluster.workers[*].name``) and the links' costs."""

    me: str
    costs: LinkCosts

    def message_s(self, num_bytes: int) -> float:
        latency, per_byte = self.costs.message(self.me)
        return latency + num_bytes * per_byte


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


def payload_bytes(frames: Sequence[Any]) -> int:
    """The bytes of a message's frames (bytes, bytearrays, memoryviews, zmq frames)."""
    total = 0
    for f in frames:
        buf = getattr(f, "buffer", f)  # (a zmq.Frame's memoryview)
        total += memoryview(buf).nbytes
    return total


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

    def __init__(self, shaping: Shaping, names: tuple[str, ...], rank: int) -> None:
        self.shaping, self.names, self.rank = shaping, names, rank
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
    def join(cls, shaping: Shaping, store: Any, rank: int, world_size: int) -> GroupShaper:
        """The shaper of a group whose members published (its backend exists, so every member
        that shapes its links has).  A member that published nothing (it does not emulate links:
        not a process of this job's roles) is named ``rank<r>``: its links are the defaults."""
        names = []
        for r in range(world_size):
            key = f"{NAME_KEY}{r}"
            if r == rank:
                names.append(shaping.me)
            else:
                names.append(_as_str(store.get(key)) if store.check([key]) else f"rank{r}")
        return cls(shaping, tuple(names), rank)

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
                item.work.failed(f"send failed: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}")

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
