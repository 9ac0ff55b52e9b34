"""Naive single-process reference of Partial Reduce (SPEC §5), the tests' oracle: NumPy only.

``X_{k+1} = (X_k - eta G_k) W_k``, replayed from a record: per worker, the sequence of its local
steps (the gradient it applied, already scaled) each followed by the group it then took part in
(members and weights; ``None``: solo, or a group that was not committed).  Groups are replayed in
the order of their ids, which is consistent with every worker's own order: a group's average
depends only on its members' models after their earlier groups and local steps.  Plain SGD (no
momentum): ``x_i <- x_i - lr * g``; a group: every member's model becomes ``sum_j w_j x_j``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GroupRecord", "StepRecord", "replay"]


@dataclass(frozen=True, slots=True)
class GroupRecord:
    group_id: int
    members: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class StepRecord:
    grad: np.ndarray  # flat, the gradient the local step applied
    group: GroupRecord | None  # the committed group after this step, if any


def replay(
    initial: Mapping[int, np.ndarray], history: Mapping[int, Sequence[StepRecord]], lr: float
) -> dict[int, np.ndarray]:
    """Every worker's final flat model."""
    x = {w: np.array(v, dtype=np.float64) for w, v in initial.items()}
    done = dict.fromkeys(history, 0)  # steps applied per worker
    groups: dict[int, GroupRecord] = {}
    where: dict[tuple[int, int], int] = {}  # (group id, worker) -> index of its step
    for w, steps in history.items():
        for i, s in enumerate(steps):
            if s.group is not None:
                groups[s.group.group_id] = s.group
                where[(s.group.group_id, w)] = i

    def advance(w: int, upto: int) -> None:  # apply w's local steps 0..upto inclusive
        while done[w] <= upto:
            x[w] = x[w] - lr * history[w][done[w]].grad
            done[w] += 1

    for gid in sorted(groups):
        g = groups[gid]
        for m in g.members:
            advance(m, where[(gid, m)])
        avg = sum(wt * x[m] for m, wt in zip(g.members, g.weights))
        for m in g.members:
            x[m] = np.array(avg)
    for w in history:
        advance(w, len(history[w]) - 1)
    return x
