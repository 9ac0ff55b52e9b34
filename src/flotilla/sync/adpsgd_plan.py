"""The pure decisions of AD-PSGD (``sync/adpsgd.py``; Lian et al., ICML'18): who initiates an
average, with whom, and the passive side's one exchange slot.  No torch, no I/O, no clock (the time
comes in as an argument): the runtime and a simulator call the same code.

- **Roles** (:func:`roles`): the live members (neither gone nor finished), in id order, alternate
  active / passive (Lian et al.'s bipartition): only an active worker starts an average, and only
  with a passive one, so averages form a bipartite graph.  Workers may hold different knowledge of
  who is live for a while (a death is learnt at different times); two workers that both believe
  they are active and pick each other are answered ``busy`` (below), never deadlocked.
- **Peer choice** (:func:`choose_peer`): seeded by (seed, worker, step, attempt), uniform over the
  candidates: the passive live members, minus those this worker suspects (a failed exchange).
- **The passive slot** (:class:`Slot`): one exchange at a time touches a worker.  ``prepare``
  takes the slot for an exchange (``busy`` while another one, or the worker's own step, holds it;
  an exchange prepared longer than its deadline ago is aborted first: its active died or stalled),
  ``commit`` / ``abort`` release it; a decided exchange keeps its outcome for a later ``abort`` or
  ``outcome`` query (an active whose commit reply was lost asks).  Deadlock freedom: a slot is
  only ever waited for by its own worker (bounded by the deadline); a peer's request never waits
  for a slot, it is answered ``busy``.
- **The collector** (:func:`collector`): who averages the final replicas -- the lowest finished
  worker whose replica is still live, once every other member finished or died; the job's rank 0
  unless it died first (then the next one takes over: a finished worker waits for the job's end).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Outcome", "Prepared", "Slot", "candidates", "candidates_of", "choose_peer", "collector", "roles"]

Outcome = Literal["committed", "aborted"]
REMEMBERED = 256  # decided exchanges whose outcome a slot keeps


def roles(members: Iterable[int], gone: Iterable[int] = (), finished: Iterable[int] = ()) -> tuple[
    tuple[int, ...], tuple[int, ...]
]:  # fmt: skip
    """``(active, passive)``: the live members in id order, alternately (the first is active)."""
    out = set(gone) | set(finished)
    live = sorted(m for m in set(members) if m not in out)
    return tuple(live[0::2]), tuple(live[1::2])


def candidates(
    me: int,
    members: Iterable[int],
    *,
    gone: Iterable[int] = (),
    finished: Iterable[int] = (),
    suspected: Iterable[int] = (),
) -> tuple[int, ...]:
    """The peers ``me`` may start an average with: none when ``me`` is passive (or not live);
    else the passive live members it does not suspect."""
    active, passive = roles(members, gone, finished)
    return candidates_of(me, frozenset(active), passive, suspected)


def candidates_of(
    me: int, active: frozenset[int], passive: tuple[int, ...], suspected: Iterable[int] = ()
) -> tuple[int, ...]:
    """:func:`candidates` from the :func:`roles` already worked out (``active`` as a set): a caller
    that keeps the roles while the membership does not change (the simulator) asks this."""
    if me not in active:
        return ()
    skip = set(suspected)
    if not skip:
        return passive  # (``me`` is active, so not among them)
    return tuple(p for p in passive if p not in skip and p != me)


def choose_peer(seed: int, me: int, step: int, attempt: int, among: tuple[int, ...]) -> int | None:
    """One of ``among``, uniformly, the same for the same (seed, me, step, attempt); None: empty."""
    if not among:
        return None
    rng = random.Random(f"adpsgd:{seed}:{me}:{step}:{attempt}")
    return among[rng.randrange(len(among))]


def collector(finished: Iterable[int], lost: Iterable[int]) -> int | None:
    """Who averages the final replicas: the lowest ``finished`` worker whose replica is not
    ``lost`` (declared dead, or finished then died); None: no finished replica lives."""
    out = set(lost)
    return min((w for w in finished if w not in out), default=None)


@dataclass(frozen=True, slots=True)
class Prepared:
    """The exchange holding a slot: its id, its active worker and when it expires."""

    xid: str
    active: int
    deadline: float


@dataclass(slots=True)
class Slot:
    """One worker's exchange slot (the module doc).  ``holder``: None (free), ``"self"`` (the
    worker's own step or own exchange) or the :class:`Prepared` exchange."""

    holder: Prepared | Literal["self"] | None = None
    decided: OrderedDict[str, Outcome] = field(default_factory=OrderedDict)
    closed: bool = False  # finished or closing: no exchange any more

    def expire(self, now: float, gone: AbstractSet[int] = frozenset()) -> Prepared | None:
        """Abort the prepared exchange whose deadline passed, or whose active is ``gone`` (declared
        dead: it will never commit); returns it (None: nothing expired)."""
        h = self.holder
        if isinstance(h, Prepared) and (now >= h.deadline or h.active in gone):
            self._decide(h.xid, "aborted")
            self.holder = None
            return h
        return None

    def prepare(
        self, xid: str, active: int, now: float, timeout_s: float
    ) -> Literal["prepared", "busy", "closed"]:
        if self.closed:
            return "closed"
        self.expire(now)
        if self.holder is not None or xid in self.decided:
            return "busy"
        self.holder = Prepared(xid, active, now + timeout_s)
        return "prepared"

    def commit(self, xid: str) -> Outcome | Literal["unknown"]:
        """Commit the prepared exchange ``xid`` (its answer if decided already)."""
        h = self.holder
        if isinstance(h, Prepared) and h.xid == xid:
            self._decide(xid, "committed")
            self.holder = None
            return "committed"
        return self.decided.get(xid, "unknown")

    def abort(self, xid: str) -> Outcome | Literal["unknown"]:
        """Abort the prepared exchange ``xid``; an exchange decided already keeps its outcome."""
        h = self.holder
        if isinstance(h, Prepared) and h.xid == xid:
            self._decide(xid, "aborted")
            self.holder = None
            return "aborted"
        return self.decided.get(xid, "unknown")

    def take(self, now: float) -> bool:
        """The worker's own turn: True if the slot was free (now held by ``"self"``)."""
        self.expire(now)
        if self.holder is None:
            self.holder = "self"
            return True
        return False

    def release(self) -> None:
        if self.holder == "self":
            self.holder = None

    def _decide(self, xid: str, outcome: Outcome) -> None:
        self.decided[xid] = outcome
        while len(self.decided) > REMEMBERED:
            self.decided.popitem(last=False)
