"""Run configuration (pydantic models) -> package configuration (frozen dataclasses).

Runtime modules take package configs, never pydantic models (DESIGN §5): this module is the one
place that reads a ``strategy: {kind: ps}`` section and the job's optimizer and builds the
:class:`flotilla.ps.config.PSConfig` the parameter server, its client and ``sync/via_ps`` use.

Errors are :class:`~flotilla.core.errors.ConfigError` naming the YAML field and the allowed values.
"""

from __future__ import annotations

from typing import Any

from flotilla.config.job import SGDOptimizer
from flotilla.config.strategy import (
    ASPConsistency,
    BSPConsistency,
    PSStrategy,
    SSPConsistency,
    WSPConsistency,
)
from flotilla.core.errors import ConfigError
from flotilla.ps.config import DeltaUpdate, PSConfig, ReadMode, ServerSGD, UpdateRule
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, ConsistencyModel

__all__ = ["consistency_of", "ps_config_from", "update_rule_of"]


def consistency_of(strategy: PSStrategy) -> ConsistencyModel:
    """The tagged consistency model of ``strategy.consistency``."""
    match strategy.consistency:
        case BSPConsistency():
            return BSP()
        case ASPConsistency():
            return ASP()
        case SSPConsistency(staleness=s):
            return SSP(staleness=s)
        case WSPConsistency(s_local=s_local, clock_distance=d):
            return WSP(s_local=s_local, clock_distance=d)
    raise ConfigError(f"strategy.consistency must be bsp, asp, ssp or wsp, got {strategy.consistency!r}")


def update_rule_of(strategy: PSStrategy, optimizer: Any) -> UpdateRule:
    """``ServerSGD`` from the job's SGD optimizer for ``update: server_sgd``, else ``DeltaUpdate``."""
    if strategy.update != "server_sgd":
        return DeltaUpdate()
    if not isinstance(optimizer, SGDOptimizer):
        raise ConfigError(
            f"strategy.update: 'server_sgd' needs job.optimizer.kind 'sgd' "
            f"(got {getattr(optimizer, 'kind', optimizer)!r}); use update: delta"
        )
    c = consistency_of(strategy)
    if isinstance(c, WSP) and c.s_local > 0:
        raise ConfigError(
            "strategy.update must be 'delta' when consistency is 'wsp' with "
            f"s_local > 0 (got server_sgd, s_local={c.s_local})"
        )
    return ServerSGD(
        lr=optimizer.lr,
        momentum=optimizer.momentum,
        weight_decay=optimizer.weight_decay,
        nesterov=optimizer.nesterov,
    )


def ps_config_from(strategy: PSStrategy, optimizer: Any) -> PSConfig:
    """The :class:`PSConfig` of a run's ``strategy`` (kind ps) and ``job.optimizer``."""
    if not isinstance(strategy, PSStrategy):
        raise ConfigError(f"strategy.kind must be 'ps' for a parameter-server job, got {strategy.kind!r}")
    read_mode: ReadMode = (
        "cached" if strategy.cached_reads else "read_ahead" if strategy.read_ahead else "plain"
    )
    return PSConfig(
        consistency=consistency_of(strategy),
        update=update_rule_of(strategy, optimizer),
        num_servers=strategy.num_servers,
        chunk_bytes=strategy.chunk_bytes,
        pull_timeout_s=strategy.pull_timeout_s,
        read_mode=read_mode,
        snapshot_every_versions=strategy.snapshot_every_versions,
        snapshot_every_s=strategy.snapshot_every_s,
    )
