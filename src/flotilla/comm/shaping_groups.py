"""The collective plane's side of link shaping (``comm/shaping.py`` has the plan, the costs and
the message plane's side; ``docs/links.md``): a group's :class:`GroupShaper` -- its members'
names, each destination's modelled link and the thread that launches the sends when their
modelled time has come -- and the works a shaped group's handles wait on: :class:`HeldWork` (a
collective held to its modelled time) and :class:`DelayedWork` (a send still on its link).
"""

from __future__ import annotations

import datetime as _dt
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flotilla.comm.shaping import Shaping

__all__ = ["NAMES_WAIT_S", "DelayedWork", "GroupShaper", "HeldWork"]

NAME_KEY = "flotilla/shaping/name/"
NAMES_WAIT_S = 10.0  # (a group's members publish their names at its construction: see join)


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
