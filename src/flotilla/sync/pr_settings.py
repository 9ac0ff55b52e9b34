"""The YAML side of strategy ``partial_reduce`` and its spec: the settings
(``strategy: {kind: partial_reduce, ...}``), their check against the cluster, the worker's
strategy (``sync/partial_reduce.py``) built from them, and the group controller the coordinator
hosts (``sync/pr_service.py``)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.errors import ConfigError
from flotilla.sync.base import SyncStrategy
from flotilla.sync.partial_reduce import PartialReduce, PartialReduceConfig
from flotilla.sync.pr_plan import ControllerConfig
from flotilla.sync.pr_service import PRController
from flotilla.sync.spec import (
    RunFacts,
    ServiceFacts,
    StrategyContext,
    StrategySettings,
    StrategySpec,
    settings_error,
)

__all__ = ["SPEC", "PartialReduceStrategy"]


class PartialReduceStrategy(StrategySettings):
    """Partial Reduce (SPEC §5): ready workers average their models in groups of ``group_size``
    formed by the coordinator's controller; ``dynamic`` weights a member δ versions behind the
    freshest by ``alpha``^δ (``constant``: 1/P).  ``group_size`` < the number of workers (checked
    against the cluster by :func:`_check`)."""

    kind: Literal["partial_reduce"] = "partial_reduce"
    group_size: int = Field(default=3, ge=2, le=4096)
    weighting: Literal["constant", "dynamic"] = "dynamic"
    alpha: float = Field(default=0.5, gt=0, le=1)
    group_timeout_s: float = Field(default=0.5, ge=0, le=3600)
    bridge_after: int = Field(default=0, ge=0, le=10**6)  # 0: twice the number of workers
    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)

    def collective_timeout_s(self) -> float:
        return self.step_timeout_s

    def controller_config(self) -> ControllerConfig:
        """The group controller's config (``sync/pr_plan.py``); the group size was checked
        against the cluster at validation."""
        return ControllerConfig(
            group_size=self.group_size,
            group_timeout_s=self.group_timeout_s,
            alpha=1.0 if self.weighting == "constant" else self.alpha,
            bridge_after=self.bridge_after,
        )

    def package(self) -> PartialReduceConfig:
        return PartialReduceConfig(
            group_size=self.group_size,
            weighting=self.weighting,
            alpha=self.alpha,
            group_timeout_s=self.group_timeout_s,
            step_timeout_s=self.step_timeout_s,
            bridge_after=self.bridge_after,
        )


def _check(settings: Any, facts: RunFacts) -> None:
    if not 2 <= settings.group_size < facts.num_workers:
        n = facts.num_workers
        got = f"got {settings.group_size}"
        if "group_size" not in getattr(settings, "model_fields_set", {"group_size"}):
            got += " (the default)" + (f": set it, e.g. group_size: {n - 1}" if n > 2 else "")
        if n <= 2:
            got += "; partial reduce needs at least 3 workers (with 2, use kind: allreduce)"
        raise settings_error("group_size", f"must be >= 2 and < the number of workers ({n}), {got}")


def _build(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if isinstance(config, PartialReduceStrategy):
        config = config.package()
    if not isinstance(config, PartialReduceConfig):
        raise TypeError(f"strategy partial_reduce needs a PartialReduceConfig, got {type(config).__name__}")
    if ctx.coordinator is None or ctx.groups is None:
        raise ConfigError(
            "strategy partial_reduce needs a coordinator and groups by namespace (flotilla run)"
        )
    return PartialReduce(
        model,
        optimizer,
        config,
        worker_id=ctx.worker_id,
        num_workers=ctx.num_workers,
        link=ctx.coordinator,
        groups=ctx.groups,
        joined=ctx.joined,
    )


def _service(settings: PartialReduceStrategy, facts: ServiceFacts) -> PRController:
    """The group controller the coordinator hosts (``sync/pr_service.py``)."""
    return PRController.of_facts(settings.controller_config(), facts)


SPEC = StrategySpec(
    kind="partial_reduce",
    settings=PartialReduceStrategy,
    build=_build,
    check=_check,
    service=_service,
    # (the replicas differ: no one worker's state is the job's; a checkpoint section was ignored)
    launch=LaunchNeeds(
        gpu=True, durable_state="its workers' own replicas, which differ (no job checkpoint yet)"
    ),
    simulated="flotilla.sim.partial_reduce:partial_reduce_of",
    summary="Partial Reduce: local steps, models averaged in groups of the ready workers (constant/dynamic)",
)
