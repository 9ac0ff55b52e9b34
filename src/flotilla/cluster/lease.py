"""The coordinator's lease: one quorum rule for partitions (issue 37 item 2), pure (DESIGN §1: no
I/O, no clock -- times are arguments).  Stated and property-tested here
(``tests/unit/test_lease.py``); **not yet wired into the roles**: today ring mode starts only on
the coordinator's proven death (a closed connection), and the coordinator mints views for any
members that still heartbeat.  ``docs/membership.md`` ("Partitions") says what changes when it is.

Why a rule is needed.  Proof of death keeps the coordinator and a ring of workers from both
forming views, but a network cut proves nothing: the side with the coordinator declares the
others dead and goes on (even as a minority), and the other side waits forever.  Replacing proof
by silence needs a rule under which two sides of a cut can never both commit.

The rule (``lease_s`` = ``cluster.heartbeat_timeout_s``; ``margin_s`` covers one heartbeat
interval, two one-way message delays and clock-rate drift over a lease):

1. **The coordinator mints a view only while it holds a lease from a strict majority of the last
   adopted view's members**: each of them renewed (a heartbeat the coordinator *received*) within
   ``lease_s`` of now, on the coordinator's clock (:func:`coordinator_may_mint`).  Without one it
   stops minting -- its side stops committing -- and waits.
2. **A worker holds the coordinator for gone only after ``lease_s + margin_s`` of silence** since
   the last reply it received from it, on its own clock (:func:`coordinator_gone`), and only then
   enters ring mode.  Ring mode is final for that lease: its later heartbeats, should they reach
   the coordinator again, renew nothing -- they carry the ring's view, which the coordinator must
   take as its last view before it mints again (the hand-back at a heal; not built).
3. **In ring mode a side commits only if it holds a strict majority of the last view it ran**
   (:func:`side_may_commit`, the ring repair's ``may_adopt_alone``).
4. When the cut heals, every worker of a side that stopped rejoins as a newcomer
   (``cluster/rejoin.py``).

Why it is safe.  Two strict majorities of one view share a member W.  The coordinator counts W
until ``r + lease_s``, r being the receipt of W's last heartbeat; W's last reply left the
coordinator after an earlier heartbeat's receipt, at most one heartbeat interval plus two delays
before r, so W enters ring mode no earlier than ``r - (interval + 2 delay) + lease_s + margin_s``
-- after the coordinator stopped counting W when ``margin_s >= interval + 2 delay`` (plus drift).
So at no instant can the coordinator hold a majority lease while a majority of the same view is in
ring mode: at most one side of any cut commits.  ``tests/unit/test_lease.py`` checks this over
random cuts, delays and heartbeat phases, and that a margin below the bound breaks it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["LeaseTerms", "coordinator_gone", "coordinator_may_mint", "min_margin_s", "side_may_commit"]


def min_margin_s(
    *, heartbeat_s: float, max_delay_s: float, drift: float = 0.0, lease_s: float = 0.0
) -> float:
    """The smallest safe ``margin_s``: one heartbeat interval, two one-way delays, and the drift
    of two clocks over a lease (``drift``: the largest relative rate error, e.g. 1e-4)."""
    return heartbeat_s + 2 * max_delay_s + 2 * drift * lease_s


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
    last_view: Collection[int], renewed_at: Mapping[int, float], now: float, terms: LeaseTerms
) -> bool:
    """Rule 1: a strict majority of ``last_view`` renewed within ``lease_s`` of ``now``
    (``renewed_at``: the coordinator's receipt time of each worker's last heartbeat)."""
    fresh = [w for w in last_view if w in renewed_at and now - renewed_at[w] <= terms.lease_s]
    return strict_majority(fresh, last_view)


def coordinator_gone(last_reply_at: float, now: float, terms: LeaseTerms) -> bool:
    """Rule 2: the coordinator has been silent for more than ``lease_s + margin_s`` (the
    worker's receipt time of its last reply, on the worker's clock)."""
    return now - last_reply_at > terms.lease_s + terms.margin_s


def side_may_commit(side: Collection[int], last_view: Collection[int]) -> bool:
    """Rule 3: a side in ring mode commits only with a strict majority of the last view it ran."""
    return strict_majority(side, last_view)
