"""Run configuration (pydantic models) -> package configuration (frozen dataclasses).

Runtime modules take package configs, never pydantic models (DESIGN §5): this module is the one
place that reads a ``strategy: {kind: ps}`` section and the job's optimizer and builds the
:class:`flotilla.ps.config.PSConfig` the parameter server, its client and ``sync/via_ps`` use.

Errors are :class:`~flotilla.core.errors.ConfigError` naming the YAML field and the allowed values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flotilla.config.job import (
    ConstantSchedule,
    CosineSchedule,
    JobConfig,
    LinearWarmupSchedule,
    SGDOptimizer,
)
from flotilla.config.strategy import (
    AllReduceStrategy,
    ASPConsistency,
    BSPConsistency,
    PartialReduceStrategy,
    PSStrategy,
    SSPConsistency,
    WSPConsistency,
)
from flotilla.core.errors import ConfigError
from flotilla.ps.config import DeltaUpdate, PSConfig, ReadMode, ServerSGD, UpdateRule
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, ConsistencyModel
from flotilla.ps.lr_schedule import Constant, Cosine, LinearWarmup, LRSchedule
from flotilla.sync.pr_plan import ControllerConfig

if TYPE_CHECKING:
    from flotilla.config.schema import RunConfig

__all__ = [
    "sync_config_of",
    "pr_controller_config",
    "consistency_of",
    "lr_schedule_of",
    "ps_config_from",
    "ps_config_of",
    "update_rule_of",
]


def lr_schedule_of(job: JobConfig, total_steps: int | None = None) -> LRSchedule:
    """The pure schedule of ``job.schedule`` (``ps/lr_schedule.py``).  A cosine decay without
    ``decay_steps`` ends at the job's total steps: ``job.steps``, else ``total_steps`` (a job
    given in epochs: the sampler's steps per epoch times the epochs)."""
    match job.schedule:
        case ConstantSchedule():
            return Constant()
        case LinearWarmupSchedule(warmup_steps=w):
            return LinearWarmup(warmup_steps=w)
        case CosineSchedule(warmup_steps=w, min_lr=min_lr, decay_steps=t):
            horizon = t if t is not None else job.steps if job.steps is not None else total_steps
            if horizon is None:
                raise ConfigError(
                    "job.schedule.decay_steps: needed for a cosine schedule of a job given in epochs "
                    "where the number of steps is not known here (set decay_steps, or job.steps)"
                )
            if horizon <= w:
                raise ConfigError(
                    f"job.schedule.warmup_steps must be < the decay's end ({horizon} steps) (got {w})"
                )
            return Cosine(warmup_steps=w, decay_steps=horizon, min_factor=min_lr / job.optimizer.lr)
    raise ConfigError(f"job.schedule.kind must be constant, linear_warmup or cosine, got {job.schedule!r}")


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


def update_rule_of(strategy: PSStrategy, optimizer: Any, schedule: LRSchedule = Constant()) -> UpdateRule:
    """``ServerSGD`` from the job's SGD optimizer (and learning-rate ``schedule``) for
    ``update: server_sgd``, else ``DeltaUpdate`` (the workers' optimizers follow the schedule)."""
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
        schedule=schedule,
    )


def sync_config_of(cfg: RunConfig, total_steps: int | None = None) -> tuple[str, Any]:
    """The run's strategy as the registry builds it: its kind and what its spec's ``build`` takes.
    A settings model with a ``package()`` gives its package config; ``ps`` is built from the job's
    optimizer and schedule too; any other strategy takes its settings as they are."""
    st = cfg.strategy
    if cfg.strategy_spec.build is None:
        raise ConfigError(f"strategy.kind {st.kind!r} is not data parallel: run it with `flotilla run`")
    if isinstance(st, PSStrategy):
        return st.kind, ps_config_of(cfg, total_steps)
    if isinstance(st, (AllReduceStrategy, PartialReduceStrategy)):
        return st.kind, st.package()
    return st.kind, st


def ps_config_of(cfg: RunConfig, total_steps: int | None = None) -> PSConfig:
    """The :class:`PSConfig` of a whole run: ``strategy``, ``job.optimizer`` and, for
    ``update: server_sgd``, ``job.schedule`` applied by the servers (``total_steps``: see
    :func:`lr_schedule_of`; only a cosine decay of a job given in epochs needs it)."""
    if not isinstance(cfg.strategy, PSStrategy):
        raise ConfigError(f"strategy.kind must be 'ps' for a parameter-server job, got {cfg.strategy.kind!r}")
    server = cfg.strategy.update == "server_sgd"
    schedule = lr_schedule_of(cfg.job, total_steps) if server else Constant()
    return ps_config_from(cfg.strategy, cfg.job.optimizer, schedule=schedule)


def ps_config_from(strategy: PSStrategy, optimizer: Any, *, schedule: LRSchedule = Constant()) -> PSConfig:
    """The :class:`PSConfig` of a run's ``strategy`` (kind ps) and ``job.optimizer``; ``schedule``
    is the servers' learning-rate schedule (``server_sgd`` only; :func:`ps_config_of` passes the
    job's)."""
    if not isinstance(strategy, PSStrategy):
        raise ConfigError(f"strategy.kind must be 'ps' for a parameter-server job, got {strategy.kind!r}")
    read_mode: ReadMode = (
        "cached" if strategy.cached_reads else "read_ahead" if strategy.read_ahead else "plain"
    )
    return PSConfig(
        consistency=consistency_of(strategy),
        update=update_rule_of(strategy, optimizer, schedule),
        num_servers=strategy.num_servers,
        chunk_bytes=strategy.chunk_bytes,
        pull_timeout_s=strategy.pull_timeout_s,
        read_mode=read_mode,
        snapshot_every_versions=strategy.snapshot_every_versions,
        snapshot_every_s=strategy.snapshot_every_s,
    )


def pr_controller_config(cfg: RunConfig) -> ControllerConfig | None:
    """The partial-reduce controller's config (None for another strategy; the group size was
    checked against the cluster when the configuration was validated)."""
    st = cfg.strategy
    if not isinstance(st, PartialReduceStrategy):
        return None
    alpha = 1.0 if st.weighting == "constant" else st.alpha
    return ControllerConfig(
        group_size=st.group_size,
        group_timeout_s=st.group_timeout_s,
        alpha=alpha,
        bridge_after=st.bridge_after,
    )
