"""The ``strategy`` section: a tagged union on ``kind`` (allreduce, ps, pipeline)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from flotilla.config.base import Size, _fail, _Model


class AllReduceStrategy(_Model):
    """Synchronous data parallelism: bucketed all-reduce of gradients, atomic steps."""

    kind: Literal["allreduce"] = "allreduce"
    bucket_bytes: Size = 4 * 2**20
    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    on_abort: Literal["redo", "drop"] = "redo"


class PSStrategy(_Model):
    """Data parallelism through a sharded parameter server (SPEC §1)."""

    kind: Literal["ps"] = "ps"
    consistency: Literal["bsp", "asp", "ssp", "wsp"] = "ssp"
    staleness: int = Field(default=3, ge=0, le=1000)  # SSP bound s
    s_local: int = Field(default=0, ge=0, le=64)  # WSP local staleness
    clock_distance: int = Field(default=0, ge=0, le=1000)  # WSP clock distance D
    num_servers: int = Field(default=2, ge=1, le=256)
    update: Literal["server_sgd", "delta"] = "server_sgd"  # who applies the optimizer
    chunk_bytes: Size = 4 * 2**20  # tensors above this are split
    pull_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    cached_reads: bool = False  # SSP: skip pulls while the held weights are within the bound
    read_ahead: bool = False  # SSP (s >= 1) / ASP: pull the next clock's weights while computing
    snapshot_every_versions: int = Field(default=0, ge=0)  # 0 = never (by version count)
    snapshot_every_s: float = Field(default=0.0, ge=0)  # 0 = never (by time)

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


# Extend with new strategies by adding their models to this Union.
Strategy = Annotated[Union[AllReduceStrategy, PSStrategy, PipelineStrategy], Field(discriminator="kind")]
