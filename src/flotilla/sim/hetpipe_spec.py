"""``strategy: {kind: hetpipe}`` as the simulator sees it (pure; the run is ``sim/hetpipe.py``):
the placement policy, WSP's knobs, the servers' shards, and whether a lost VW is formed again
from other devices (``reform``: ``pipeline/vw_reform.py``; off unless asked for, as the runtime's
``strategy.reform``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flotilla.pipeline.vw_placement import POLICIES
from flotilla.sim.model import Change, Recovery, SimCluster, SimJob, SimResult

__all__ = ["HetPipeSpec", "hetpipe_of"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HetPipeSpec:
    """``strategy: {kind: hetpipe}``'s shape: ``placement`` (np, ed, hd, auto), ``s_local``,
    ``clock_distance`` (D), ``ps_shards`` (the optimizer state the partitioner counts is the
    job's: ``SimJob.optimizer_multiplier``), ``reform`` (a lost VW formed again from its surviving
    devices and free ones, ``pipeline/vw_reform.py``: off by default, as ``strategy.reform``)."""

    name: str = "hetpipe"
    placement: str = "auto"
    s_local: int = 0
    clock_distance: int = 0
    ps_shards: int = 1
    reform: bool = False  # a lost VW formed again from other devices (module doc; strategy.reform)

    def __post_init__(self) -> None:
        if self.placement not in (*POLICIES, "auto"):
            raise ValueError(
                f"HetPipeSpec.placement must be one of {', '.join(POLICIES)}, auto; got {self.placement!r} "
                "(given: the workers' order is the runtime's, a simulation places them)"
            )
        for name in ("s_local", "clock_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"HetPipeSpec.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.reform, bool):
            raise ValueError(f"HetPipeSpec.reform must be a bool, got {self.reform!r}")

    @property
    def wave_size(self) -> int:
        return self.s_local + 1

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        from flotilla.sim.hetpipe import simulate_hetpipe  # (the run imports this spec)

        return simulate_hetpipe(job, cluster, self, changes=changes, recovery=recovery)


def hetpipe_of(settings: Any) -> HetPipeSpec:
    """``strategy: {kind: hetpipe, ...}`` (``StrategySpec.simulated``; the settings read by name);
    ``placement: given`` is simulated as ``auto`` (a simulated cluster has no worker order)."""
    placement = str(getattr(settings, "placement", "auto"))
    return HetPipeSpec(
        placement="auto" if placement == "given" else placement,
        s_local=int(settings.s_local),
        clock_distance=int(settings.clock_distance),
        ps_shards=int(settings.ps_shards),
        reform=bool(getattr(settings, "reform", False)),  # (the runtime's strategy.reform)
    )
