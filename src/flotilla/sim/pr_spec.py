"""Partial reduce's simulated form (``docs/simulator.md``): its settings as the simulator takes
them (:class:`PRSpec`, validated) and the strategy spec's ``simulated`` hook
(:func:`partial_reduce_of`); the run itself is ``sim/partial_reduce.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flotilla.sim.model import Change, Recovery, SimCluster, SimJob, SimResult
from flotilla.sync.pr_plan import ControllerConfig

__all__ = ["PRSpec", "partial_reduce_of"]


def _number(name: str, value: Any, *, low: float, high: float = math.inf, open_low: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low) or value > high:
        raise ValueError(f"PRSpec.{name} must be a finite number in {'(' if open_low else '['}{low}, {high}]"
                         f", got {value!r}")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PRSpec:
    """``group_size`` P >= 2; ``alpha``: DPR's weight base (1.0: CPR, constant 1/P);
    ``group_timeout_s``: how long the oldest ready worker waits before a smaller group forms;
    ``bridge_after``: committed groups per mixing round before only bridging groups form (0: twice
    the workers); ``name``: the strategy's kind in the result."""

    group_size: int
    alpha: float = 0.5
    group_timeout_s: float = 0.5
    bridge_after: int = 0
    name: str = "partial_reduce"

    def __post_init__(self) -> None:
        p = self.group_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 2:
            raise ValueError(f"PRSpec.group_size must be an integer >= 2, got {p!r}")
        _number("alpha", self.alpha, low=0.0, high=1.0, open_low=True)
        _number("group_timeout_s", self.group_timeout_s, low=0.0)
        b = self.bridge_after
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ValueError(f"PRSpec.bridge_after must be an integer >= 0, got {b!r}")

    def config(self) -> ControllerConfig:
        """The group controller's config (``sync/pr_plan.py``)."""
        return ControllerConfig(group_size=self.group_size, group_timeout_s=self.group_timeout_s,
                                alpha=self.alpha, bridge_after=self.bridge_after)  # fmt: skip

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        from flotilla.sim.partial_reduce import simulate_partial_reduce  # (it imports this module)

        return simulate_partial_reduce(job, cluster, self, changes=changes, recovery=recovery)


def partial_reduce_of(settings: Any) -> PRSpec:
    """``strategy: {kind: partial_reduce, group_size, weighting, alpha, group_timeout_s,
    bridge_after}`` (``StrategySpec.simulated``; the settings read by name; ``constant``
    weighting is alpha 1.0, as ``PartialReduceStrategy.controller_config``)."""
    constant = getattr(settings, "weighting", "dynamic") == "constant"
    return PRSpec(
        group_size=int(settings.group_size),
        alpha=1.0 if constant else float(getattr(settings, "alpha", 0.5)),
        group_timeout_s=float(getattr(settings, "group_timeout_s", 0.5)),
        bridge_after=int(getattr(settings, "bridge_after", 0)),
    )
