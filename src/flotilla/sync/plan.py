"""Pure decisions of data-parallel synchronisation: gradient buckets and the state donor.

Pure (DESIGN §1): no torch, no I/O, no clock.  The runtimes gather the inputs with collectives
(``sync/allreduce.py`` sizes its parameters; the worker role all-reduces a small probe) and act
on what these functions return, so every replica reaches the same decision from the same values.

- :func:`plan_buckets`: DDP's bucketing rule over parameter sizes in *reverse* registration order.
- :func:`choose_donor`: after a membership change, which replica sends its state (model,
  optimizer state, step) to the others.  The most advanced replica wins: the MAX step among the
  replicas that hold a state, ties broken by the MIN rank.  Nobody needs the state when no
  replica asked for it and every replica holding one is at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.core.errors import FlotillaError

__all__ = [
    "NO_STATE",
    "DonorChoice",
    "StateProbe",
    "choose_donor",
    "donor_rank",
    "plan_buckets",
    "reference_donor",
]

NO_STATE = -1
"""The step a replica reports when it holds no model state (a newcomer)."""


def plan_buckets(sizes_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices (given in *reverse* registration order) into buckets.

    DDP's rule: add tensors to the open bucket and close it once it holds ``>= bucket_bytes``, so
    a bucket exceeds the cap by at most one tensor and no tiny trailing bucket is split off.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = [[]]
    used = 0
    for idx, size in enumerate(sizes_bytes):
        buckets[-1].append(idx)
        used += size
        if used >= bucket_bytes:
            buckets.append([])
            used = 0
    return [b for b in buckets if b]


@dataclass(frozen=True, kw_only=True, slots=True)
class StateProbe:
    """What the replicas of one view reported, reduced: any ``wanted`` (OR), and the MAX and MIN
    step over all replicas (``NO_STATE`` for those without a state)."""

    wanted: bool
    max_step: int
    min_step: int

    def __post_init__(self) -> None:
        if self.min_step > self.max_step:
            raise ValueError(f"StateProbe.min_step {self.min_step} > max_step {self.max_step}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DonorChoice:
    """Whether a state transfer is needed, and the step every replica will hold afterwards."""

    transfer: bool
    step: int


class StateLost(FlotillaError):
    """No live replica holds the model state: every worker that had it is gone."""


def choose_donor(probe: StateProbe, *, epoch: int) -> DonorChoice:
    """Decide whether the replicas must receive the most advanced replica's state.

    Raises :class:`StateLost` when no replica holds a state (every holder is gone).
    """
    if probe.max_step < 0:
        raise StateLost(
            f"view {epoch}: no live replica holds the model state (every worker that had it is gone)"
        )
    return DonorChoice(
        transfer=probe.wanted or probe.max_step != probe.min_step,
        step=probe.max_step,
    )


def donor_rank(my_rank: int, my_step: int, max_step: int, world_size: int) -> int:
    """This replica's candidacy for donor, to be MIN-reduced over the view: its rank if it holds
    the most advanced state, else ``world_size`` (never a winner).  The MIN is the donor."""
    return my_rank if my_step >= 0 and my_step == max_step else world_size


def reference_donor(steps: Sequence[int]) -> int:
    """Naive oracle: the rank of the donor among replicas reporting ``steps`` (``NO_STATE`` for
    none); the first rank with the highest step."""
    best = max(steps)
    if best < 0:
        raise FlotillaError("no replica holds the model state")
    return steps.index(best)
