"""Strategy ``allreduce``'s settings, package config and spec (the registry reads ``SPEC``); the
strategy itself -- bucketed all-reduce, the vote, atomic steps -- is ``sync/allreduce.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.checks import require_choice, require_int, require_number
from flotilla.core.settings import Size
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.sync.base import SyncStrategy
from flotilla.sync.spec import StrategyContext, StrategySpec, VotedSettings

__all__ = ["SPEC", "AllReduceConfig", "AllReduceStrategy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduceConfig:
    """Package config of strategy ``allreduce`` (from the run's ``strategy: {kind: allreduce}``).
    ``step_timeout_s`` bounds every collective of a view's group; ``on_abort``: what a discarded
    step does -- ``redo`` it, or ``drop`` it and go on with the next."""

    bucket_bytes: int  # (no defaults here: ``AllReduceStrategy``'s are the only ones)
    step_timeout_s: float
    on_abort: Literal["redo", "drop"]
    grad_dtype: Literal["fp32", "bf16"] = "fp32"  # the gradients' dtype on the wire

    def __post_init__(self) -> None:
        require_int("AllReduceConfig", "bucket_bytes", self.bucket_bytes, min=1)
        require_number("AllReduceConfig", "step_timeout_s", self.step_timeout_s, gt=0.0)
        require_choice("AllReduceConfig", "on_abort", self.on_abort, ("redo", "drop"))
        require_choice("AllReduceConfig", "grad_dtype", self.grad_dtype, ("fp32", "bf16"))


class AllReduceStrategy(VotedSettings):
    """Synchronous data parallelism: bucketed all-reduce of gradients, atomic steps."""

    kind: Literal["allreduce"] = "allreduce"
    bucket_bytes: Size = 4 * 2**20
    # the gradients' dtype on the wire: bf16 halves the bytes each bucket sends (the sum is taken
    # in bfloat16, as DDP's bf16 compression hook does; every replica still gets the same bytes)
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    # (a resume may change it: what travels is not part of the state a checkpoint holds)
    free_fields: ClassVar[frozenset[str]] = frozenset({"grad_dtype"})

    def package(self) -> AllReduceConfig:
        return AllReduceConfig(
            bucket_bytes=int(self.bucket_bytes),
            step_timeout_s=self.step_timeout_s,
            on_abort=self.on_abort,
            grad_dtype=self.grad_dtype,
        )


def _build(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if isinstance(config, AllReduceStrategy):
        config = config.package()
    if not isinstance(config, AllReduceConfig):
        raise TypeError(f"strategy allreduce needs an AllReduceConfig, got {type(config).__name__}")
    return BucketedAllReduce(
        model,
        bucket_bytes=config.bucket_bytes,
        optimizer=optimizer,
        on_bucket_ready=ctx.on_bucket_ready,
        wire_dtype=torch.bfloat16 if config.grad_dtype == "bf16" else None,
    )


SPEC = StrategySpec(
    kind="allreduce",
    settings=AllReduceStrategy,
    build=_build,
    summary="synchronous data parallelism: bucketed ring all-reduce, atomic steps, elastic",
    launch=LaunchNeeds(gpu=True, auto_checkpoint=True),
    simulated="flotilla.sim.vote:allreduce_of",
)
