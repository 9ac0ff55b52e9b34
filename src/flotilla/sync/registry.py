"""Strategy kind -> factory: how the worker role builds a :class:`~flotilla.sync.base.SyncStrategy`.

A factory gets the replica (``model``), the worker's ``optimizer``, the strategy's *package*
config (a frozen dataclass such as :class:`~flotilla.sync.allreduce.AllReduceConfig` or
:class:`~flotilla.ps.config.PSConfig`, never a pydantic model) and a :class:`StrategyContext`
(who this worker is and what it can reach).  Strategies with per-view groups get their group
later, per view, through ``bind``; strategies that form groups while running build them by
namespace through ``StrategyContext.groups``.

Adding a strategy = one module in ``sync/`` (the class and its config dataclass) + one
``register("kind", factory)`` call; the built-in ones are registered below.  Tests register
toy strategies the same way (and ``unregister`` them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.ps.config import DeltaUpdate, PSConfig
from flotilla.sync.allreduce import AllReduceConfig, BucketedAllReduce, FaultHook
from flotilla.sync.base import SyncStrategy
from flotilla.sync.partial_reduce import PartialReduce, PartialReduceConfig
from flotilla.sync.via_ps import PSSync

__all__ = ["Factory", "StrategyContext", "build", "kinds", "register", "unregister"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyContext:
    """What a factory may use besides the model, optimizer and config.  ``rank``/``num_workers``
    are those of the view the strategy starts in; ``servers``/``secret`` reach PS shards."""

    worker_id: int
    rank: int
    num_workers: int
    secret: bytes = b""
    servers: tuple[str, ...] = ()
    on_bucket_ready: Callable[[int], None] | None = None
    fault_hook: FaultHook | None = None
    # groups formed while running (GroupNeed.PER_STEP): ``groups().get(namespace, members, me)``
    # (``comm.group_factory.GroupFactory``); ``members``/``epoch``: the view the strategy starts in
    groups: Callable[[], Any] | None = None
    members: tuple[int, ...] = ()
    epoch: int = 0
    # the coordinator's message plane (``call(op, body, timeout_s) -> dict``): partial reduce's controller
    coordinator: Any = None
    # worker ids the coordinator declared dead or gone (``ps``: evicted from the shards' clocks)
    gone: Callable[[], frozenset[int]] | None = None


Factory = Callable[[nn.Module, torch.optim.Optimizer, Any, StrategyContext], SyncStrategy]
_FACTORIES: dict[str, Factory] = {}


def register(kind: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``kind`` buildable; refuses to shadow an existing kind unless ``replace``."""
    if not kind or not kind.isidentifier():
        raise ConfigError(f"strategy kind must be an identifier, got {kind!r}")
    if kind in _FACTORIES and not replace:
        raise ConfigError(f"strategy kind {kind!r} is already registered")
    _FACTORIES[kind] = factory


def unregister(kind: str) -> None:
    _FACTORIES.pop(kind, None)


def kinds() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def build(
    kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    """A new strategy of ``kind``; ConfigError naming the registered kinds if unknown."""
    try:
        factory = _FACTORIES[kind]
    except KeyError:
        raise ConfigError(f"strategy.kind: unknown {kind!r}; registered: {', '.join(kinds())}") from None
    return factory(model, optimizer, config, ctx)


def _allreduce(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(config, AllReduceConfig):
        raise ConfigError(f"strategy allreduce needs an AllReduceConfig, got {type(config).__name__}")
    return BucketedAllReduce(
        model,
        bucket_bytes=config.bucket_bytes,
        optimizer=optimizer,
        on_bucket_ready=ctx.on_bucket_ready,
        fault_hook=ctx.fault_hook,
    )


def _ps(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(config, PSConfig):
        raise ConfigError(f"strategy ps needs a PSConfig, got {type(config).__name__}")
    return PSSync(
        model,
        config,
        ctx.servers,
        ctx.secret,
        ctx.worker_id,  # the PS identifies workers by their (unique, never reused) worker id
        num_workers=ctx.num_workers,
        gone=ctx.gone,
        members=ctx.members,
        optimizer=optimizer if isinstance(config.update, DeltaUpdate) else None,
    )


def _partial_reduce(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(config, PartialReduceConfig):
        raise ConfigError(f"strategy partial_reduce needs a PartialReduceConfig, got {type(config).__name__}")
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
        fault_hook=ctx.fault_hook,
    )


register("allreduce", _allreduce)
register("partial_reduce", _partial_reduce)
register("ps", _ps)
