"""The coordinator's lease: one quorum rule for partitions (issue 37 item 2), pure (DESIGN §1: no
I/O, no clock -- times are arguments).  Stated and property-tested here
(``tests/unit/test_lease.py``); wired into the membership machine (``cluster/rendezvous.py``:
the coordinator's side) and the worker's link (``roles/link.py``: the silence that starts ring
mode; ``roles/coordinated.py``: the hand-back).  ``docs/membership.md`` ("Partitions").

Why a rule is needed.  Proof of death keeps the coordinator and a ring of workers from both
forming views, but a network cut proves nothing: with proof alone the side with the coordinator
declares the others dead and goes on (even as a minority), and the other side waits forever.
Replacing proof by silence needs a rule under which two sides of a cut never both commit.

The rule (``lease_s`` = ``cluster.heartbeat_timeout_s``; ``margin_s`` covers the rate drift of
two clocks over a lease, and is one heartbeat interval in practice):

1. **Renewals are echoed stamps.**  Each heartbeat reply carries the coordinator's clock when it
   was sent (``lease_t``); the worker's next heartbeat echoes the newest stamp it *received*.
   The coordinator takes a worker as renewed at the echoed stamp -- never at a receipt time, so a
   heartbeat that waited in a socket (a frozen coordinator, a congested link) renews nothing new.
2. **The coordinator mints a view only while at least half of each possible ring base is with
   it** (:func:`coordinator_may_mint`, once per base): each member renewed within ``lease_s`` of
   now (on the coordinator's clock) **and is a member of the view to be adopted**, or is proven
   gone (a process death, a polite leave: it cannot be on another side).  A tie goes to the
   coordinator.  A *base* is an adopted view a strict majority of whose members may still run
   it: members enter an adopted view one by one (and say which view they run in their
   heartbeats), so the last adopted view and the ones before it that not enough members have
   left are all bases (``cluster/rendezvous_draft.py``: ``live_bases``).  Without that it stops
   minting -- its side stops committing -- and it declares nobody dead on silence.
3. **A worker holds the coordinator for gone only after ``lease_s + margin_s`` of silence** since
   the last reply it received (:func:`coordinator_gone`, on its own clock), and then enters ring
   mode; from then on its heartbeats echo nothing (they carry its ring view instead: the
   hand-back, rule 5).
4. **In ring mode a side commits only with a strict majority of the last view it ran**
   (:func:`side_may_commit`, the ring repair's ``may_adopt_alone``).
5. **The heal.**  A ring view newer than the coordinator's adopted one is taken over whole (the
   coordinator's own unadopted views are skipped, its members outside that view are suspected:
   their next poll brings them back as newcomers); a worker in ring mode whose coordinator answers
   again goes back to it.

Why it is safe.  Say the coordinator adopts V at time T while a side R in ring mode commits: R
holds a strict majority of the view B its members ran when they went on without the coordinator,
an adopted view that a strict majority of its members had not said they left -- so B was a base
at T, and the coordinator counted at least half of B, fresh and in V or proven gone.  Some W is
in both, counted fresh at T and in V (a proven-gone member is in no side).  W's echoed stamp
t_c <= T, W received it at t_w >= t_c, and W entered ring mode no earlier than
t_w + lease_s + margin_s > t_c + lease_s >= T: so at T, W had not entered ring mode, and it does
so with B as its base only if V never formed with it -- but V cannot form without W.  So at most
one side of any cut commits.  ``tests/unit/test_lease.py`` checks the instant-wise form over
random cuts, delays and heartbeat phases, and that counting receipt times instead of echoed
stamps breaks it; ``tests/unit/test_rendezvous_lease.py`` drives the membership machine (a view
not every member entered yet, a member proven gone that speaks again).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["LeaseTerms", "coordinator_gone", "coordinator_may_mint", "min_margin_s", "side_may_commit"]


def min_margin_s(*, drift: float, lease_s: float) -> float:
    """The smallest safe ``margin_s``: the drift of two clocks over a lease (``drift``: the largest
    relative rate error, e.g. 1e-4).  Message delays need none: renewals are echoed stamps."""
    return 2 * drift * lease_s


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    lease_s: float
    margin_s: float

    def __post_init__(self) -> None:
        for name in ("lease_s", "margin_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"LeaseTerms.{name} must be a finite number > 0, got {value!r}")


def strict_majority(part: Collection[int], whole: Collection[int]) -> bool:
    """Whether ``part`` holds more than half of ``whole``'s members."""
    members = set(whole)
    return bool(members) and 2 * len(set(part) & members) > len(members)


def coordinator_may_mint(
    last_view: Collection[int],
    renewed_at: Mapping[int, float],
    now: float,
    terms: LeaseTerms,
    *,
    new_members: Collection[int] | None = None,
    gone: Collection[int] = (),
) -> bool:
    """Rule 2: at least half of ``last_view`` (a view with members) renewed within
    ``lease_s`` of ``now`` and are members of the view to adopt (``new_members``; None: any), or
    are proven ``gone``.  ``renewed_at``: each worker's newest echoed stamp (rule 1)."""
    members = set(last_view)
    inside = members if new_members is None else members & set(new_members)
    fresh = {w for w in inside if w in renewed_at and now - renewed_at[w] <= terms.lease_s}
    return bool(members) and 2 * len(fresh | (members & set(gone))) >= len(members)


def coordinator_gone(last_reply_at: float, now: float, terms: LeaseTerms) -> bool:
    """Rule 3: the coordinator has been silent for more than ``lease_s + margin_s`` (the
    worker's receipt time of its last reply, on the worker's clock)."""
    return now - last_reply_at > terms.lease_s + terms.margin_s


def side_may_commit(side: Collection[int], last_view: Collection[int]) -> bool:
    """Rule 4: a side in ring mode commits only with a strict majority of the last view it ran."""
    return strict_majority(side, last_view)
