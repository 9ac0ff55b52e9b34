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
    group's shaping thread (``comm/shaping_groups.GroupShaper``), so the sender's compute goes
    on meanwhile as on a real link.  The order of sends to one destination is kept (the pipeline schedule's
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
import heapq
import itertools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flotilla.core.log import get_logger

__all__ = [
    "LinkCosts", "Nic", "ServerLink", "Shaping", "install", "installed", "payload_bytes", "scoped",
]  # fmt: skip

log = get_logger("comm.shaping")


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
