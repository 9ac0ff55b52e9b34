"""The ``strategy`` section: a tagged union on ``kind`` (allreduce, ps, pipeline).

The ps strategy's ``consistency`` is itself tagged: ``{kind: bsp}``, ``{kind: asp}``,
``{kind: ssp, staleness: 3}``, ``{kind: wsp, s_local: 2, clock_distance: 1}``.  The old spelling
(``consistency: ssp`` plus ``staleness: 3`` at the strategy level) keeps working: it is folded into
the tagged form before validation.  ``flotilla.config.convert`` turns these models into the
parameter server's package config.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, model_validator

from flotilla.config.base import Size, _fail, _Model


class AllReduceStrategy(_Model):
    """Synchronous data parallelism: bucketed all-reduce of gradients, atomic steps."""

    kind: Literal["allreduce"] = "allreduce"
    bucket_bytes: Size = 4 * 2**20
    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    on_abort: Literal["redo", "drop"] = "redo"


class BSPConsistency(_Model):
    """Bulk synchronous: a pull for clock c waits until every worker pushed clock c - 1."""

    kind: Literal["bsp"] = "bsp"


class ASPConsistency(_Model):
    """Asynchronous: pulls never wait."""

    kind: Literal["asp"] = "asp"


class SSPConsistency(_Model):
    """Stale synchronous: a pull for clock c waits until the slowest worker's clock >= c - staleness."""

    kind: Literal["ssp"] = "ssp"
    staleness: int = Field(default=3, ge=0, le=1000)


class WSPConsistency(_Model):
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


class PSStrategy(_Model):
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

    @model_validator(mode="after")
    def _check(self) -> PSStrategy:
        if self.cached_reads and self.read_ahead:
            raise _fail(
                "excludes cached_reads: set at most one of the two to true (got both true)", "read_ahead"
            )
        return self


class PipelineStrategy(_Model):
    """Pipeline model parallelism (SPEC §3)."""

    kind: Literal["pipeline"] = "pipeline"
    schedule: Literal["gpipe", "1f1b", "pipedream"] = "1f1b"
    num_stages: int = Field(default=2, ge=1, le=64)
    num_microbatches: int = Field(default=8, ge=1, le=4096)
    vertical_sync: bool = False
    step_timeout_s: float = Field(default=60.0, gt=0, le=86400)


class PartialReduceStrategy(_Model):
    """Partial Reduce (SPEC §5): ready workers average their models in groups of ``group_size``
    formed by the coordinator's controller; ``dynamic`` weights a member δ versions behind the
    freshest by ``alpha``^δ (``constant``: 1/P).  ``group_size`` < the number of workers is
    checked against the cluster when the job starts (``config.convert.pr_controller_config``)."""

    kind: Literal["partial_reduce"] = "partial_reduce"
    group_size: int = Field(default=3, ge=2, le=4096)
    weighting: Literal["constant", "dynamic"] = "dynamic"
    alpha: float = Field(default=0.5, gt=0, le=1)
    group_timeout_s: float = Field(default=0.5, ge=0, le=3600)
    bridge_after: int = Field(default=0, ge=0, le=10**6)  # 0: twice the number of workers
    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)


# Extend with new strategies by adding their models to this Union.
Strategy = Annotated[
    Union[AllReduceStrategy, PSStrategy, PipelineStrategy, PartialReduceStrategy], Field(discriminator="kind")
]
