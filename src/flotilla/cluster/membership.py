"""Membership views (pure).

A *view* is a snapshot of who trains: an epoch number (monotonically increasing) and the sorted
``worker_id``s of its members.  ``rank`` is a worker's index inside one view; ``worker_id`` is
stable across views.  ``successor`` makes the next view, ``merge_since`` re-expresses a view
relative to the one a worker actually runs.  Who is in the next view, and when it is formed, is
decided by the rendezvous state machine (``rendezvous.py``) and, later, ring repair (SPEC §7).

Invariants
- ``epoch`` strictly increases with every transition that changes the member set.
- members are unique and sorted, so every process derives the same rank from the same view.
- a view is never empty except the terminal view of a finished job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class View:
    epoch: int
    members: tuple[int, ...]
    joined: tuple[int, ...] = ()  # members new in this view (need the model from a donor)
    left: tuple[int, ...] = ()  # members of the previous view that are gone

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        if tuple(sorted(set(self.members))) != self.members:
            raise ValueError(f"members must be unique and sorted, got {self.members}")

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, worker_id: int) -> int:
        try:
            return self.members.index(worker_id)
        except ValueError:
            raise KeyError(f"worker {worker_id} is not a member of view {self.epoch}") from None

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.members

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "members": list(self.members),
            "joined": list(self.joined),
            "left": list(self.left),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> View:
        return cls(
            epoch=int(d["epoch"]),
            members=tuple(int(m) for m in d["members"]),
            joined=tuple(int(m) for m in d.get("joined", ())),
            left=tuple(int(m) for m in d.get("left", ())),
        )


def successor(view: View, members: tuple[int, ...]) -> View:
    """The next view with ``members``; joined/left are relative to ``view``."""
    old = set(view.members)
    return View(
        epoch=view.epoch + 1,
        members=members,
        joined=tuple(m for m in members if m not in old),
        left=tuple(sorted(old - set(members))),
    )


def merge_since(adopted: View, target: View) -> View:
    """``target`` re-expressed relative to the last *adopted* view (views in between may be skipped).

    Survivors jump from the view they run to the newest one; joined/left must be computed against
    what they actually run, not against an intermediate view nobody adopted.
    """
    old = set(adopted.members)
    return View(
        epoch=target.epoch,
        members=target.members,
        joined=tuple(m for m in target.members if m not in old),
        left=tuple(sorted(old - set(target.members))),
    )
