"""Strategy ``ps``'s settings and spec: data parallelism through a sharded parameter server
(SPEC §1; the runtime is ``sync/via_ps.py``, the servers ``ps/``).

The ``consistency`` is tagged: ``{kind: bsp}``, ``{kind: asp}``, ``{kind: ssp, staleness: 3}``,
``{kind: wsp, s_local: 2, clock_distance: 1}``.  The old spelling (``consistency: ssp`` plus
``staleness: 3`` at the strategy level) keeps working: it is folded into the tagged form before
validation.  The spec's ``package`` turns these settings and the job's optimizer (and, for
``update: server_sgd``, its learning-rate schedule) into the parameter server's package config
(:class:`flotilla.ps.config.PSConfig`): every value checked once, at validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, Field, model_validator
from torch import nn

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.settings import Settings, Size, fail
from flotilla.ps.config import DeltaUpdate, PSConfig, ReadMode, ServerSGD, UpdateRule
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, ConsistencyModel
from flotilla.ps.lr_schedule import Constant, LRSchedule
from flotilla.sync.base import SyncStrategy
from flotilla.sync.spec import (
    JobFacts,
    RunFacts,
    StrategyContext,
    StrategySettings,
    StrategySpec,
    settings_error,
)
from flotilla.sync.via_ps import PSSync

__all__ = [
    "SPEC",
    "ASPConsistency",
    "BSPConsistency",
    "Consistency",
    "PSStrategy",
    "SSPConsistency",
    "WSPConsistency",
]


class BSPConsistency(Settings):
    """Bulk synchronous: a pull for clock c waits until every worker pushed clock c - 1."""

    kind: Literal["bsp"] = "bsp"


class ASPConsistency(Settings):
    """Asynchronous: pulls never wait."""

    kind: Literal["asp"] = "asp"


class SSPConsistency(Settings):
    """Stale synchronous: a pull for clock c waits until the slowest worker's clock >= c - staleness."""

    kind: Literal["ssp"] = "ssp"
    staleness: int = Field(default=3, ge=0, le=1000)


class WSPConsistency(Settings):
    """Wave synchronous (HetPipe): waves of s_local + 1 minibatches, clock distance D."""

    kind: Literal["wsp"] = "wsp"
    s_local: int = Field(default=0, ge=0, le=64)  # local staleness inside a virtual worker
    clock_distance: int = Field(default=0, ge=0, le=1000)  # D


Consistency = Annotated[
    Union[BSPConsistency, ASPConsistency, SSPConsistency, WSPConsistency], Field(discriminator="kind")
]
_LOOSE = {"ssp": ("staleness",), "wsp": ("s_local", "clock_distance")}  # the old spelling's fields


