"""Pure read rules of a PS worker (``sync/via_ps.PSSync``): when ``push_pull(c)`` may skip the
pull, which clock a pull asks for, and what the weights held guarantee.

Pure (DESIGN §1): no torch, no I/O, no clock.  The runtime asks :func:`read_plan` what to do for
clock ``c`` and executes it; the tests check these rules against a naive reference.

Definitions: ``held_c_global`` (the worker's ``read_c_global``) is the MIN over the shards of the
global clock each shard had when it served the weights the worker holds: those weights contain
every worker's pushes for clocks below it.

- ``plain``: push ``c`` and pull the weights for ``c + 1`` in one round trip.
- ``cached`` (SSP(s) only): weights with ``held_c_global = g`` satisfy the SSP bound for every own
  clock ``k <= g + s``; so ``push_pull(c)`` skips the pull (an asynchronous push and the worker's
  own update applied locally) while ``g >= c + 1 - s``.  BSP (s = 0) can never skip.
- ``read_ahead`` (SSP with s >= 1, or ASP): the pull for ``c + 1`` left with the push of
  ``c - 1``; ``push_pull(c)`` loads it (pulling ``c + 1`` synchronously first when nothing is in
  flight) and sends ``[push c, pull c + 2]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ReadPlan",
    "all_pushed",
    "held_c_global",
    "may_skip_pull",
    "read_plan",
    "reference_may_skip_pull",
    "read_mode_notes",
    "within_ssp_bound",
]

ReadKind = Literal["push_pull", "push_only", "ahead"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadPlan:
    """What ``push_pull(clock)`` does: ``kind``; ``sync_pull`` the clock to pull synchronously
    before anything else (None: none); ``ahead_pull`` the clock the request sent with this push
    asks for (None: none in flight afterwards)."""

    kind: ReadKind
    sync_pull: int | None = None
    ahead_pull: int | None = None

    @property
    def pulls(self) -> bool:
        """Whether the model holds freshly pulled weights after this clock."""
        return self.kind != "push_only"


def held_c_global(shard_clocks: Sequence[int]) -> int:
    """``read_c_global`` of weights assembled from shards that served them at these clocks."""
    if not shard_clocks:
        raise ValueError("held_c_global needs at least one shard clock")
    return min(shard_clocks)


def may_skip_pull(*, held: int, clock: int, staleness: int) -> bool:
    """Cached reads: whether ``push_pull(clock)`` may serve clock ``clock + 1`` from the weights
    held (``read_c_global`` = ``held``) under SSP(``staleness``)."""
    return held >= clock + 1 - staleness


def reference_may_skip_pull(*, held: int, clock: int, staleness: int) -> bool:
    """Naive oracle of :func:`may_skip_pull`: enumerate the own clocks ``0 .. held + staleness``
    the held weights may serve under SSP and look for the next clock ``clock + 1`` among them."""
    return any(k == clock + 1 for k in range(0, held + staleness + 1))


def within_ssp_bound(*, held: int, clock: int, staleness: int) -> bool:
    """The SSP guarantee for weights used at own clock ``clock``: ``held >= clock - staleness``."""
    return held >= clock - staleness


def read_plan(mode: str, *, clock: int, held: int, staleness: int, ahead_in_flight: bool) -> ReadPlan:
    """The read step of ``push_pull(clock)`` under ``mode`` (``plain``/``cached``/``read_ahead``,
    the *effective* mode: ``cached`` only under SSP, ``read_ahead`` only where allowed)."""
    if clock < 0:
        raise ValueError(f"clock must be >= 0, got {clock}")
    if mode == "read_ahead":
        return ReadPlan(kind="ahead", sync_pull=None if ahead_in_flight else clock + 1, ahead_pull=clock + 2)
    if mode == "cached" and may_skip_pull(held=held, clock=clock, staleness=staleness):
        return ReadPlan(kind="push_only")
    if mode not in ("plain", "cached"):
        raise ValueError(f"read mode must be one of plain, cached, read_ahead, got {mode!r}")
    return ReadPlan(kind="push_pull")


def all_pushed(shard_clocks: Sequence[int], clock: int) -> bool:
    """Whether every worker has pushed ``clock`` clocks (or left) on every shard: the final pull
    may then read the job's final weights."""
    return held_c_global(shard_clocks) >= clock


def read_mode_notes(
    read_mode: str, consistency: str, *, read_ahead: bool, worker_id: int
) -> list[tuple[str, str]]:
    """What a worker says about its read mode at start-up, as ``(level, line)`` pairs: a
    read-ahead asked for where the model cannot use it, and (once per job: worker 0) the cost
    of read-ahead's staler reads."""
    notes = []
    if read_mode == "read_ahead" and not read_ahead:
        notes.append(
            (
                "info",
                f"strategy.read_ahead has no effect under {consistency} "
                "(needs ssp with staleness >= 1, or asp)",
            )
        )
    if read_ahead and worker_id == 0:
        notes.append(
            (
                "warning",
                "strategy.read_ahead: every read is up to one clock staler (the pull for clock c + 1 "
                "leaves before clock c is computed); at a learning rate and momentum tuned for BSP this "
                "can keep training from converging (measured: docs/ps.md, 'Read-ahead'; try "
                "benchmarks/ps_staleness.py)",
            )
        )
    return notes
