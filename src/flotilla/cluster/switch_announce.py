"""Where an announced strategy switch takes effect (pure): a step no live worker has reached.

A switch at run time is announced like a view change: the coordinator picks a step beyond every
live worker's current step and tells every worker (heartbeat replies); each one switches when it
reaches that step (``trainer/loop_machine.py``).  The step must be far enough ahead that the
announcement reaches every worker before it gets there: each worker's last reported step, plus
the steps it trains at its measured rate during ``lead_s`` (a few heartbeat intervals, the time
the news takes to reach it), plus one.  A worker that still learns of it too late switches at its
next boundary; under a vote (``Regime.VOTE``) the switch rides the vote, so every member switches
at the same step even then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Progress", "SwitchRefused", "announce_step"]


class SwitchRefused(ValueError):
    """No step is left to switch at (the job is ending), or nobody trains."""


@dataclass(frozen=True, slots=True)
class Progress:
    step: int  # the worker's last reported step
    steps_per_s: float = 0.0  # its measured rate (0: unknown)


def announce_step(
    live: Mapping[int, Progress], *, lead_s: float, total_steps: int | None, min_ahead: int = 2
) -> int:
    """The step to switch at: past every live worker's reach within ``lead_s`` (at least
    ``min_ahead`` steps past the most advanced one); ``SwitchRefused`` if that is not before
    ``total_steps`` (None: unknown here, e.g. a job counted in epochs)."""
    if lead_s < 0 or min_ahead < 1:
        raise ValueError(f"announce_step needs lead_s >= 0 and min_ahead >= 1, got {lead_s}, {min_ahead}")
    if not live:
        raise SwitchRefused("no live worker to switch")
    reach = max(p.step + math.ceil(max(p.steps_per_s, 0.0) * lead_s) + 1 for p in live.values())
    step = max(reach, max(p.step for p in live.values()) + min_ahead)
    if total_steps is not None and step >= total_steps:
        raise SwitchRefused(f"too late to switch: the workers reach step {step} of {total_steps} first")
    return step