def _fold_old_spelling(data: Any) -> Any:
    """Old spelling -> tagged: ``consistency: ssp`` becomes ``{kind: ssp}``, and the strategy-level
    ``staleness`` / ``s_local`` / ``clock_distance`` move into the consistency when they apply to
    its kind (they override the same key there: ``--set strategy.staleness=5`` works on either
    spelling); fields of another kind stay where they are and are ignored."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    c = data.get("consistency", {"kind": "ssp"})
    if isinstance(c, str):
        c = {"kind": c}
    elif isinstance(c, BaseModel):
        c = c.model_dump()
    if not isinstance(c, dict):
        return data
    c = dict(c)
    for name in _LOOSE.get(str(c.get("kind")), ()):
        if data.get(name) is not None:
            c[name] = data.pop(name)
    if "consistency" in data or c != {"kind": "ssp"}:
        data["consistency"] = c
    return data


class PSStrategy(StrategySettings):
    """Data parallelism through a sharded parameter server (SPEC §1)."""

    kind: Literal["ps"] = "ps"
    consistency: Consistency = SSPConsistency()
    # the old spelling (``consistency: ssp`` + ``staleness: 3``), folded into ``consistency``:
    staleness: Optional[int] = Field(default=None, ge=0, le=1000)
    s_local: Optional[int] = Field(default=None, ge=0, le=64)
    clock_distance: Optional[int] = Field(default=None, ge=0, le=1000)
    num_servers: int = Field(default=2, ge=1, le=256)
    update: Literal["server_sgd", "delta"] = "server_sgd"  # who applies the optimizer
    chunk_bytes: Size = 4 * 2**20  # tensors above this are split
    pull_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    cached_reads: bool = False  # SSP: skip pulls while the held weights are within the bound
    read_ahead: bool = False  # SSP (s >= 1) / ASP: pull the next clock's weights while computing
    snapshot_every_versions: int = Field(default=0, ge=0)  # 0 = never (by version count)
    snapshot_every_s: float = Field(default=0.0, ge=0)  # 0 = never (by time)
    # 2: every shard has a backup process and acknowledges a push only once the backup holds it
    # (chain replication, ps/replication.py: no acknowledged update is lost when a shard dies)
    replication: Literal[1, 2] = 1

    _old_spelling = model_validator(mode="before")(_fold_old_spelling)

    def servers_apply_optimizer(self) -> bool:
        return self.update == "server_sgd"

    @model_validator(mode="after")
    def _check(self) -> PSStrategy:
        if self.cached_reads and self.read_ahead:
            raise fail(
                "excludes cached_reads: set at most one of the two to true (got both true)", "read_ahead"
            )
        return self


def _check(settings: Any, facts: RunFacts) -> None:
    """What ``update: server_sgd`` needs (the servers apply the job's SGD): checked at validation,
    and again by ``ps_config_from`` for settings that bypassed it (the same rule, one place)."""
    if settings.update != "server_sgd":
        return
    if facts.optimizer_kind != "sgd":
        raise settings_error(
            "update",
            f"'server_sgd' needs job.optimizer.kind 'sgd' (got {facts.optimizer_kind!r}); use update: delta",
        )
    c = settings.consistency
    if isinstance(c, WSPConsistency) and c.s_local > 0:
        raise settings_error(
            "update",
            "must be 'delta' when consistency is 'wsp' with "
            f"s_local > 0 (got server_sgd, s_local={c.s_local})",
        )


def consistency_of(settings: PSStrategy) -> ConsistencyModel:
    """The pure consistency model of ``settings.consistency`` (its tag kept)."""
    c = settings.consistency
    if isinstance(c, SSPConsistency):
        return SSP(staleness=c.staleness)
    if isinstance(c, WSPConsistency):
        return WSP(s_local=c.s_local, clock_distance=c.clock_distance)
    return ASP() if isinstance(c, ASPConsistency) else BSP()


def ps_config_from(settings: PSStrategy, optimizer: Any, *, schedule: LRSchedule = Constant()) -> PSConfig:
    """The :class:`PSConfig` of validated ``settings`` and the job's ``optimizer`` settings;
    ``schedule``: the servers' learning-rate schedule (``update: server_sgd`` only)."""
    update: UpdateRule = DeltaUpdate()
    if settings.update == "server_sgd":
        o = optimizer
        _check(settings, RunFacts(num_workers=1, batch_size=1, optimizer_kind=str(getattr(o, "kind", ""))))
        update = ServerSGD(
            lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov, schedule=schedule
        )
    read_mode: ReadMode = (
        "cached" if settings.cached_reads else "read_ahead" if settings.read_ahead else "plain"
    )
    return PSConfig(
        consistency=consistency_of(settings),
        update=update,
        num_servers=settings.num_servers,
        chunk_bytes=settings.chunk_bytes,
        pull_timeout_s=settings.pull_timeout_s,
        read_mode=read_mode,
        snapshot_every_versions=settings.snapshot_every_versions,
        snapshot_every_s=settings.snapshot_every_s,
    )


def _package(settings: PSStrategy, job: JobFacts) -> PSConfig:
    schedule = job.schedule() if settings.update == "server_sgd" else Constant()
    return ps_config_from(settings, job.optimizer, schedule=schedule)


def _build(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(config, PSConfig):
        raise TypeError(f"strategy ps needs a PSConfig (its spec's package), got {type(config).__name__}")
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


SPEC = StrategySpec(
    kind="ps",
    settings=PSStrategy,
    build=_build,
    check=_check,
    summary="sharded parameter server: BSP / ASP / SSP / WSP consistency, replicated shards, churn",
    launch=LaunchNeeds(
        gpu=True,
        servers=True,
        clock_spread=True,
        durable_state="its servers' snapshots (docs/ps.md)",
        resumes=True,
    ),
    package=_package,
    simulated="flotilla.sim.ps:ps_of",
)
